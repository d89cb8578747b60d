"""Device identity: a long-term ECDSA P-256 key pair, its self-signed DTLS certificate, the peer id.

* **Key**: ECDSA on P-256 — aiortc's DTLS (OpenSSL, cipher list ``ECDHE-ECDSA-*``) and browsers
  accept it; Ed25519 certificates fail the DTLS handshake (docs/architecture.md, "Links").
* **Certificate**: self-signed X.509, SHA-256 signature, subject CN = peer id, valid for 10 years
  and renewed with the same key when less than 30 days remain, so the peer id never changes.
  WebRTC checks the certificate only against the SDP fingerprint, never against a CA.
* **Peer id**: the first 16 bytes of SHA-256 over the DER SubjectPublicKeyInfo of the public key,
  lower-case RFC 4648 base32 without padding: 26 characters ``[a-z2-7]``.
* **Fingerprint**: SHA-256 of the certificate DER in SDP form, ``"sha-256 AB:CD:…"``
  (what ``swarm.peer.net.auth`` puts in the channel transcript).
* **Storage**: ``config_dir()/identity.pem`` (PKCS#8 key + certificate, PEM), mode 0600,
  created once and reused.

A peer connection uses this certificate through :func:`swarm.peer.net.rtc.set_certificate`
(:meth:`Identity.rtc_certificate` gives aiortc's form); the link reads the remote's with
:func:`swarm.peer.net.rtc.remote_certificate`, and :func:`peer_id_of_certificate` turns it into the
peer id a Python peer must claim.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.errors import IdentityError
from swarm.paths import IDENTITY_FILE, identity_file, write_private

log = logging.getLogger(__name__)

CERT_VALID_DAYS = 3650
CERT_RENEW_DAYS = 30  # renew the certificate (same key) when fewer days than this remain
PEER_ID_BYTES = 16


def peer_id_of_public_key(public_key: ec.EllipticCurvePublicKey) -> str:
    """Peer id of a public key: base32(SHA-256(SPKI DER)[:16]), lower case, no padding (26 chars)."""
    spki = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    digest = hashlib.sha256(spki).digest()[:PEER_ID_BYTES]
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


def peer_id_of_certificate(cert: x509.Certificate) -> str:
    """Peer id of the key inside a (remote) certificate; IdentityError if it is not ECDSA P-256."""
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise IdentityError("the certificate's key is not ECDSA P-256")
    return peer_id_of_public_key(key)


def fingerprint_of_certificate(cert: x509.Certificate) -> str:
    """SHA-256 fingerprint in SDP ``a=fingerprint`` form: ``"sha-256 AB:CD:…"`` (RFC 8122)."""
    return "sha-256 " + ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def _self_signed(key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, peer_id_of_public_key(key.public_key()))])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
        .sign(key, hashes.SHA256())
    )


@dataclass(frozen=True)
class Identity:
    """This device's key pair and DTLS certificate. ``repr`` shows only the peer id."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"

    @classmethod
    def generate(cls, now: datetime.datetime | None = None) -> Identity:
        key = ec.generate_private_key(ec.SECP256R1())
        return cls(key, _self_signed(key, now or datetime.datetime.now(datetime.timezone.utc)))

    @property
    def peer_id(self) -> str:
        return peer_id_of_public_key(self.key.public_key())

    @property
    def fingerprint(self) -> str:
        """``"sha-256 AB:CD:…"``, the value aiortc puts in ``a=fingerprint`` of our SDP."""
        return fingerprint_of_certificate(self.certificate)

    def rtc_certificate(self):
        """This identity as an ``aiortc.rtcdtlstransport.RTCCertificate(key, cert)``."""
        from aiortc.rtcdtlstransport import RTCCertificate

        return RTCCertificate(key=self.key, cert=self.certificate)

    def to_pem(self) -> bytes:
        key = self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return key + self.certificate.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def from_pem(cls, data: bytes, where: str = "identity") -> Identity:
        """Parse :meth:`to_pem` output; IdentityError naming ``where`` if it is not a valid identity."""
        try:
            key = serialization.load_pem_private_key(data, password=None)
            cert = x509.load_pem_x509_certificate(data[data.index(b"-----BEGIN CERTIFICATE-----") :])
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{where}: not a PEM private key and certificate ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
            raise IdentityError(f"{where}: the key is not ECDSA P-256")
        if cert.public_key() != key.public_key():
            raise IdentityError(f"{where}: the certificate does not belong to the key")
        return cls(key, cert)

    def renewed(self, now: datetime.datetime) -> Identity:
        """Self, or the same key with a fresh certificate when the current one nears its end."""
        if self.certificate.not_valid_after_utc - now > datetime.timedelta(days=CERT_RENEW_DAYS):
            return self
        return Identity(self.key, _self_signed(self.key, now))


def identity_path() -> Path:
    return identity_file()


def load_or_create(now: datetime.datetime | None = None) -> Identity:
    """This device's identity from ``config_dir()``; created (0600) on first use, renewed when due.

    Raises IdentityError naming the file if it exists but is damaged (move it away to start a
    new identity: the peer id changes then).
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    path = identity_path()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        ident = Identity.generate(now)
        write_private(path, ident.to_pem())
        log.info("created device identity %s in %s", ident.peer_id, path)
        return ident
    if path.stat().st_mode & 0o077:
        log.warning("%s was readable by others; setting its mode to 0600", path)
        path.chmod(0o600)
    ident = Identity.from_pem(data, where=str(path))
    fresh = ident.renewed(now)
    if fresh is not ident:
        write_private(path, fresh.to_pem())
        log.info("renewed the DTLS certificate of %s (same key, same peer id)", ident.peer_id)
    return fresh
