"""The signaling server's self-signed TLS certificate: made once, kept, reused.

The peer page needs a secure context (WebGPU, WebCrypto), so the server speaks HTTPS even
on a LAN. There is no CA: Python peers pin the certificate's SHA-256 fingerprint, which the
host advertises in its mDNS TXT record; people compare the printed fingerprint.
The key is ECDSA P-256; certificate and key live in ``swarm.paths.config_dir()`` as
``signaling-cert.pem`` / ``signaling-key.pem`` (key file mode 0600).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarm.errors import SwarmError

CERT_FILE = "signaling-cert.pem"
KEY_FILE = "signaling-key.pem"
VALID_DAYS = 3650


@dataclass(frozen=True)
class ServerCertificate:
    """Paths of the PEM certificate and key, and the certificate's SHA-256 over its DER (32 bytes)."""

    cert_path: Path
    key_path: Path
    sha256: bytes

    @property
    def fingerprint(self) -> str:
        """The fingerprint as people compare it: upper-case hex pairs joined by colons."""
        return format_fingerprint(self.sha256)

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side TLS context with this certificate (TLS 1.2+)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx


def format_fingerprint(sha256: bytes) -> str:
    """``AB:CD:…`` for 32 bytes of SHA-256 (the form WebRTC and browsers show)."""
    return ":".join(f"{b:02X}" for b in sha256)


def parse_fingerprint(text: str) -> bytes:
    """32 bytes from a SHA-256 fingerprint in hex, with or without colons, any case.

    Raises SwarmError naming the text when it is not 64 hex digits.
    """
    digits = text.replace(":", "").strip()
    try:
        value = bytes.fromhex(digits)
    except ValueError:
        value = b""
    if len(value) != 32:
        raise SwarmError(f"not a SHA-256 certificate fingerprint (64 hex digits): {text!r}")
    return value


def load_or_create(directory: Path) -> ServerCertificate:
    """Load the certificate kept in ``directory``, creating it (and its key) the first time.

    A damaged pair is replaced by a new one (the fingerprint changes; peers learn it by mDNS).
    """
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    if cert_path.exists() and key_path.exists():
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1):
                return ServerCertificate(cert_path, key_path, _der_sha256(cert))
        except ValueError:
            pass
    return _create(cert_path, key_path)


def _create(cert_path: Path, key_path: Path) -> ServerCertificate:
    key = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname() or "localhost"
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"colibri-swarm {host}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    alt_names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write_atomic(key_path, key_pem, 0o600)
    _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return ServerCertificate(cert_path, key_path, _der_sha256(cert))


def _der_sha256(cert: x509.Certificate) -> bytes:
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).digest()


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    # Write beside the target and rename, so two processes never see half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
