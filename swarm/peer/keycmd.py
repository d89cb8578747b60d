"""``colibri-swarm key [--new]``: show the swarm key as a typeable code and a terminal QR code.

With no stored key one is created (as the first ``join`` would); ``--new`` replaces the stored
key, after which every other peer needs the new code (``join --key CODE``).
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import TextIO

import qrcode

from swarm.peer import swarmkey


def render_qr(text: str) -> str:
    """``text`` as a QR code drawn with Unicode half blocks (qrcode's ASCII output), one string."""
    qr = qrcode.QRCode(border=2, error_correction=qrcode.constants.ERROR_CORRECT_M)
    qr.add_data(text)
    qr.make(fit=True)
    out = io.StringIO()
    qr.print_ascii(out=out, invert=True)
    return out.getvalue()


def show_key(key: swarmkey.SwarmKey, out: TextIO) -> None:
    """Print the swarm id, the code and its QR code."""
    print(f"swarm id: {key.swarm_id}", file=out)
    print(f"swarm key code (type it on another machine: colibri-swarm join --key CODE):\n\n    {key.code}\n", file=out)
    print(render_qr(key.code), file=out)
    print(f"stored in {swarmkey.key_path()} (mode 0600); anyone with this code can join the swarm.", file=out)
    print(f"OpenAI API token (Authorization: Bearer …, for the coordinator's /v1 API; the code works too):\n"
          f"    {key.api_token}", file=out)


def main_key(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if getattr(args, "new", False):
        key = swarmkey.create()
        print("created a new swarm key; peers with the old key can no longer join.\n", file=out)
    else:
        existing = swarmkey.load()
        key = existing or swarmkey.create()
        if existing is None:
            print("no swarm key was stored; created one.\n", file=out)
    show_key(key, out)
    return 0
