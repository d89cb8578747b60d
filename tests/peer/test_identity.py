"""Device identity (swarm.keys.identity): key, certificate, peer id, fingerprint, storage, aiortc hook."""

from __future__ import annotations

import base64
import datetime
import hashlib
import re
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from swarm.errors import IdentityError
from swarm.keys import identity as ident_mod
from swarm.peer.net.auth import normalize_fingerprint
from swarm.keys.identity import Identity, load_or_create, peer_id_of_certificate
from swarm.peer.net.messages import PEER_ID_RE

NOW = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc)


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg"


def test_peer_id_is_base32_of_the_spki_hash() -> None:
    ident = Identity.generate(NOW)
    spki = ident.certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    want = base64.b32encode(hashlib.sha256(spki).digest()[:16]).decode().rstrip("=").lower()
    assert ident.peer_id == want == peer_id_of_certificate(ident.certificate)
    assert PEER_ID_RE.fullmatch(ident.peer_id)


def test_certificate_is_p256_self_signed_long_lived() -> None:
    ident = Identity.generate(NOW)
    cert = ident.certificate
    assert isinstance(cert.public_key().curve, ec.SECP256R1)
    assert cert.issuer == cert.subject
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == ident.peer_id
    cert.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    assert cert.not_valid_after_utc - NOW >= datetime.timedelta(days=3649)


def test_fingerprint_matches_aiortc() -> None:
    ident = Identity.generate(NOW)
    rtc = ident.rtc_certificate()
    (fp,) = [f for f in rtc.getFingerprints() if f.algorithm == "sha-256"]
    assert ident.fingerprint == f"sha-256 {fp.value}" == normalize_fingerprint(ident.fingerprint)
    assert re.fullmatch(r"sha-256 [0-9A-F]{2}(:[0-9A-F]{2}){31}", ident.fingerprint)


def test_created_once_with_0600_and_reused(config) -> None:
    first = load_or_create(NOW)
    path = config / "identity.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create(NOW + datetime.timedelta(days=1))
    assert again.peer_id == first.peer_id and again.fingerprint == first.fingerprint


def test_certificate_renewed_with_the_same_key_near_expiry(config) -> None:
    first = load_or_create(NOW)
    later = NOW + datetime.timedelta(days=3650 - 10)
    renewed = load_or_create(later)
    assert renewed.peer_id == first.peer_id
    assert renewed.fingerprint != first.fingerprint
    assert renewed.certificate.not_valid_after_utc > later + datetime.timedelta(days=3000)
    assert load_or_create(later).fingerprint == renewed.fingerprint  # stored


def test_damaged_or_foreign_identity_files_are_named(config) -> None:
    path = config / "identity.pem"
    config.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"garbage")
    with pytest.raises(IdentityError, match="identity.pem: not a PEM"):
        load_or_create(NOW)
    other = Identity.generate(NOW)
    mixed = Identity.generate(NOW).to_pem().split(b"-----BEGIN CERTIFICATE-----")[0] + other.certificate.public_bytes(
        serialization.Encoding.PEM
    )
    path.write_bytes(mixed)
    with pytest.raises(IdentityError, match="does not belong to the key"):
        load_or_create(NOW)
    ed = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(ed + other.certificate.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(IdentityError, match="not ECDSA P-256"):
        load_or_create(NOW)


def test_repr_hides_the_key() -> None:
    ident = Identity.generate(NOW)
    assert repr(ident) == f"Identity(peer_id={ident.peer_id!r})"
    assert ident_mod.IDENTITY_FILE == "identity.pem"
