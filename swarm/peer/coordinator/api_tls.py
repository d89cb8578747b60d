"""TLS for the coordinator's OpenAI-compatible API: a certificate authority derived from the swarm key.

Whichever peer coordinates serves the API, and the coordinator changes with elections, so
clients cannot pin one server's certificate. Instead every key holder derives the same
**API certificate authority**: an ECDSA P-256 key from the swarm key's ``api-ca`` sub-key
(HKDF, :attr:`~swarm.keys.swarmkey.SwarmKey.api_ca_seed`) and a self-signed CA certificate
with fixed fields and a deterministic (RFC 6979) signature — byte for byte the same on every
machine, so its SHA-256 fingerprint is one value to compare. A coordinator issues itself a
short-lived server certificate from it, naming its addresses (IP SANs) so that clients that
check host names (``openai``, curl) accept it. ``colibri-swarm key`` writes the CA certificate
to ``api-ca.pem`` in the config directory for such clients; the CLI pins the CA it derives.

Only key holders can issue certificates the CA signs, as only they can compute the API token:
the CA adds no new secret, it keeps the token and the prompts off the wire in plain text.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.tls import format_fingerprint

CA_FILE = "api-ca.pem"
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_CA_NOT_BEFORE = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)  # fixed: the CA is the same everywhere
_CA_NOT_AFTER = datetime.datetime(2125, 1, 1, tzinfo=datetime.UTC)
SERVER_VALID_DAYS = 30  # a coordinator issues a new server certificate each time it starts the API


def _ca_private_key(key: SwarmKey) -> ec.EllipticCurvePrivateKey:
    # 48 bytes reduced mod n: bias below 2**-128 (FIPS 186-5 A.2.1's extra-bits method).
    scalar = int.from_bytes(key.api_ca_seed, "big") % (_P256_ORDER - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def ca_certificate(key: SwarmKey) -> x509.Certificate:
    """The swarm's API CA certificate: identical bytes on every holder of ``key``."""
    private = _ca_private_key(key)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"colibri-swarm API CA {key.swarm_id}")])
    serial = int.from_bytes(hashlib.sha256(key.api_ca_seed).digest()[:16], "big") >> 1  # positive, < 2**127
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(serial)
        .not_valid_before(_CA_NOT_BEFORE)
        .not_valid_after(_CA_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
    )
    try:
        return builder.sign(private, hashes.SHA256(), ecdsa_deterministic=True)
    except TypeError:  # cryptography without RFC 6979 in builders: trusted all the same, but the
        return builder.sign(private, hashes.SHA256())  # fingerprint then differs between machines


def ca_pem(key: SwarmKey) -> bytes:
    """The CA certificate as PEM (what ``verify=``, ``SSL_CERT_FILE`` and ``--cacert`` take)."""
    return ca_certificate(key).public_bytes(serialization.Encoding.PEM)


def ca_fingerprint(key: SwarmKey) -> str:
    """SHA-256 of the CA certificate's DER, as ``AB:CD:…`` (shown by ``key`` and ``join``)."""
    return format_fingerprint(hashlib.sha256(ca_certificate(key).public_bytes(serialization.Encoding.DER)).digest())


def write_ca(key: SwarmKey, directory: Path) -> Path:
    """Write the CA certificate to ``directory / api-ca.pem`` (public; mode 0644); return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CA_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(ca_pem(key))
    os.replace(tmp, path)
    return path


def server_context(key: SwarmKey, addresses: list[str], *, now: datetime.datetime | None = None) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2+) with a fresh certificate the swarm's API CA signs.

    addresses: IPv4/IPv6 addresses and host names clients may connect to; ``127.0.0.1``,
        ``::1``, ``localhost`` and this host's name (and ``NAME.local``) are always added.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key = _ca_private_key(key)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname() or "localhost"
    names = dict.fromkeys([*addresses, "127.0.0.1", "::1", "localhost", host, f"{host.split('.')[0]}.local"])
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"colibri-swarm API {host}"[:64])]))
        .issuer_name(ca_certificate(key).subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads files only: a private temporary directory, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="colibri-api-tls-") as tmp:
        cert_file, key_file = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + ca_pem(key))
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def client_context(key: SwarmKey) -> ssl.SSLContext:
    """A client TLS context that trusts only the swarm's API CA (the pin); host names are not
    checked, since the address came from the swarm itself (status file or mDNS)."""
    ctx = ssl.create_default_context(cadata=ca_pem(key).decode("ascii"))
    ctx.check_hostname = False
    return ctx
