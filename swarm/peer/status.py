"""``colibri-swarm status [--json | --watch]``: the swarm as the peer running on this machine sees it.

The running ``join`` keeps a status file (:data:`STATUS_FILE` in the config
directory, rewritten every second, written atomically); this command reads it. A file whose
process is gone, or that has not been rewritten for :data:`STALE_AFTER_S`, is never shown as if
it were live: it is said for what it is (:func:`not_live`) — a peer that stopped, one that is
stalled, or a file copied with the config directory from another machine. ``--watch`` redraws the view every
:data:`WATCH_EVERY_S` (rich ``Live``) with the newest swarm events, until Ctrl-C; when stdout
is not a terminal (a pipe, a file) it prints one plain snapshot per interval instead.

The view fits 80 columns: each peer's id sits whole under its name, roles are never cut, and
each share is written out below the table ("layers 0–29: MLP rows 1280–1536"), in the plan's layer
order (:func:`plan_order_key`; the dashboard's rows follow the same order). A worker knows
the plan it accepted, so it shows the other peers' roles and shares too.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from swarm import paths
from swarm.errors import SwarmError

STATUS_FILE = "status.json"
STATUS_EVERY_S = 1.0  # the running join rewrites the file this often, seconds
STALE_AFTER_S = 5 * STATUS_EVERY_S  # an older file is from a join that is gone
WATCH_EVERY_S = 1.0
WATCH_EVENTS = 8  # the newest events under the table in --watch
WIDTH = 80
KIND_WORDS = {"experts": "experts", "dense": "MLP rows"}
SHARE_GROUPS = 6  # groups of layers a share's words name on the dashboard before "… and N more"


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
        raise SwarmError(not_live(path, doc, age))
    return doc


def not_live(path: Path, doc: dict[str, Any], age: float) -> str:
    """What a status file that no live peer keeps (its pid gone, or not rewritten for
    :data:`STALE_AFTER_S`; ``age``: seconds since its last update) says, and what to do. Whether a
    peer runs from the file's directory is the directory's lock's word
    (:func:`swarm.paths.config_dir_holder`), not the file's pid: a file copied with a config
    directory from another machine names a process of that machine (its ``host`` says so), and
    the pid of a peer that stopped may belong to another process by now."""
    pid, host, here = doc["pid"], doc.get("host"), socket.gethostname()
    directory = path.parent
    holder = paths.config_dir_holder(directory)
    ago = _duration(age)
    start = "start a peer with `colibri-swarm join`"
    if host is not None and host != here:
        found = (f"the status file {path} was written {ago} ago on a machine named {host!r} (pid {pid}; this one "
                 f"is named {here!r}): the configuration directory {directory} was copied from another machine, "
                 "or this one's name changed")
        if holder is not None:
            return (f"{found}. A peer runs from it here{_pid(holder)} but has not written its own status yet: "
                    "try again in a few seconds")
        return (f"{found}, and no peer runs from it here. If it was copied, give this machine its own identity "
                f"before you {start}: delete {directory / paths.IDENTITY_FILE} (a copy makes this machine the "
                f"same peer as {host!r}, and two peers with one id split the swarm), or set {paths.CONFIG_DIR_ENV} "
                "to a directory of its own; if only the name changed, just " + start)
    if holder is not None and holder in (pid, 0):
        return (f"the peer{_pid(holder)} running from {directory} has not updated its status for {ago}: it is "
                "stopped (SIGSTOP, a suspended machine) or stuck; resume it (`kill -CONT PID`) or restart it")
    if holder is not None:
        return (f"a peer{_pid(holder)} runs from {directory} but has not written its status yet (the file left "
                f"there is pid {pid}'s, {ago} old): try again in a few seconds")
    where = "" if host == here else " (or the file was copied from another machine)"
    if pid_alive(pid):
        return (f"no peer runs from {directory}: its status file is {ago} old, and pid {pid}, which wrote it, is "
                f"another process on this machine now: the peer stopped{where}; {start}")
    return (f"no peer runs from {directory}: the peer that wrote its status file (pid {pid}) stopped {ago} "
            f"ago{where}; {start}")


def _pid(pid: int) -> str:
    return f" (pid {pid})" if pid else ""


def _duration(seconds: float) -> str:
    """"12 s", "5 min", "3 h", "4 days"."""
    s = max(seconds, 0.0)
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= 2 * size:
            return f"{s / size:.0f} {unit}"
    return f"{s:.0f} s"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (signal 0; one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def render(doc: dict[str, Any], *, events: int = 0, width: int = WIDTH) -> Any:
    """A rich renderable of a status document, ``width`` columns wide at most: header, peers
    table, plan line, each peer's share in words, and the newest ``events`` swarm events."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    placement = doc.get("placement") if isinstance(doc.get("placement"), dict) else {}
    observed = (doc.get("observed") or {}).get("peers") or {}
    hosting = "hosting signaling" if doc.get("hosting_signaling") else f"signaling on {doc.get('signaling_host')}"
    header = Text.assemble("swarm ", (str(doc.get("swarm_id")), "bold"), f" · {hosting}\nthis peer ",
                           (str(doc.get("name", "")), "bold"), f" ({doc.get('peer_id')}), {doc.get('role')}")
    table = Table(box=None, padding=(0, 1), width=width, show_edge=False, header_style="bold")
    table.add_column("peer", overflow="fold", min_width=26, ratio=1)
    table.add_column("kind", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("RTT ms", justify="right", no_wrap=True)
    table.add_column("GFLOP/s", justify="right", no_wrap=True)
    table.add_column("MiB", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    me = {"peer_id": doc["peer_id"], "name": doc.get("name", ""), "kind": "python", "linked": None,
          "ffn_gflops": doc.get("ffn_gflops"), "memory_budget": doc.get("memory_budget")}
    peers = [me, *doc.get("peers", [])]
    on_cpu = placement.get("on_cpu") if placement else None  # GPU peers whose work passes their GPU memory
    for p in peers:
        rtt = "this" if p["linked"] is None else "" if p.get("rtt_ms") is None else f"{p['rtt_ms']:.1f}"
        memory = "" if p.get("memory_budget") is None else str(p["memory_budget"] >> 20)
        share = share_fraction(placement, p["peer_id"])
        gflops = "" if p.get("ffn_gflops") is None else f"{p['ffn_gflops']:.1f}"
        # Text, never markup: names come from other peers.
        kind = peer_kind(p, doc)
        if isinstance(on_cpu, list) and p["peer_id"] in on_cpu:
            kind += "\non its CPU"
        table.add_row(Text(f"{p.get('name') or '?'}\n{p['peer_id']}"), Text(kind),
                      Text(_role(p["peer_id"], doc, placement)), rtt, gflops, memory,
                      f"{100 * share:.0f} %" if placement else "")
    parts: list[Any] = [header, table]
    if placement:
        api = f", OpenAI API on port {placement['api_port']}" if placement.get("api_port") else ""
        coord = placement.get("coordinator")
        names = {p["peer_id"]: p.get("name") or p["peer_id"] for p in peers}
        lines = [f"plan v{placement.get('version')} of term {placement.get('term')}, coordinator "
                 f"{names.get(coord, coord)}{api}"]
        for p in sorted(peers, key=plan_order_key(placement)):
            words = describe_share(placement, p["peer_id"])
            if words != "nothing":
                ms = (observed.get(p["peer_id"]) or {}).get("ms_per_row")
                pace = f" ({ms:.3f} ms/row)" if ms else ""
                lines.append(f"  {names[p['peer_id']]}: {words}{pace}")
        standby = placement.get("standby") if isinstance(placement.get("standby"), dict) else {}
        for peer_id, notice in standby.items():  # pages the plan gives no work, and why
            if isinstance(notice, dict) and notice.get("message"):
                lines.append(f"  {names.get(peer_id, peer_id)}: standing by — {notice['message']}")
        parts.append(Text("\n".join(lines), overflow="fold"))
        short = placement.get("shortfall")
        if isinstance(short, dict) and short.get("message"):  # the swarm cannot hold the model: never silently
            parts.append(Text(f"memory: {short['message']}", style="bold yellow", overflow="fold"))
    else:
        parts.append(Text("no plan known yet", style="dim"))
    if events:
        shown = (doc.get("events") or [])[-events:]
        lines = [f"{time.strftime('%H:%M:%S', time.localtime(e.get('t', 0)))} {e.get('what')} "
                 f"{e.get('name') or ''} {e.get('peer_id') or ''} {e.get('detail') or ''}".rstrip() for e in shown]
        parts.append(Text("events\n" + "\n".join(lines) if lines else "no events yet", overflow="fold"))
    return Group(*parts)


def peer_kind(peer: dict[str, Any], doc: dict[str, Any]) -> str:
    """"Mac", "Linux" or "phone" (any browser peer), as the dashboard says it (web_peer/dashboard.js);
    a GPU peer's adapter on a second line ("Linux\nGPU llvmpipe …")."""
    if peer.get("kind") == "browser":
        return "phone"
    own = peer["peer_id"] == doc["peer_id"]
    if own:
        kind = "Mac" if doc.get("system") == "Darwin" else str(doc.get("system") or "Linux")
    else:
        kind = "Mac" if peer.get("arch") == "arm64" else "Linux"  # macOS reports arm64, Linux aarch64 / x86_64
    gpu = doc.get("gpu") if own else peer.get("gpu")
    return f"{kind}\nGPU {gpu}" if gpu else kind


def _role(peer_id: str, doc: dict[str, Any], placement: dict[str, Any]) -> str:
    if peer_id == doc["peer_id"]:
        return str(doc.get("role", ""))
    if placement.get("coordinator") == peer_id:
        return "coordinator"
    return "worker" if peer_id in plan_workers(placement) else ""


def plan_workers(placement: dict[str, Any]) -> list[str]:
    """The peers other than the coordinator that ``placement`` (a plan dict) gives work: a span
    of a layer or a stage (under stages its ``peers`` name the coordinator alone), in the plan's
    layer order (:func:`plan_order`). The rule of :func:`swarm.peer.plan.plan_workers`, read from
    the status document, which a worker keeps too."""
    coordinator = placement.get("coordinator")
    working = {p for kinds in _units(placement).values() for by_peer in kinds.values() for p in by_peer}
    return plan_order(placement, working - {coordinator})


def _units(placement: dict[str, Any]) -> dict[int, dict[str, dict[str, list[tuple[int, int]]]]]:
    """layer → kind → peer → spans [start, stop), from every ``{layer: [[peer, start, stop]]}``
    field of a plan dict (``experts``, ``dense``, and any other kind a plan carries); then
    ``stages`` ``[[peer, first layer, stop layer]]``, if any: a stage's peer runs those layers
    whole, so each counts as one unit of kind ``stage`` (a worker's stage replaces the spans, which
    give the coordinator those layers should it fail) — but the coordinator's stage keeps spans
    that name workers (a mix: its FFN cut into ranges over them)."""
    units: dict[int, dict[str, dict[str, list[tuple[int, int]]]]] = {}
    for kind, value in placement.items():
        if not isinstance(value, dict):
            continue
        for layer, spans in value.items():
            if not isinstance(spans, list) or not str(layer).isdigit():
                continue
            for span in spans:
                if isinstance(span, list) and len(span) == 3 and all(isinstance(x, int) for x in span[1:]):
                    units.setdefault(int(layer), {}).setdefault(kind, {}).setdefault(str(span[0]), []).append(
                        (span[1], span[2]))
    stages, coordinator = placement.get("stages"), str(placement.get("coordinator"))
    for stage in stages if isinstance(stages, list) else ():
        if isinstance(stage, list) and len(stage) == 3 and all(isinstance(x, int) for x in stage[1:]):
            for layer in range(stage[1], stage[2]):
                cut = {p for by_peer in units.get(layer, {}).values() for p in by_peer} - {coordinator}
                if str(stage[0]) == coordinator and cut:
                    continue  # a mix: the coordinator's stage, its FFN cut into ranges over the workers
                units[layer] = {"stage": {str(stage[0]): [(0, 1)]}}
    return units


def plan_order_key(placement: dict[str, Any]) -> Callable[[dict[str, Any]], tuple]:
    """A sort key that lists peers (status documents' ``{"peer_id", "name"}``) in the order of
    ``placement``'s layers: by the first layer each works on (a stage's start, a range's layer),
    then by where its part of that layer starts (its first expert or MLP row), then by name and
    id; peers without work last."""
    units = sorted(_units(placement).items())

    def key(peer: dict[str, Any]) -> tuple:
        p = str(peer["peer_id"])
        for layer, kinds in units:
            starts = [a for by_peer in kinds.values() for a, _ in by_peer.get(p, ())]
            if starts:
                return (0, layer, min(starts), str(peer.get("name") or ""), p)
        return (1, 0, 0, str(peer.get("name") or ""), p)
    return key


def plan_order(placement: dict[str, Any], peer_ids: Iterable[str]) -> list[str]:
    """``peer_ids`` in the order :func:`plan_order_key` gives (by id where no name is known)."""
    key = plan_order_key(placement)
    return sorted(peer_ids, key=lambda p: key({"peer_id": p}))


def layer_fractions(placement: dict[str, Any], peer_id: str) -> list[tuple[int, float]]:
    """``[(layer, fraction)]``, one per layer of the plan in order, 0 where the peer holds
    nothing: per kind, the units it holds over the layer's units, averaged over the kinds."""
    out = []
    for layer, kinds in sorted(_units(placement).items()):
        held = [sum(b - a for a, b in by_peer.get(peer_id, ())) / max(sum(b - a for s in by_peer.values() for a, b in s), 1)
                for by_peer in kinds.values()]
        out.append((layer, sum(held) / len(held)))
    return out


def share_fraction(placement: dict[str, Any], peer_id: str) -> float:
    """The peer's share of the plan's FFN work in [0, 1], each layer weighing the same."""
    fractions = layer_fractions(placement, peer_id)
    return sum(f for _, f in fractions) / len(fractions) if fractions else 0.0


def shares(placement: dict[str, Any], peer_ids: Any, max_groups: int | None = SHARE_GROUPS) -> dict[str, Any]:
    """Each peer's share of a plan, for a page to draw as it is (the dashboard does; nothing is
    computed twice): ``{"peers": {id: {"fraction", "words", "layers": [[layer, fraction]]}},
    "kinds": {kind: number of layers}, "order": [id, …] in the plan's layer order}``
    (:func:`plan_order`), ``"workers"``: the plan's workers (:func:`plan_workers`; ranges or
    stages); ``words`` as :func:`describe_share` with ``max_groups``."""
    peer_ids = list(peer_ids)
    kinds: dict[str, int] = {}
    for layer_kinds in _units(placement).values():
        for kind in layer_kinds:
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"kinds": kinds, "order": plan_order(placement, peer_ids), "workers": plan_workers(placement), "peers": {
        p: {"fraction": share_fraction(placement, p), "words": describe_share(placement, p, max_groups),
            "layers": [list(x) for x in layer_fractions(placement, p)]} for p in peer_ids}}


def compress_ints(values: Any) -> str:
    """"0–7, 12, 14–15": consecutive runs of the integers as a–b."""
    v = sorted(set(values))
    out, i = [], 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[j + 1] == v[j] + 1:
            j += 1
        out.append(f"{v[i]}–{v[j]}" if j > i else f"{v[i]}")
        i = j + 1
    return ", ".join(out)


def describe_share(placement: dict[str, Any], peer_id: str, max_groups: int | None = None) -> str:
    """The peer's share in words, consecutive layers with the same work merged
    ("layers 0–29: MLP rows 1280–1536"), at most ``max_groups`` groups then "… and N more";
    "nothing" when it holds none."""
    groups: list[list[Any]] = []  # [first layer, last layer, words]
    for layer, kinds in sorted(_units(placement).items()):
        parts = []
        for kind, by_peer in kinds.items():
            spans = by_peer.get(peer_id)
            if not spans:
                continue
            if kind == "stage":
                parts.append("whole (attention, KV cache, MLP)")
                continue
            text = (compress_ints(i for a, b in spans for i in range(a, b)) if kind == "experts"
                    else ", ".join(f"{a}–{b}" for a, b in spans))
            parts.append(f"{KIND_WORDS.get(kind, kind)} {text}")
        if not parts:
            continue
        words = "; ".join(parts)
        if groups and groups[-1][2] == words and groups[-1][1] == layer - 1:
            groups[-1][1] = layer
        else:
            groups.append([layer, layer, words])
    text = " · ".join(f"{'layer ' + str(a) if a == b else f'layers {a}–{b}'}: {w}" for a, b, w in groups[:max_groups])
    if max_groups is not None and len(groups) > max_groups:
        text += f" · … and {len(groups) - max_groups} more"
    return text or "nothing"
