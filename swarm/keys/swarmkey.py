"""The swarm key: 256-bit secret, its typeable code, the swarm id and the sub-keys derived from it.

Code format (docs/security.md, "Swarm key"): the 32 key bytes followed by a 3-byte check
(the first 3 bytes of SHA-256 over ``b"colibri-swarm key check v1" + key``), 35 bytes = 280 bits,
written in Crockford base32 as 56 symbols in groups of 4 joined by ``-``. Decoding ignores
case, dashes and spaces, reads ``I``/``L`` as ``1`` and ``O`` as ``0``, and rejects anything
else; a wrong check (any mistyped symbol, with probability 1 - 2**-24) raises
:class:`~swarm.errors.KeyCodeError`.

Sub-keys are HKDF-SHA256 (RFC 5869) with an empty salt and ``info = b"colibri-swarm v1 " +
label``; labels: ``signaling`` (WebSocket challenge/response), ``channel-auth`` (data-channel
transcript HMAC), ``api-token`` (bearer token of the OpenAI-compatible API), ``api-ca`` (the
private key of the API's certificate authority, the same on every key holder), ``slice-token``
(HMAC key of the per-slice bearer tokens of the HTTPS slice server), ``swarm-id``
(public identifier advertised in mDNS TXT; it cannot be turned back into the key).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.errors import KeyCodeError
from swarm.paths import write_private

log = logging.getLogger(__name__)

KEY_BYTES = 32
CHECK_BYTES = 3
CODE_SYMBOLS = 56  # (32 + 3) bytes * 8 / 5
GROUP = 4
ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32
_VALUE = {c: i for i, c in enumerate(ALPHABET)} | {"I": 1, "L": 1, "O": 0}
KEY_FILE = "swarm.key"
SWARM_ID_BYTES = 8  # shown as 16 hex digits


def _check(key: bytes) -> bytes:
    return hashlib.sha256(b"colibri-swarm key check v1" + key).digest()[:CHECK_BYTES]


def encode_code(key: bytes) -> str:
    """The typeable code of a 32-byte key: 56 Crockford base32 symbols, groups of 4 with dashes."""
    if len(key) != KEY_BYTES:
        raise KeyCodeError(f"a swarm key is {KEY_BYTES} bytes, got {len(key)}")
    n = int.from_bytes(key + _check(key), "big")
    symbols = "".join(ALPHABET[(n >> (5 * i)) & 31] for i in reversed(range(CODE_SYMBOLS)))
    return "-".join(symbols[i : i + GROUP] for i in range(0, CODE_SYMBOLS, GROUP))


def decode_code(code: str) -> bytes:
    """The 32-byte key of a code; KeyCodeError naming the problem (length, symbol, checksum)."""
    text = "".join(c for c in code.upper() if c not in "- \t\n")
    bad = [(i, c) for i, c in enumerate(text) if c not in _VALUE]
    if bad:
        i, c = bad[0]
        raise KeyCodeError(
            f"swarm key code: {c!r} (symbol {i + 1}) is not a code symbol; codes use 0-9 and A-Z "
            "without U (run `colibri-swarm key` on a peer of the swarm to see the code)"
        )
    if len(text) != CODE_SYMBOLS:
        raise KeyCodeError(f"swarm key code has {len(text)} symbols; a code has {CODE_SYMBOLS} (14 groups of 4)")
    n = 0
    for c in text:
        n = (n << 5) | _VALUE[c]
    raw = n.to_bytes(KEY_BYTES + CHECK_BYTES, "big")
    key, check = raw[:KEY_BYTES], raw[KEY_BYTES:]
    if check != _check(key):
        raise KeyCodeError("swarm key code: the checksum does not match, a symbol is mistyped; check the code again")
    return key


def derive(key: bytes, label: str, length: int = 32) -> bytes:
    """HKDF-SHA256 sub-key of the swarm key for one purpose (``label``); see the module doc."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=b"colibri-swarm v1 " + label.encode()).derive(
        key
    )


@dataclass(frozen=True)
class SwarmKey:
    """A swarm key and what follows from it. ``repr`` never shows the secret."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise KeyCodeError(f"a swarm key is {KEY_BYTES} bytes, got {len(self.secret)}")

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_code(cls, code: str) -> SwarmKey:
        return cls(decode_code(code))

    @property
    def code(self) -> str:
        return encode_code(self.secret)

    @property
    def swarm_id(self) -> str:
        """Public id of the swarm (16 hex digits), safe to advertise in mDNS TXT records."""
        return derive(self.secret, "swarm-id", SWARM_ID_BYTES).hex()

    @property
    def signaling_key(self) -> bytes:
        """HMAC key of the signaling server's challenge/response (32 bytes)."""
        return derive(self.secret, "signaling")

    @property
    def channel_auth_key(self) -> bytes:
        """HMAC key of data-channel authentication (32 bytes; ``swarm.peer.net.auth``)."""
        return derive(self.secret, "channel-auth")

    @property
    def slice_token_key(self) -> bytes:
        """HMAC key of the slice server's per-slice bearer tokens (32 bytes; ``swarm.peer.weights.slice_http``)."""
        return derive(self.secret, "slice-token")

    @property
    def api_ca_seed(self) -> bytes:
        """Seed of the API certificate authority's private key (48 bytes; ``swarm.peer.coordinator.api_tls``)."""
        return derive(self.secret, "api-ca", 48)

    @property
    def api_token(self) -> str:
        """Bearer token of the coordinator's HTTP API (64 hex digits)."""
        return derive(self.secret, "api-token").hex()


def key_path() -> Path:
    from swarm.paths import config_dir

    return config_dir() / KEY_FILE


def load() -> SwarmKey | None:
    """The stored swarm key, or None if there is none. KeyCodeError if the file is damaged."""
    path = key_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    if path.stat().st_mode & 0o077:
        log.warning("%s was readable by others; setting its mode to 0600", path)
        path.chmod(0o600)
    try:
        return SwarmKey.from_code(text)
    except KeyCodeError as exc:
        raise KeyCodeError(f"{path}: {exc}; store a good code with `colibri-swarm join --key CODE`") from None


def store(code: str) -> SwarmKey:
    """Check ``code`` and store it as this machine's swarm key (``join --key CODE``)."""
    key = SwarmKey.from_code(code)
    write_private(key_path(), (key.code + "\n").encode("ascii"))
    return key


def create() -> SwarmKey:
    """Make and store a new random swarm key, replacing any stored one (``key --new``)."""
    key = SwarmKey.generate()
    write_private(key_path(), (key.code + "\n").encode("ascii"))
    return key


def load_or_create() -> SwarmKey:
    """The stored swarm key; the first ``join`` creates one when there is none."""
    return load() or create()
