"""Bench-only trace of the swarm's per-layer FFN round trips: ``perf_counter_ns`` at each hand-off,
on both sides, plus the coordinator's own share, its step boundaries and the SCTP packets.

:func:`install` wraps (class-level, before any node exists) the points an ``ExpertRequest`` /
``DenseRequest`` and its answer pass through — the token loop handing the request to the event
loop, the encoder, the data channel, the receiving link, the decoder, the worker's handler, its
compute thread, the answer's way back and the token loop waking — and, on the coordinator, the
span of its own share of each layer and each batch step. It also counts SCTP datagrams sent and
received (DATA and SACK), retransmission timer expiries and the congestion window at each send.
Events are ``(request_id, point, ns)`` in one list per process; :func:`dump` writes it as JSON.
``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, shared by the processes of one machine, so the
two sides' stamps compare directly. Nothing here is imported by the product.
"""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

EVENTS: list[tuple[int, str, int]] = []
COUNTS: Counter = Counter()
_LOCK = threading.Lock()

# In visiting order: coordinator (c_) and worker (w_) points of one request.
POINTS = (
    "c_send",          # token loop: the request handed to the event loop (Dispatcher.send)
    "c_loop",          # event loop: the send task runs
    "c_encoded",       # request encoded
    "c_channel",       # handed to the data channel (its packets queued or sent)
    "w_arrived",       # worker: the data channel delivered the message (its last packet)
    "w_decoded",       # decoded, before the handler
    "w_task",          # the handler's task runs
    "w_compute",       # compute thread starts
    "w_computed",      # compute thread done
    "w_loop",          # event loop has the answer
    "w_encoded",       # answer encoded
    "w_channel",       # answer handed to the data channel
    "c_arrived",       # coordinator: the answer's message arrived
    "c_decoded",       # decoded
    "c_delivered",     # the token loop's future resolved
    "c_woke",          # the token loop runs again
)


def mark(rid: int, point: str) -> None:
    with _LOCK:
        EVENTS.append((rid, point, time.perf_counter_ns()))


def _ffn_rid(msg) -> int | None:
    from swarm.peer.net.messages import DenseAnswer, DenseRequest, ExpertAnswer, ExpertRequest

    return msg.request_id if isinstance(msg, (DenseRequest, DenseAnswer, ExpertRequest, ExpertAnswer)) else None


def _install_sctp() -> None:
    """Count datagrams by chunk type, T3 expiries and the congestion window at each DATA send."""
    import aiortc.rtcsctptransport as sctp

    send_chunk = sctp.RTCSctpTransport._send_chunk

    @functools.wraps(send_chunk)
    async def traced_send_chunk(self, chunk):
        kind = type(chunk).__name__
        COUNTS[f"sent_{kind}"] += 1
        if kind == "DataChunk":
            COUNTS["cwnd_packets_sum"] += self._cwnd // sctp.USERDATA_MAX_LENGTH
        await send_chunk(self, chunk)

    sctp.RTCSctpTransport._send_chunk = traced_send_chunk
    handle = sctp.RTCSctpTransport._handle_data

    @functools.wraps(handle)
    async def traced_handle(self, data):
        COUNTS["received_packets"] += 1
        await handle(self, data)

    sctp.RTCSctpTransport._handle_data = traced_handle
    expired = sctp.RTCSctpTransport._t3_expired

    @functools.wraps(expired)
    def traced_expired(self):
        COUNTS["t3_expired"] += 1
        expired(self)

    sctp.RTCSctpTransport._t3_expired = traced_expired


def install(role: str) -> None:
    """Wrap the hand-off points; ``role`` is ``"coordinator"`` or ``"worker"`` (prefix of the points)."""
    from swarm.peer.coordinator import dispatch as dispatch_mod
    from swarm.peer.coordinator import role as coordinator_mod
    from swarm.peer.net import link as link_mod
    from swarm.peer.net import messages
    from swarm.peer.worker import ffn as worker_ffn
    from swarm.peer.worker import role as worker_mod

    _install_sctp()
    side = "c" if role == "coordinator" else "w"
    last_arrival = threading.local()
    encode, decode = messages.encode, messages.decode

    def traced_encode(msg, *args, **kw):
        data = encode(msg, *args, **kw)
        rid = _ffn_rid(msg)
        if rid is not None:
            mark(rid, f"{side}_encoded")
        return data

    def traced_decode(frame, *args, **kw):
        msg = decode(frame, *args, **kw)
        rid = _ffn_rid(msg)
        if rid is not None:
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
        rid = _ffn_rid(message)
        if rid is not None and side == "c":
            mark(rid, "c_loop")
        await link_send(self, message)
        if rid is not None:
            mark(rid, f"{side}_channel")

    link_mod.Link.send = traced_link_send

    if side == "c":
        current = threading.local()
        send = coordinator_mod.CoordinatorRole.send

        @functools.wraps(send)
        def traced_send(self, peer, msg):
            rid = _ffn_rid(msg)
            if rid is not None:
                mark(rid, "c_send")
                current.rid = rid
            return send(self, peer, msg)

        coordinator_mod.CoordinatorRole.send = traced_send
        deliver = dispatch_mod.RemoteFFN.deliver

        @functools.wraps(deliver)
        def traced_deliver(self, peer, msg):
            deliver(self, peer, msg)
            mark(msg.request_id, "c_delivered")

        dispatch_mod.RemoteFFN.deliver = traced_deliver
        check = dispatch_mod.RemoteFFN._check_answer

        @functools.wraps(check)
        def traced_check(self, req, msg):
            mark(req.request_id, "c_woke")
            return check(self, req, msg)

        dispatch_mod.RemoteFFN._check_answer = traced_check
        own = dispatch_mod.swiglu_rows  # the coordinator's own share (and recomputations)

        @functools.wraps(own)
        def traced_own(*args, **kw):
            rid = getattr(current, "rid", 0)
            mark(rid, "c_own")
            out = own(*args, **kw)
            mark(rid, "c_own_done")
            return out

        dispatch_mod.swiglu_rows = traced_own
        from swarm.compute import serving

        step = serving.BatchScheduler._step

        @functools.wraps(step)
        def traced_step(self, parts):
            mark(len(parts), "step")
            step(self, parts)
            mark(len(parts), "step_done")

        serving.BatchScheduler._step = traced_step
    else:
        handle = worker_ffn.Worker.handle

        @functools.wraps(handle)
        def traced_handle(self, msg):
            mark(msg.request_id, "w_compute")
            out = handle(self, msg)
            mark(msg.request_id, "w_computed")
            return out

        worker_ffn.Worker.handle = traced_handle
        on_req = worker_mod.WorkerRole._on_request

        @functools.wraps(on_req)
        async def traced_on_req(self, link, msg):
            mark(msg.request_id, "w_task")
            await on_req(self, link, msg)

        worker_mod.WorkerRole._on_request = traced_on_req
        sender = worker_mod.send_logged  # how the worker role sends its answers

        @functools.wraps(sender)
        async def traced_worker_send(link, msg):
            rid = _ffn_rid(msg)
            if rid is not None:
                mark(rid, "w_loop")
            await sender(link, msg)

        worker_mod.send_logged = traced_worker_send


