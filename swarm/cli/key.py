"""``colibri-swarm key [--new]``: show the swarm key as a typeable code and a terminal QR code.

With no stored key one is created (as the first ``join`` would); ``--new`` replaces the stored
key, after which every other peer needs the new code (``join --key CODE``). ``--new`` is
refused while a ``join`` runs from the same config directory: that peer would go on with the
old key.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from swarm import paths
from swarm.errors import SwarmError
from swarm.terminal import render_qr
from swarm.keys import swarmkey


def show_key(key: swarmkey.SwarmKey, out: TextIO) -> None:
    """Print the swarm id, the code and its QR code, the API token, and write the API's CA
    certificate to the config directory (:func:`swarm.peer.coordinator.api_tls.write_ca`), naming it."""
    from swarm.paths import config_dir
    from swarm.peer.coordinator.api_tls import ca_fingerprint, write_ca

    print(f"swarm id: {key.swarm_id}", file=out)
    print(f"swarm key code (type it on another machine: colibri-swarm join --key CODE):\n\n    {key.code}\n", file=out)
    print(render_qr(key.code), file=out)
    print(f"stored in {swarmkey.key_path()} (mode 0600); anyone with this code can join the swarm: "
          "never use it as an API key.", file=out)
    ca = write_ca(key, config_dir())
    print(f"\nOpenAI API token (Authorization: Bearer …, for the coordinator's /v1 API):\n    {key.api_token}", file=out)
    print(f"The API speaks HTTPS with a certificate of the swarm's CA, written to\n    {ca}\n"
          f"    SHA-256 {ca_fingerprint(key)}\n"
          f"Trust it in a client: curl --cacert {ca} …; SSL_CERT_FILE={ca} (Python, the openai package); "
          "or httpx.Client(verify=PATH).", file=out)


def main_key(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if getattr(args, "new", False):
        holder = paths.config_dir_holder()
        if holder is not None:
            pid = f" (pid {holder})" if holder else ""
            raise SwarmError(f"a colibri-swarm peer{pid} runs from {paths.config_dir()} with the current key and "
                             "would go on using it: stop that `colibri-swarm join` first, then run "
                             "`colibri-swarm key --new`")
        key = swarmkey.create()
        print("created a new swarm key; peers with the old key can no longer join.\n", file=out)
    else:
        existing = swarmkey.load()
        key = existing or swarmkey.create()
        if existing is None:
            print("no swarm key was stored; created one.\n", file=out)
    show_key(key, out)
    return 0
