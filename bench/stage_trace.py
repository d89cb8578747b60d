"""Bench-only trace of a stage round trip: ``perf_counter_ns`` at each hand-off, on both sides.

:func:`install` wraps (class-level, before any node exists) the points a stage request and its
answer pass through — the token loop handing the request to the event loop, the encoder, the
data channel, the receiving link, the decoder, the worker's handler, its compute thread, the
answer's way back and the token loop waking. Each point appends ``(request_id, point, ns)`` to
this process's list; :func:`dump` writes it as JSON. ``perf_counter_ns`` is CLOCK_MONOTONIC on
Linux, shared by every process of the machine, so the two sides' stamps compare directly.
Nothing here is imported by the product.
"""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from pathlib import Path

EVENTS: list[tuple[int, str, int]] = []
_LOCK = threading.Lock()

# In visiting order: coordinator (c_) and worker (w_) points.
POINTS = (
    "c_send",          # token loop: the request handed to the event loop (Dispatcher.send)
    "c_loop",          # event loop: the send task runs
    "c_encoded",       # request encoded
    "c_channel",       # handed to the data channel
    "w_arrived",       # worker: the data channel delivered the last fragment
    "w_decoded",       # decoded, before the handler
    "w_task",          # the handler's task runs (term checked next)
    "w_compute",       # compute thread starts the stage
    "w_computed",      # compute thread done
    "w_loop",          # event loop has the answer back
    "w_encoded",       # answer encoded
    "w_channel",       # answer handed to the data channel
    "c_arrived",       # coordinator: the answer's last fragment arrived
    "c_decoded",       # decoded
    "c_delivered",     # the token loop's future resolved
    "c_woke",          # the token loop runs again
)


def mark(rid: int, point: str) -> None:
    with _LOCK:
        EVENTS.append((rid, point, time.perf_counter_ns()))


def _stage_rid(msg) -> int | None:
    from swarm.peer.net.messages import StageAnswer, StageRequest

    return msg.request_id if isinstance(msg, (StageRequest, StageAnswer)) else None


def install(role: str) -> None:
    """Wrap the hand-off points; ``role`` is ``"coordinator"`` or ``"worker"`` (prefix of the points)."""
    from swarm.peer.coordinator import role as coordinator_mod
    from swarm.peer.worker import role as worker_mod
    from swarm.peer.coordinator import stages as stages_mod
    from swarm.peer.worker import stages as worker_stages
    from swarm.peer.net import link as link_mod
    from swarm.peer.net import messages

    side = "c" if role == "coordinator" else "w"
    last_arrival = threading.local()

    encode, decode = messages.encode, messages.decode

    def traced_encode(msg, *args, **kw):
        data = encode(msg, *args, **kw)
        rid = _stage_rid(msg)
        if rid is not None:
            mark(rid, f"{side}_encoded")
        return data

    def traced_decode(frame, *args, **kw):
        msg = decode(frame, *args, **kw)
        rid = _stage_rid(msg)
        if rid is not None:
            mark(rid, f"{side}_arrived_raw")
            with _LOCK:
                EVENTS.append((rid, f"{side}_arrived", last_arrival.ns))
            mark(rid, f"{side}_decoded")
        return msg

    messages.encode, messages.decode = traced_encode, traced_decode

    on_message = link_mod.Link._on_channel_message

    @functools.wraps(on_message)
    def traced_on_message(self, data):
        last_arrival.ns = time.perf_counter_ns()
        return on_message(self, data)

    link_mod.Link._on_channel_message = traced_on_message

    link_send = link_mod.Link.send

    @functools.wraps(link_send)
    async def traced_link_send(self, message):
        rid = _stage_rid(message)
        if rid is not None and side == "c":
            mark(rid, "c_loop")
        await link_send(self, message)
        if rid is not None:
            mark(rid, f"{side}_channel")

    link_mod.Link.send = traced_link_send

    if side == "c":
        send = coordinator_mod.CoordinatorRole.send

        @functools.wraps(send)
        def traced_send(self, peer, msg):
            rid = _stage_rid(msg)
            if rid is not None:
                mark(rid, "c_send")
            return send(self, peer, msg)

        coordinator_mod.CoordinatorRole.send = traced_send
        deliver = stages_mod.StagedFFN.deliver

        @functools.wraps(deliver)
        def traced_deliver(self, peer, msg):
            deliver(self, peer, msg)
            mark(msg.request_id, "c_delivered")

        stages_mod.StagedFFN.deliver = traced_deliver
        check = stages_mod._check_answer

        def traced_check(req, msg):
            mark(req.request_id, "c_woke")
            return check(req, msg)

        stages_mod._check_answer = traced_check
    else:
        handle = worker_stages.StageRunner.handle

        @functools.wraps(handle)
        def traced_handle(self, msg):
            mark(msg.request_id, "w_compute")
            out = handle(self, msg)
            mark(msg.request_id, "w_computed")
            return out

        worker_stages.StageRunner.handle = traced_handle
        on_req = worker_mod.WorkerRole._on_stage_request

        @functools.wraps(on_req)
        async def traced_on_req(self, link, msg):
            mark(msg.request_id, "w_task")
            await on_req(self, link, msg)

        worker_mod.WorkerRole._on_stage_request = traced_on_req
        sender = worker_mod.send_logged  # how the worker role sends its answers

        @functools.wraps(sender)
        async def traced_worker_send(link, msg):
            rid = _stage_rid(msg)
            if rid is not None:
                mark(rid, "w_loop")
            await sender(link, msg)

        worker_mod.send_logged = traced_worker_send


def dump(path: str | Path) -> None:
    with _LOCK:
        Path(path).write_text(json.dumps(EVENTS))


def breakdown(paths: list[str | Path], since_ns: int = 0, until_ns: int = 1 << 63, skip_first: bool = False) -> dict:
    """Median microseconds between consecutive points, over the requests sent between
    ``since_ns`` and ``until_ns`` and seen at every point (``skip_first``: without the first,
    a prefill); plus the round trip (c_send → c_woke)."""
    by_rid: dict[int, dict[str, int]] = {}
    for p in paths:
        for rid, point, ns in json.loads(Path(p).read_text()):
            by_rid.setdefault(rid, {})[point] = ns
    full = sorted((pts for pts in by_rid.values() if all(k in pts for k in POINTS)
                   and since_ns <= pts["c_send"] <= until_ns), key=lambda pts: pts["c_send"])
    full = full[1:] if skip_first else full
    out: dict = {"requests": len(full)}
    if not full:
        return out
    for a, b in zip(POINTS, POINTS[1:]):
        out[f"{a}->{b}_us"] = round(statistics.median((pts[b] - pts[a]) / 1e3 for pts in full), 1)
    out["round_trip_us"] = round(statistics.median((pts["c_woke"] - pts["c_send"]) / 1e3 for pts in full), 1)
    out["worker_compute_us"] = round(statistics.median((pts["w_computed"] - pts["w_compute"]) / 1e3
                                                       for pts in full), 1)
    out["beyond_compute_us"] = round(out["round_trip_us"] - out["worker_compute_us"], 1)
    # the coordinator's own part of a step: from one answer's wake-up to the next request
    gaps = [(b["c_send"] - a["c_woke"]) / 1e3 for a, b in zip(full, full[1:])]
    if gaps:
        out["coordinator_between_us"] = round(statistics.median(gaps), 1)
    return out