def window(on: bool) -> None:
    """Mark the start (``on``) or end of a measured window in the event list."""
    mark(0, "window_on" if on else "window_off")
    if on:
        COUNTS.clear()


def dump(path: str | Path) -> None:
    with _LOCK:
        Path(path).write_text(json.dumps({"events": EVENTS, "counts": dict(COUNTS)}))


def breakdown(coordinator: str | Path, worker: str | Path) -> dict:
    """Per batch size (sequences in a step): steps, median step ms, and per request the median
    microseconds between consecutive points, the round trip, the worker's compute and the
    coordinator's own share; only requests within the measured window (:func:`window`). Packet
    counts: the coordinator's within the window, the worker's over its whole run; the mean
    congestion window at a DATA send is ``cwnd_packets_sum / sent_DataChunk``."""
    c, w = json.loads(Path(coordinator).read_text()), json.loads(Path(worker).read_text())
    on = [ns for rid, p, ns in c["events"] if p == "window_on"]
    off = [ns for rid, p, ns in c["events"] if p == "window_off"]
    spans = list(zip(on, off))

    def inside(ns: int) -> bool:
        return any(a <= ns <= b for a, b in spans)

    steps, by_rid, own = [], {}, {}
    open_step = None
    for rid, point, ns in c["events"]:
        if point == "step":
            open_step = (rid, ns, [])
        elif point == "step_done" and open_step is not None:
            if inside(open_step[1]):
                steps.append((open_step[0], open_step[1], ns, open_step[2]))
            open_step = None
        elif point in ("c_own", "c_own_done"):
            own.setdefault(rid, {})[point] = ns
        elif point in POINTS:
            by_rid.setdefault(rid, {})[point] = ns
            if point == "c_send" and open_step is not None:
                open_step[2].append(rid)
    for rid, point, ns in w["events"]:
        if point in POINTS:
            by_rid.setdefault(rid, {})[point] = ns
    out: dict = {"counts": {"coordinator": c["counts"], "worker": w["counts"]}}
    for size in sorted({s for s, *_ in steps}):
        these = [s for s in steps if s[0] == size]
        rids = [r for s in these for r in s[3] if all(k in by_rid.get(r, {}) for k in POINTS)]
        level: dict = {"steps": len(these),
                       "step_ms": round(statistics.median((b - a) / 1e6 for _, a, b, _ in these), 2),
                       "requests_per_step": round(statistics.median(len(s[3]) for s in these), 1),
                       "requests": len(rids)}
        if rids:
            pts = [by_rid[r] for r in rids]
            for a, b in zip(POINTS, POINTS[1:]):
                level[f"{a}->{b}_us"] = round(statistics.median((p[b] - p[a]) / 1e3 for p in pts), 1)
            level["round_trip_us"] = round(statistics.median((p["c_woke"] - p["c_send"]) / 1e3 for p in pts), 1)
            level["worker_compute_us"] = round(statistics.median((p["w_computed"] - p["w_compute"]) / 1e3
                                                                 for p in pts), 1)
            owned = [own[r] for r in rids if len(own.get(r, {})) == 2]
            if owned:
                level["own_share_us"] = round(statistics.median((o["c_own_done"] - o["c_own"]) / 1e3
                                                                for o in owned), 1)
            # The token loop's layer time outside the round trip: attention, norms, the sum.
            layer_ms = [(b - a) / 1e6 / max(len(r), 1) for _, a, b, r in these]
            level["layer_us"] = round(statistics.median(layer_ms) * 1e3, 1)
        out[str(size)] = level
    return out
