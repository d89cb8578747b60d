"""The terminal: the one rich console every command prints through, and escaping of our data.

rich reads ``[style]`` markup and ``:emoji:`` codes in what it prints, so a certificate
fingerprint ``…:CD:…`` would show a 💿 and a peer named ``[red]`` would vanish. The console
made here has emoji codes off, and every value that comes from data (names, ids, fingerprints,
paths, error texts) passes through :func:`esc` before it goes into a markup string.
"""

from __future__ import annotations

import io
from typing import Any

import qrcode

from rich.console import Console
from rich.markup import escape


def console(**options: Any) -> Console:
    """A rich Console with emoji codes and automatic highlighting off (``options`` go to Console)."""
    return Console(**{"highlight": False, "soft_wrap": True, "emoji": False, **options})


def esc(value: object) -> str:
    """``str(value)`` with rich markup escaped, to embed in a markup string verbatim."""
    return escape(str(value))


def render_qr(text: str) -> str:
    """``text`` as a QR code drawn with Unicode half blocks (qrcode's ASCII output), one string."""
    qr = qrcode.QRCode(border=2, error_correction=qrcode.constants.ERROR_CORRECT_M)
    qr.add_data(text)
    qr.make(fit=True)
    out = io.StringIO()
    qr.print_ascii(out=out, invert=True)
    return out.getvalue()
