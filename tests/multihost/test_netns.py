"""The network-namespace lab itself: isolated links that carry unicast and multicast between
namespaces, processes run inside, and nothing left behind after teardown."""

from __future__ import annotations

import subprocess

import pytest

from tests.multihost.netns import NetnsLab, ip

pytestmark = pytest.mark.multihost

# One process joins the mDNS group and answers a UDP multicast with its namespace's address;
# the other sends to the group and prints who answered.
LISTEN = r"""
import json, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", 5399))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, struct.pack("4s4s", socket.inet_aton("224.0.0.251"), socket.inet_aton("0.0.0.0")))
print(json.dumps({"event": "ready"}), flush=True)
data, addr = s.recvfrom(100)
s.sendto(b"pong:" + data, addr)
print(json.dumps({"event": "got", "data": data.decode(), "from": addr[0]}), flush=True)
"""
SEND = r"""
import json, socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
s.sendto(b"ping", ("224.0.0.251", 5399))
data, addr = s.recvfrom(100)
print(json.dumps({"event": "answer", "data": data.decode(), "from": addr[0]}), flush=True)
"""


async def test_multicast_between_namespaces_and_clean_teardown(netns_lab):
    lab: NetnsLab = netns_lab(2)
    assert lab.addresses[0].startswith("10.77.") and lab.addresses[0] != lab.addresses[1]
    assert lab.addresses[0] in lab.exec(0, "ip", "-4", "addr", "show", "eth0").stdout
    listener = lab.spawn(1, ["-c", LISTEN])
    await listener.wait_for(lambda e: e["event"] == "ready", timeout=10)
    sender = lab.spawn(0, ["-c", SEND])
    answer = await sender.wait_for(lambda e: e["event"] == "answer", timeout=10)
    assert answer["data"] == "pong:ping" and answer["from"] == lab.addresses[1]
    got = await listener.wait_for(lambda e: e["event"] == "got", timeout=10)
    assert got["from"] == lab.addresses[0]
    # processes see their own config dirs
    env = lab.env(0)
    assert env["COLIBRI_SWARM_CONFIG_DIR"] != lab.env(1)["COLIBRI_SWARM_CONFIG_DIR"]

    # the root namespace has no interface on the lab's segment
    assert f"10.77.{lab.subnet_octet}." not in subprocess.run(["ip", "-4", "addr"], capture_output=True,
                                                                text=True).stdout
    names = [lab.switch, *lab.namespaces]
    lab.spawn(0, ["-c", "import time; time.sleep(600)"])
    lab.close()
    listed = ip("netns", "list").stdout
    assert not any(name in listed.split() for name in names)
    assert lab.processes == []
