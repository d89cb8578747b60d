"""Bench-only profile of stages pipelined over pipes (``bench/serve.py --pipeline --profile``):
``perf_counter_ns`` at each point a group's stage request and its answer pass, on both sides,
and a summary per measured run — each hop's median and p90, each stage peer's busy fraction, the
stages' idle gaps between groups (bubbles), the groups in flight, a step's critical path split
into compute, hand-off and waiting, and each stage's compute by the rows of a group.

A group is what crosses the stages together: the sequences of one batch scheduler's step, or one
of the groups ``micro_groups`` cuts a step into. :func:`install` wraps (class- or module-level,
before any stage exists) on the coordinator: ``BatchScheduler._step`` (a step: embeddings,
layers, head and sampling), ``StagedFFN.run_layers_batch`` (the step's layers), ``micro_groups``
(its groups), ``StagedFFN._run_stage`` (a group through one stage), ``StagedFFN._local`` and
``_local_locked`` (a stage computed here: the lock, the layers), the bench's ``_PipeLink.send``
(the request handed off), ``messages.encode`` / ``_write_frame`` (encoded, written to the pipe),
``_read_frame`` / ``messages.decode`` (the reader waiting, the answer's frame read, decoded),
``StagedFFN.deliver`` (the waiting lane's future resolved) and ``_check_answer`` (the lane woke);
on a stage worker process: the same reader and writer points and ``StageRunner.handle`` (its
compute). Each point appends ``(key, point, ns)`` to this process's list (``key``: the request
id for a request's points, the step or group number for the coordinator's own); :func:`dump`
writes it as JSON, a stage worker at its end to the file named by ``PROFILE_ENV``.
``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, shared by the processes of one machine, so the
sides' stamps compare directly. Off unless installed; nothing in ``swarm/`` imports this.

Points of a request (coordinator ``c_``, stage worker ``w_``), in visiting order::

    c_send      the lane hands the group's StageRequest to the link (_PipeLink.send)
    c_encoded   encoded
    c_written   written to the worker's pipe (flushed)
    w_wait      the worker's reader starts waiting for a frame (after its last answer's write)
    w_read      the frame read complete (decode called)
    w_decoded   decoded
    w_compute   StageRunner.handle starts (checks, caches, the layers)
    w_computed  handle done
    w_encoded   answer encoded
    w_written   answer written to the pipe
    c_read      coordinator: the answer's frame read by the pipe's reader thread
    c_decoded   decoded
    c_delivered StagedFFN.deliver done: the waiting lane's future resolved
    c_woke      the lane runs again (_check_answer)

A group's points (key: group number): ``in{s}`` / ``out{s}`` around stage ``s``, and for a stage
run here ``lock{s}`` (waiting for the coordinator's compute lock), ``compute{s}``,
``computed{s}``. A step's (key: step number): ``step``, ``layers``, ``layers_done``,
``step_done``.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import threading
import time
from pathlib import Path

PROFILE_ENV = "COLIBRI_PIPELINE_PROFILE"  # a stage worker process writes its events there at its end

EVENTS: list[tuple[int, str, int]] = []
GROUPS: dict[int, tuple[int, int, int, int]] = {}  # group → (step, index in the step, rows, sequences)
LINKS: dict[int, tuple[int, int]] = {}  # request id → (group, stage index)
WINDOWS: list[tuple[str, int, int, int]] = []  # (run name, round, start ns, end ns)
_now = time.perf_counter_ns

REQUEST_POINTS = ("c_send", "c_encoded", "c_written", "w_wait", "w_read", "w_decoded", "w_compute", "w_computed",
                  "w_encoded", "w_written", "c_read", "c_decoded", "c_delivered", "c_woke")
# the hops of a remote stage: (name, from, to); "queued" and "transit" split c_written → w_read
# at the worker's w_wait (a frame written while the worker computes another group waits in the pipe)
HOPS = (("prepare", "in", "c_send"), ("encode", "c_send", "c_encoded"), ("write", "c_encoded", "c_written"),
        ("queued", None, None), ("transit", None, None), ("decode", "w_read", "w_decoded"),
        ("to_compute", "w_decoded", "w_compute"), ("compute", "w_compute", "w_computed"),
        ("encode_answer", "w_computed", "w_encoded"), ("write_answer", "w_encoded", "w_written"),
        ("answer_transit", "w_written", "c_read"), ("decode_answer", "c_read", "c_decoded"),
        ("deliver", "c_decoded", "c_delivered"), ("wake", "c_delivered", "c_woke"), ("finish", "c_woke", "out"))


def mark(key: int, point: str) -> None:
    EVENTS.append((key, point, _now()))  # one append: atomic under the GIL, no lock


def _rid(msg) -> int | None:
    from swarm.peer.net.messages import StageAnswer, StageRequest

    return msg.request_id if isinstance(msg, (StageRequest, StageAnswer)) else None


def _around(owner, name: str, before=None, after=None) -> None:
    """Replace ``owner.name`` (a class's method or a module's function) by a wrapper that calls
    ``before(*args)`` ahead of it and ``after(*args)`` once it returns or raises."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        if before is not None:
            before(*args)
        try:
            return fn(*args, **kw)
        finally:
            if after is not None:
                after(*args)

    setattr(owner, name, wrapped)


