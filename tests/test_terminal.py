"""What we print from data reaches the terminal verbatim: no rich markup or emoji codes in it.

The certificate fingerprint people compare by eye ("…:CD:…") once printed as a 💿, and peer
names (chosen by other peers) could carry markup.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from swarm.cli.join import _print_event, _print_header
from swarm.cli.status import main_status
from swarm.keys.swarmkey import SwarmKey
from swarm.signaling.address import SignalAddress
from swarm.terminal import console, esc

FINGERPRINT = "sha-256 " + ":".join(["AB", "CD", "EF", "01", "CD", "23"] * 5 + ["CD", "45"])
NAME = "[red]phone[/] :smile: :CD:"


def test_console_prints_emoji_codes_and_escaped_markup_verbatim():
    c = console(record=True, width=300)
    c.print(f"[bold]{esc(NAME)}[/] {esc(FINGERPRINT)}")
    assert c.export_text().strip() == f"{NAME} {FINGERPRINT}"


def test_join_header_and_events_show_fingerprint_and_names_verbatim():
    server = SimpleNamespace(port=8443, certificate=SimpleNamespace(fingerprint=FINGERPRINT),
                             address=lambda host: SignalAddress(host, 8443))
    rv = SimpleNamespace(server=server, client=None, signal_url=None, record=None)
    node = SimpleNamespace(rendezvous=rv, swarm_id="59a5996c7f649f5e", peer_id="p" * 26, name=NAME,
                           swarm_key=SwarmKey(bytes(range(32))))
    c = console(record=True, width=300)
    _print_header(c, node)
    for what in ("link up", "joined", "left"):
        _print_event(c, {"what": what, "peer_id": "q" * 26, "name": NAME, "detail": "browser"})
    text = c.export_text()
    assert f"certificate SHA-256 {FINGERPRINT}\n" in text
    assert text.count(NAME) == 4
    assert "💿" not in text and "😄" not in text
    assert "colibri-swarm join --signal " in text  # the form peers use where mDNS does not reach


def test_status_shows_peer_names_verbatim(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLIBRI_SWARM_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "300")
    doc = {"pid": os.getpid(), "updated": time.time(), "swarm_id": "59a5996c7f649f5e", "peer_id": "p" * 26,
           "name": NAME, "role": "worker", "hosting_signaling": True, "ffn_gflops": 1.0, "memory_budget": 1 << 30,
           "placement": None, "peers": [{"peer_id": "q" * 26, "name": NAME, "kind": "browser", "linked": True,
                                          "rtt_ms": 1.5, "memory_budget": None, "ffn_gflops": None}]}
    (tmp_path / "status.json").write_text(json.dumps(doc))
    assert main_status(SimpleNamespace(json=False)) == 0
    out = capsys.readouterr().out
    assert out.count(NAME) == 3, out


def test_join_says_a_peer_that_closed_its_link_leaves_and_one_lost_is_lost():
    """A link the peer closed (it leaves: Ctrl-C, SIGTERM) is said as a leave, not as a lost link."""
    from swarm.peer.node import CLOSED_BY_PEER

    c = console(record=True, width=300)
    _print_event(c, {"what": "link down", "peer_id": "q" * 26, "name": "laptop", "detail": CLOSED_BY_PEER})
    _print_event(c, {"what": "link down", "peer_id": "r" * 26, "name": "tower", "detail": ""})
    assert c.export_text().splitlines() == [f"  link closed by laptop ({'q' * 26}): it is leaving",
                                            f"- link lost tower ({'r' * 26})"]
