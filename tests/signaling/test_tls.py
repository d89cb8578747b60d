"""The signaling certificate: made once with a P-256 key, kept (0600 key), reused, repaired."""

from __future__ import annotations

import hashlib
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.errors import SwarmError
from swarm.signaling import tls


def test_created_then_reused(tmp_path):
    first = tls.load_or_create(tmp_path)
    again = tls.load_or_create(tmp_path)
    assert first == again
    der = ssl.PEM_cert_to_DER_cert(first.cert_path.read_text())
    assert first.sha256 == hashlib.sha256(der).digest()
    cert = x509.load_pem_x509_certificate(first.cert_path.read_bytes())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    assert stat.S_IMODE(first.key_path.stat().st_mode) == 0o600
    assert first.ssl_context().minimum_version == ssl.TLSVersion.TLSv1_2


def test_damaged_pair_is_replaced(tmp_path):
    first = tls.load_or_create(tmp_path)
    first.cert_path.write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    second = tls.load_or_create(tmp_path)
    assert second.sha256 != first.sha256
    assert tls.load_or_create(tmp_path) == second


def test_fingerprint_formats():
    raw = bytes(range(32))
    text = tls.format_fingerprint(raw)
    assert text.startswith("00:01:02:") and len(text) == 95
    assert tls.parse_fingerprint(text) == raw
    assert tls.parse_fingerprint(raw.hex().upper()) == raw
    for bad in ("", "00:11", "zz" * 32, raw.hex() + "00"):
        with pytest.raises(SwarmError, match="fingerprint"):
            tls.parse_fingerprint(bad)