def install(role: str, bench) -> None:
    """Wrap the points; ``role`` is ``"coordinator"`` or ``"worker"``, ``bench`` the module of
    bench/serve.py (its ``_PipeLink``, ``_write_frame``, ``_read_frame``)."""
    from swarm.peer.net import messages
    from swarm.peer.worker import stages as worker_stages

    side = "c" if role == "coordinator" else "w"
    local = threading.local()  # this thread's frame being written / read, step and group at hand
    encode, decode = messages.encode, messages.decode

    def traced_encode(msg, *args, **kw):
        data = encode(msg, *args, **kw)
        rid = _rid(msg)
        if rid is not None:
            mark(rid, f"{side}_encoded")
            local.writing = rid
        return data

    def traced_decode(frame, *args, **kw):
        read = _now()
        msg = decode(frame, *args, **kw)
        rid = _rid(msg)
        if rid is not None:
            EVENTS.append((rid, f"{side}_wait", getattr(local, "waiting", read)))
            EVENTS.append((rid, f"{side}_read", read))
            mark(rid, f"{side}_decoded")
        return msg

    messages.encode, messages.decode = traced_encode, traced_decode

    def written(f, lock, msg):
        if getattr(local, "writing", None) is not None:
            mark(local.writing, f"{side}_written")

    _around(bench, "_write_frame", lambda f, lock, msg: setattr(local, "writing", None), written)
    _around(bench, "_read_frame", lambda f: setattr(local, "waiting", _now()))
    if side == "w":
        _around(worker_stages.StageRunner, "handle", lambda self, msg: mark(msg.request_id, "w_compute"),
                lambda self, msg: mark(msg.request_id, "w_computed"))
    else:
        _install_coordinator(bench, local)


def _install_coordinator(bench, local: threading.local) -> None:
    from swarm.compute import serving
    from swarm.peer.coordinator import stages as stages_mod

    steps, groups = itertools.count(1), itertools.count(1)
    by_list: dict[int, int] = {}  # id() of a live group list → its group number

    def step(self, parts):
        local.step = next(steps)
        mark(local.step, "step")

    _around(serving.BatchScheduler, "_step", step, lambda self, parts: mark(local.step, "step_done"))
    _around(stages_mod.StagedFFN, "run_layers_batch", lambda *_: mark(getattr(local, "step", 0), "layers"),
            lambda *_: mark(getattr(local, "step", 0), "layers_done"))
    micro_groups = stages_mod.micro_groups

    @functools.wraps(micro_groups)
    def traced_micro_groups(parts, n):
        out = micro_groups(parts, n)
        s = getattr(local, "step", 0)
        for i, grp in enumerate(out):
            g = next(groups)
            by_list[id(grp)] = g  # live for the step: a later list with its id overwrites it
            GROUPS[g] = (s, i, sum(p.x.shape[0] for p in grp), len(grp))
        return out

    stages_mod.micro_groups = traced_micro_groups

    def stage_in(self, group, stage, layout):
        local.at = (by_list.get(id(group), 0), layout.stages.index(stage))
        mark(local.at[0], f"in{local.at[1]}")

    def point(name):  # a mark of the group and stage at hand on this thread
        def at(*args):
            g, s = getattr(local, "at", (0, 0))
            mark(g, f"{name}{s}")
        return at

    _around(stages_mod.StagedFFN, "_run_stage", stage_in, point("out"))
    _around(stages_mod.StagedFFN, "_local", point("lock"))
    _around(stages_mod.StagedFFN, "_local_locked", point("compute"), point("computed"))

    def send(self, peer, msg):
        rid = _rid(msg)
        if rid is not None:
            LINKS[rid] = getattr(local, "at", (0, 0))
            mark(rid, "c_send")

    _around(bench._PipeLink, "send", send)
    _around(stages_mod.StagedFFN, "deliver", after=lambda self, peer, msg: mark(msg.request_id, "c_delivered"))
    _around(stages_mod, "_check_answer", lambda req, msg: mark(req.request_id, "c_woke"))


