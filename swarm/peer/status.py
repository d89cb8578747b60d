"""``colibri-swarm status [--json]``: print the swarm as the peer running on this machine sees it.

The running ``join`` keeps a status file (:data:`swarm.peer.node.STATUS_FILE` in the config
directory, rewritten every second, written atomically); this command reads it. A file whose
process is gone, or that has not been rewritten for :data:`STALE_AFTER_S`, is reported as a
stopped peer rather than shown as if it were live.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from swarm import paths
from swarm.errors import SwarmError
from swarm.peer.node import STATUS_EVERY_S, STATUS_FILE

STALE_AFTER_S = 5 * STATUS_EVERY_S


def read_status(path: Path | None = None, now: float | None = None) -> dict[str, Any]:
    """The live status document of the local peer.

    Raises :class:`SwarmError` (with what to do) when no peer runs here, it stopped, or the file
    is damaged.
    """
    path = path or paths.config_dir() / STATUS_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SwarmError(f"no peer is running on this machine ({path} is missing); start one with "
                         "`colibri-swarm join`") from None
    except (OSError, ValueError) as exc:
        raise SwarmError(f"cannot read the status file {path}: {exc}; restart `colibri-swarm join`") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int) or not isinstance(doc.get("updated"), (int, float)):
        raise SwarmError(f"the status file {path} is not one written by `colibri-swarm join`")
    age = (time.time() if now is None else now) - doc["updated"]
    if not pid_alive(doc["pid"]) or age > STALE_AFTER_S:
        raise SwarmError(f"the peer that wrote {path} (pid {doc['pid']}) is not running "
                         f"(last update {age:.0f} s ago); start one with `colibri-swarm join`")
    return doc


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (signal 0; one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main_status(args: Any) -> int:
    doc = read_status()
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    from rich.table import Table

    from swarm.terminal import console as terminal_console
    from swarm.terminal import esc

    console = terminal_console()
    hosting = "hosting signaling" if doc.get("hosting_signaling") else f"signaling host {doc.get('signaling_host')}"
    console.print(f"swarm [bold]{esc(doc['swarm_id'])}[/]  this peer [bold]{esc(doc['name'])}[/] ({esc(doc['peer_id'])})  "
                  f"role {esc(doc['role'])}  {esc(hosting)}")
    placement = doc.get("placement") if isinstance(doc.get("placement"), dict) else {}
    table = Table("peer", "name", "kind", "role", "link", "RTT ms", "FFN GFLOP/s", "memory MiB", "share")
    me = {"peer_id": doc["peer_id"], "name": doc.get("name", ""), "kind": "python", "linked": None,
          "ffn_gflops": doc.get("ffn_gflops"), "memory_budget": doc.get("memory_budget")}
    for p in [me, *doc.get("peers", [])]:
        rtt = "" if p.get("rtt_ms") is None else f"{p['rtt_ms']:.2f}"
        memory = "" if p.get("memory_budget") is None else str(p["memory_budget"] >> 20)
        link = "(this peer)" if p["linked"] is None else "up" if p["linked"] else "-"
        cells = (p["peer_id"], p.get("name", ""), p.get("kind", ""), _role(p["peer_id"], doc, placement),
                 link, rtt, str(p.get("ffn_gflops") or ""), memory, _share(p["peer_id"], placement))
        table.add_row(*(esc(cell) for cell in cells))  # names come from other peers: never markup
    console.print(table)
    if placement:
        api = f", OpenAI API on port {placement['api_port']}" if placement.get("api_port") else ""
        console.print(esc(f"plan v{placement.get('version')} of term {placement.get('term')}, "
                          f"coordinator {placement.get('coordinator')}{api}"))
    return 0


def _role(peer_id: str, doc: dict[str, Any], placement: dict[str, Any]) -> str:
    if peer_id == doc["peer_id"]:
        return str(doc.get("role", ""))
    if placement.get("coordinator") == peer_id:
        return "coordinator"
    return "worker" if peer_id in placement.get("peers", ()) else ""


def _share(peer_id: str, placement: dict[str, Any]) -> str:
    """What the plan gives a peer: dense columns and experts, summed over layers."""
    parts = []
    for what, unit in (("dense", "dense cols"), ("experts", "experts")):
        spans = placement.get(what)
        if isinstance(spans, dict):
            total = sum(stop - start for layer in spans.values() for peer, start, stop in layer if peer == peer_id)
            if total:
                parts.append(f"{total} {unit}")
    return ", ".join(parts)
