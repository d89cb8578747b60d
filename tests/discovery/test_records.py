"""mDNS TXT records: round trip through zeroconf's own TXT encoding, and each malformed key refused."""

from __future__ import annotations

import dataclasses

import pytest
from zeroconf import ServiceInfo

from swarm.discovery.mdns import instance_name
from swarm.discovery.records import SERVICE_TYPE, ServerRecord, decode_txt, encode_txt, is_ours
from swarm.errors import RemoteProtocolError

RECORD = ServerRecord(
    name=f"colibri-a-1.{SERVICE_TYPE}", version=1, swarm_id="0123456789abcdef", port=8443,
    fingerprint=bytes(range(32)), host="peer-a", started=1796000000.123, addresses=("10.0.0.2",),
)


def zeroconf_txt(props):
    """TXT properties as a browser gets them: encoded to DNS TXT by zeroconf, parsed back."""
    info = ServiceInfo(SERVICE_TYPE, RECORD.name, port=RECORD.port, properties=props)
    return ServiceInfo(SERVICE_TYPE, RECORD.name, port=RECORD.port, properties=info.text).properties


def test_round_trip_through_dns_txt():
    txt = zeroconf_txt(encode_txt(RECORD))
    assert decode_txt(RECORD.name, txt, RECORD.addresses) == RECORD
    assert all(len(k) + len(v) + 1 <= 255 for k, v in txt.items())  # one TXT string each (RFC 6763 §6.1)


def test_own_record_equals_the_one_read_back():
    """A host must recognise its own record over mDNS (else it would 'move' to itself)."""
    from dataclasses import replace

    own = replace(RECORD, started=1796000000.123456789)
    seen = decode_txt(own.name, zeroconf_txt(encode_txt(own)), own.addresses)
    assert seen == own and seen.key == own.key


def test_the_key_itself_is_never_advertised():
    txt = encode_txt(RECORD)
    assert set(txt) == {"v", "sid", "port", "fp", "host", "t"}


@pytest.mark.parametrize("key, value, words", [
    ("sid", None, "sid' missing"),
    ("sid", "0123", "sid"),
    ("sid", "0123456789ABCDEF", "sid"),
    ("fp", "00" * 31, "fp"),
    ("fp", "zz" * 32, "fp"),
    ("port", "0", "port"),
    ("port", "70000", "port"),
    ("port", "-1", "port"),
    ("v", "one", "v="),
    ("host", "a b", "host"),
    ("t", "1e9", "t="),
])
def test_malformed_txt_is_refused(key, value, words):
    props = encode_txt(RECORD)
    if value is None:
        del props[key]
    else:
        props[key] = value
    with pytest.raises(RemoteProtocolError, match=words):
        decode_txt(RECORD.name, zeroconf_txt(props))


def test_is_ours_checks_swarm_and_protocol():
    assert is_ours(RECORD, "0123456789abcdef")
    assert not is_ours(RECORD, "fedcba9876543210")
    from dataclasses import replace

    assert not is_ours(replace(RECORD, version=2), "0123456789abcdef")


def test_instance_name_fits_a_dns_label():
    name = instance_name("x" * 128, 1796000000.5)
    label = name.removesuffix("." + SERVICE_TYPE)
    assert len(label.encode()) <= 63
    assert instance_name("p", 1.0) != instance_name("p", 2.0)
    assert RECORD.url() == "wss://10.0.0.2:8443/ws"


def test_host_name_is_per_server_run_not_per_peer_id():
    # Two processes with one identity (a copied config directory) must not claim one mDNS host name.
    again = dataclasses.replace(RECORD, started=RECORD.started + 0.001)
    assert RECORD.host_name == f"colibri-peer-a-{1796000000123 % 10**9}.local."
    assert again.host_name != RECORD.host_name
    long = dataclasses.replace(RECORD, host="x" * 128)
    assert len(long.host_name.split(".")[0]) <= 63  # one DNS label (RFC 1035)


def test_the_hosting_process_is_told_apart_from_a_copy_with_the_same_peer_id():
    mine = dataclasses.replace(RECORD, instance="0123456789abcdef")
    seen = decode_txt(mine.name, zeroconf_txt(encode_txt(mine)), mine.addresses)
    assert seen == mine and seen.instance == "0123456789abcdef"
    assert seen.is_from("peer-a", "0123456789abcdef")
    assert not seen.is_from("peer-a", "fedcba9876543210")  # a copied identity hosts this one
    assert not seen.is_from("peer-b", "0123456789abcdef")
    assert RECORD.is_from("peer-a", "fedcba9876543210")  # no tag (an older build): the peer id decides
    with pytest.raises(RemoteProtocolError, match="TXT i="):
        decode_txt(RECORD.name, zeroconf_txt({**encode_txt(mine), "i": "XYZ"}))