def window(name: str, rnd: int, start_ns: int) -> None:
    """A measured run ``name`` of round ``rnd`` went from ``start_ns`` until now."""
    WINDOWS.append((name, rnd, start_ns, _now()))


def dump(path: str | Path) -> None:
    Path(path).write_text(json.dumps({"events": EVENTS}))


# ------------------------------------------------------------------------------ summary

def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q * (len(xs) - 1))), len(xs) - 1)]


def _dist(xs: list[float]) -> dict:
    """Median, p90 and mean (ms) of durations in ns."""
    return ({"median": _ms(statistics.median(xs)), "p90": _ms(_q(xs, 0.9)), "mean": _ms(statistics.fmean(xs)),
             "n": len(xs)} if xs else {"n": 0})


def _union(spans: list[tuple[int, int]], lo: int, hi: int) -> int:
    """ns covered by ``spans`` within [lo, hi]."""
    total, end = 0, lo
    for a, b in sorted(spans):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def summarize(worker_paths: list[str | Path]) -> dict[tuple[str, int], dict]:
    """Each measured window's profile (module docstring), keyed by (run name, round)."""
    req: dict[int, dict[str, int]] = {}
    grp: dict[int, dict[str, int]] = {}
    stp: dict[int, dict[str, int]] = {}
    for key, point, ns in EVENTS:
        if point.startswith(("c_", "w_")):
            req.setdefault(key, {})[point] = ns
        elif point in ("step", "layers", "layers_done", "step_done"):
            stp.setdefault(key, {})[point] = ns
        else:
            grp.setdefault(key, {})[point] = ns
    for p in worker_paths:  # a worker that did not end (killed) left none: its requests are left out
        for key, point, ns in json.loads(Path(p).read_text())["events"] if Path(p).exists() else ():
            req.setdefault(key, {})[point] = ns
    by_group: dict[int, dict[int, int]] = {}  # group → stage → request id
    for rid, (g, s) in LINKS.items():
        if all(k in req.get(rid, {}) for k in REQUEST_POINTS):
            by_group.setdefault(g, {})[s] = rid
    return {(name, rnd): _window(lo, hi, req, grp, stp, by_group) for name, rnd, lo, hi in WINDOWS}


def _window(lo: int, hi: int, req, grp, stp, by_group) -> dict:
    wall = hi - lo
    n_stages = 1 + max((s for g in grp.values() for s in (int(p[3:]) for p in g if p.startswith("out"))), default=0)
    groups = {g: pts for g, pts in grp.items() if g in GROUPS and lo <= pts.get("in0", -1) <= hi
              and all(f"out{s}" in pts for s in range(n_stages))}
    out: dict = {"window_ms": _ms(wall), "groups": len(groups)}
    if not groups:
        return out
    rows = [GROUPS[g][2] for g in groups]
    out["rows_per_group"] = {str(r): rows.count(r) for r in sorted(set(rows))}
    out["sequences_per_group"] = {str(n): [GROUPS[g][3] for g in groups].count(n)
                                  for n in sorted({GROUPS[g][3] for g in groups})}
    stages = []
    for s in range(n_stages):
        st: dict = {"stage": s}
        remote = {g: req[by_group[g][s]] for g in groups if s in by_group.get(g, {})}
        here = {g: pts for g, pts in groups.items() if f"compute{s}" in pts}
        st["where"] = "worker" if len(remote) >= len(here) else "coordinator"
        st["groups"] = {"worker": len(remote), "coordinator": len(here)}
        compute: dict[int, tuple[int, int]] = {}  # group → its compute span at this stage
        hops: dict[str, list[float]] = {}
        if st["where"] == "worker":
            for g, r in remote.items():
                p = {**r, "in": groups[g][f"in{s}"], "out": groups[g][f"out{s}"]}
                for name, a, b in HOPS:
                    if a is None:
                        continue
                    hops.setdefault(name, []).append(p[b] - p[a])
                start = max(p["c_written"], p["w_wait"])
                hops.setdefault("queued", []).append(max(0, p["w_wait"] - p["c_written"]))
                hops.setdefault("transit", []).append(p["w_read"] - start)
                hops.setdefault("round_trip", []).append(p["c_woke"] - p["c_send"])
                hops.setdefault("hand_off", []).append(p["c_woke"] - p["c_send"] - (p["w_computed"] - p["w_compute"])
                                                       - max(0, p["w_wait"] - p["c_written"]))
                compute[g] = (p["w_compute"], p["w_computed"])
            # the worker's reader blocked on its pipe: waiting for its next group
            starved = [r["w_read"] - max(r["w_wait"], lo) for g, r in remote.items()]
        else:
            for g, pts in here.items():
                hops.setdefault("prepare", []).append(pts[f"lock{s}"] - pts[f"in{s}"])
                hops.setdefault("lock_wait", []).append(pts[f"compute{s}"] - pts[f"lock{s}"])
                hops.setdefault("compute", []).append(pts[f"computed{s}"] - pts[f"compute{s}"])
                hops.setdefault("finish", []).append(pts[f"out{s}"] - pts[f"computed{s}"])
                compute[g] = (pts[f"compute{s}"], pts[f"computed{s}"])
            starved = []
        if s + 1 < n_stages:
            hops["to_next_stage"] = [pts[f"in{s + 1}"] - pts[f"out{s}"] for pts in groups.values()]
        else:  # to the step's head (a pipelined step's groups wait there for its last one)
            hops["to_head"] = [stp[GROUPS[g][0]]["layers_done"] - pts[f"out{s}"] for g, pts in groups.items()
                               if "layers_done" in stp.get(GROUPS[g][0], {})]
        st["hops_ms"] = {k: _dist(v) for k, v in hops.items()}
        if "round_trip" in hops:  # c_send → c_woke: the hops between add up to it, group by group
            parts = [name for name, *_ in HOPS if name not in ("prepare", "finish")]
            st["sum_of_hop_means_ms"] = round(sum(st["hops_ms"][k]["mean"] for k in parts), 3)
            st["sum_of_hop_medians_ms"] = round(sum(st["hops_ms"][k]["median"] for k in parts), 3)
        spans = sorted(compute.values())
        st["busy_fraction"] = round(_union(spans, lo, hi) / wall, 3)
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
        st["idle_gaps_ms"] = {**_dist(gaps), "sum": _ms(sum(gaps))}
        if starved:
            st["waiting_for_input_ms"] = {**_dist(starved), "sum": _ms(sum(starved))}
        by_rows: dict[int, list[float]] = {}
        for g, (a, b) in compute.items():
            by_rows.setdefault(GROUPS[g][2], []).append(b - a)
        st["compute_ms_by_rows"] = {str(r): {"median": _ms(statistics.median(v)), "groups": len(v)}
                                    for r, v in sorted(by_rows.items())}
        stages.append(st)
    out["stages"] = stages
    spans = [(pts["in0"], pts[f"out{n_stages - 1}"]) for pts in groups.values()]
    out["groups_in_flight_mean"] = round(sum(max(0, min(b, hi) - max(a, lo)) for a, b in spans) / wall, 3)
    out["coordinator"] = _coordinator(lo, hi, stp, groups, n_stages)
    out["critical_path"] = _critical_path(lo, hi, req, stp, groups, by_group, n_stages)
    return out


def _coordinator(lo: int, hi: int, stp, groups, n_stages: int) -> dict:
    """The coordinator process's busy fraction: its stage's compute, its steps outside the layers
    (embeddings, head, sampling, the scheduler's own work), and both (union)."""
    steps = {k: v for k, v in stp.items() if len(v) == 4 and lo <= v["step"] <= hi}
    outside = [span for v in steps.values() for span in ((v["step"], v["layers"]), (v["layers_done"], v["step_done"]))]
    mine = [(pts[f"compute{s}"], pts[f"computed{s}"]) for pts in groups.values()
            for s in range(n_stages) if f"compute{s}" in pts]
    wall = hi - lo
    return {"steps": len(steps), "layers_busy_fraction": round(_union(mine, lo, hi) / wall, 3),
            "embed_head_sampling_busy_fraction": round(_union(outside, lo, hi) / wall, 3),
            "busy_fraction": round(_union(mine + outside, lo, hi) / wall, 3),
            "embed_ms": _dist([v["layers"] - v["step"] for v in steps.values()]),
            "head_sampling_ms": _dist([v["step_done"] - v["layers_done"] for v in steps.values()])}


def _critical_path(lo: int, hi: int, req, stp, groups, by_group, n_stages: int) -> dict:
    """Per step, its chain of dependencies back from its layers' end: at each group and stage the
    later of (the group at the stage before, the group before at this stage: a lane takes them
    in order); each span classed as compute (layers, here or on a worker), waiting (a request
    queued in a worker's pipe behind another group, a stage here waiting for the compute lock),
    hand-off (everything else between the layers' start and end: encode, pipes, decode, wakes,
    the lanes' threads) and the coordinator's own (embeddings, head, sampling). Sums over the
    window's steps, and their shares of the steps' time."""
    per_step: dict[int, dict[int, dict[str, int]]] = {}
    for g, pts in groups.items():
        per_step.setdefault(GROUPS[g][0], {})[GROUPS[g][1]] = {"g": g, **pts}
    total = {"compute": 0, "hand_off": 0, "waiting": 0, "embed_head_sampling": 0}
    n = 0
    for s_id, by_index in per_step.items():
        st = stp.get(s_id)
        if not st or len(st) < 4:
            continue
        n += 1
        total["embed_head_sampling"] += (st["layers"] - st["step"]) + (st["step_done"] - st["layers_done"])
        last = max(by_index, key=lambda i: by_index[i][f"out{n_stages - 1}"])
        i, s, t = last, n_stages - 1, st["layers_done"]
        while True:
            pts = by_index[i]
            total["hand_off"] += t - pts[f"out{s}"]
            seg = pts[f"out{s}"] - pts[f"in{s}"]
            rid = by_group.get(pts["g"], {}).get(s)
            if rid is not None:
                r = req[rid]
                c, w = r["w_computed"] - r["w_compute"], max(0, r["w_wait"] - r["c_written"])
            elif f"compute{s}" in pts:
                c, w = pts[f"computed{s}"] - pts[f"compute{s}"], pts[f"compute{s}"] - pts[f"lock{s}"]
            else:
                c, w = 0, 0
            total["compute"] += c
            total["waiting"] += w
            total["hand_off"] += seg - c - w
            t = pts[f"in{s}"]
            before = [(by_index[i][f"out{s - 1}"], i, s - 1)] if s else []
            if i - 1 in by_index:
                before.append((by_index[i - 1][f"out{s}"], i - 1, s))
            if not before:
                total["hand_off"] += t - st["layers"]
                break
            _, i, s = max(before)
    if not n:
        return {"steps": 0}
    span = sum(total.values())
    return {"steps": n, "step_ms_mean": _ms(span / n),
            **{f"{k}_ms_per_step": _ms(v / n) for k, v in total.items()},
            **{f"{k}_share": round(v / span, 3) for k, v in total.items()}}
