"""Placement: which peer computes which experts and dense columns of which layer. Pure.

Theory of operation
-------------------
The coordinator turns what the peers said in their hellos (memory budget for
weights, measured FFN throughput, round trip) into a :class:`Plan`:

* every MoE layer's routed experts ``0..E-1`` are cut into contiguous
  :class:`Span` s, one per peer that gets any, in the plan's peer order;
* every dense MLP's intermediate dimension ``0..F-1`` is cut the same way, so
  the partial outputs of the spans sum to the full MLP (the coordinator adds
  them in span order);
* shared experts (Qwen2-MoE) are not in the plan: they stay with the
  coordinator, with the embeddings, attention, routers, norms and head.

Shares are proportional to capacity — the measured throughput, with the
coordinator's counted at ``coordinator_share`` of its own because it also runs
attention, routing and sampling. Every peer has a memory budget, counted in the
bytes each holds in its encoding (:class:`ModelShape`: a Python peer keeps the
file's blocks, a browser peer Q8_0 repacks of the types its kernels cannot read);
the coordinator's is what its budget leaves after the weights only it holds. No
peer gets more than its budget: a capped share goes back to the others
(water-filling). What no peer can hold goes to the coordinator beyond its
budget — it has the model file and reads those weights from its mapping for
every token that needs them (slow: disk or page cache, not memory) — and the
plan says how many bytes that is (:attr:`Plan.streamed_bytes`). The round trip sets each request's
deadline rather than the shares: on a LAN it is far below a layer's compute,
and a heartbeat RTT measured while a peer was still loading its model is
inflated for a while. Only a peer whose round trip exceeds ``MAX_RTT_S`` —
a link that would stall every layer — gets nothing.

A plan carries the election term and a version that grows with each rebuild;
the coordinator rebuilds it when membership changes and switches to the new one
between decode steps only, never inside one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from swarm.errors import RemoteProtocolError

MAX_RTT_S = 5.0  # a link this slow to answer would stall every layer (seconds)
COORDINATOR_SHARE = 0.5  # the coordinator also runs attention/routing/sampling
Q8_0_BYTES = 34 / 32  # bytes per weight of a Q8_0 block (f16 scale + 32 int8): a browser's repack


@dataclass(frozen=True)
class PeerCapacity:
    """What a peer offers, from its hello.

    ``memory_bytes``: the peer's allowance (bytes, ≥ 0: its hello's ``memory_budget``, what
    weights, KV cache and activations may take together, see :mod:`swarm.peer.memory`); a
    range peer's weights get that less :attr:`ModelShape.step_bytes`. ``ffn_speed``: measured
    FFN throughput in any unit shared by all peers (e.g. GFLOP/s; > 0 to get work).
    ``rtt_s``: measured round trip to the coordinator (seconds).
    """

    peer_id: str
    memory_bytes: int
    ffn_speed: float
    rtt_s: float = 0.0
    kind: str = "python"  # "browser": holds Q8_0 repacks of what its kernels cannot read


@dataclass(frozen=True)
class ModelShape:
    """The sizes the planner needs, from the model config and the weight dtype.

    ``moe_layers``: layer indices with routed experts; ``dense_layers``: layer
    indices with a dense MLP of width ``intermediate_size``. ``bytes_per_weight``:
    the in-memory size of one weight (4.0 for float32), used when the encoded sizes
    are not given. From a model file (:meth:`from_model`) the sizes are the real
    encoded ones, in bytes: ``expert_nbytes`` (one routed expert: gate, up, down,
    the largest over layers), ``column_nbytes`` (one dense intermediate unit),
    ``page_expert_nbytes`` / ``page_column_nbytes`` (the same on a browser peer:
    tensors its kernels cannot read are repacked to Q8_0, 34 bytes per 32
    weights) and ``resident_nbytes`` (what only the coordinator holds:
    embeddings, attention, routers as float32, norms, head, shared experts).

    What is not a weight, in bytes (from the config and :func:`swarm.peer.memory.context_tokens`;
    0 when not given): ``kv_layer_bytes``, the KV cache of one layer for the reserved context;
    ``step_bytes``, a worker's activations in one step (:data:`swarm.peer.memory.STEP_ROWS` rows);
    ``coordinator_step_bytes``, the coordinator's (its head's logits too); ``record_bytes``, the
    rows it records per worker stage; ``n_layers``; ``top_k``, the experts a token uses.
    """

    hidden_size: int
    n_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    bytes_per_weight: float = 4.0
    expert_nbytes: int = 0
    column_nbytes: int = 0
    page_expert_nbytes: int = 0
    page_column_nbytes: int = 0
    resident_nbytes: int = 0
    # what is not a weight, and what sizes it (see above)
    n_layers: int = 0
    top_k: int = 0
    kv_layer_bytes: int = 0
    step_bytes: int = 0
    coordinator_step_bytes: int = 0
    record_bytes: int = 0

    @classmethod
    def from_model(cls, model) -> "ModelShape":
        """From a :class:`swarm.compute.model.Model`, with the encoded size of every FFN
        tensor as the file stores it. Only the file's header is read (no weight bytes)."""
        from swarm.peer.weights.repack import PAGE_ENCODINGS

        base = cls.from_config(model.config)
        ck = model.checkpoint

        def sizes(mats, per: int) -> tuple[int, int]:
            own = sum(m.nbytes for m in mats)
            page = sum(m.nbytes if m.qtype.name in PAGE_ENCODINGS else math.ceil(m.data.shape[0] * m.cols * Q8_0_BYTES)
                       for m in mats)
            return math.ceil(own / per), math.ceil(page / per)

        expert = [sizes(ck.expert_matrices(layer, 0), 1) for layer in base.moe_layers]
        column = [sizes([ck.matrix(p, layer) for p in ("gate", "up", "down")], base.intermediate_size)
                  for layer in base.dense_layers]
        e_own, e_page = (max(x) for x in zip(*expert)) if expert else (0, 0)
        c_own, c_page = (max(x) for x in zip(*column)) if column else (0, 0)
        files = sum(os.path.getsize(p) for p in getattr(ck, "files", [model.path]) if os.path.isfile(p))
        ffn = len(base.moe_layers) * base.n_experts * e_own + len(base.dense_layers) * base.intermediate_size * c_own
        routers = len(base.moe_layers) * base.n_experts * base.hidden_size * 4  # decoded to float32
        return dataclasses.replace(base, expert_nbytes=e_own, column_nbytes=c_own, page_expert_nbytes=e_page,
                                   page_column_nbytes=c_page, resident_nbytes=max(files - ffn, 0) + routers)

    @classmethod
    def from_config(cls, cfg, bytes_per_weight: float = 4.0) -> "ModelShape":
        """From a :class:`swarm.compute.config.ModelConfig`."""
        moe = tuple(cfg.moe_layers) if cfg.n_experts else ()
        dense = tuple(i for i in range(cfg.n_layers) if i not in moe) if cfg.intermediate_size else ()
        r = reserve_of(cfg)
        return cls(cfg.hidden_size, cfg.n_experts, cfg.moe_intermediate_size, cfg.intermediate_size,
                   moe, dense, bytes_per_weight, n_layers=cfg.n_layers, top_k=cfg.top_k if moe else 0, kv_layer_bytes=r["kv_layer_bytes"],
                   step_bytes=r["step_bytes"], coordinator_step_bytes=r["coordinator_step_bytes"],
                   record_bytes=r["record_bytes"])

    def worker_weight_budget(self, allowance: int) -> int:
        """Bytes of expert and MLP ranges a worker of ``allowance`` (its hello's budget) may hold:
        the allowance less one step's activations (a range peer keeps no KV cache)."""
        return max(allowance - self.step_bytes, 0)

    def coordinator_fixed_bytes(self, worker_stages: int = 0, kv_layers: int | None = None,
                                not_run_bytes: int = 0) -> int:
        """What the coordinator holds besides expert and MLP ranges (bytes): what only it holds
        (``resident_nbytes``) less ``not_run_bytes`` (the attention of layers whose stages run
        elsewhere: it maps them, but touches them only after a failover), the KV cache of the
        ``kv_layers`` layers whose attention it runs (None: every layer; under stages, its own
        stages' layers — a KV cache holds arrays only for the layers that run), its activations
        and the rows it records for ``worker_stages`` stages held by workers."""
        kv = self.n_layers if kv_layers is None else kv_layers
        return (self.resident_nbytes - not_run_bytes + kv * self.kv_layer_bytes + self.coordinator_step_bytes
                + worker_stages * self.record_bytes)

    def coordinator_weight_budget(self, allowance: int, worker_stages: int = 0, kv_layers: int | None = None,
                                  not_run_bytes: int = 0) -> int:
        """Bytes of expert and MLP ranges the coordinator of ``allowance`` may hold: the allowance
        less :meth:`coordinator_fixed_bytes` (same arguments), never below 0."""
        return max(allowance - self.coordinator_fixed_bytes(worker_stages, kv_layers, not_run_bytes), 0)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert: gate [F, H], up [F, H], down [H, F]."""
        return self.expert_nbytes or math.ceil(3 * self.hidden_size * self.moe_intermediate_size * self.bytes_per_weight)

    @property
    def column_bytes(self) -> int:
        """Bytes of one dense intermediate column: a gate row, an up row, a down column."""
        return self.column_nbytes or math.ceil(3 * self.hidden_size * self.bytes_per_weight)

    def unit_bytes(self, kind: str = "python") -> tuple[int, int]:
        """(bytes of one expert, bytes of one dense column) as a peer of ``kind`` holds them."""
        if kind == "browser":
            return self.page_expert_nbytes or self.expert_bytes, self.page_column_nbytes or self.column_bytes
        return self.expert_bytes, self.column_bytes

    def ffn_bytes(self, kind: str = "python") -> int:
        """Bytes of every routed expert and dense MLP of the model, as a peer of ``kind`` holds them."""
        e, c = self.unit_bytes(kind)
        return len(self.moe_layers) * self.n_experts * e + len(self.dense_layers) * self.intermediate_size * c


def reserve_of(cfg, context: int | None = None) -> dict[str, int]:
    """What a peer keeps besides weights for a model of config ``cfg`` (bytes): ``kv_layer_bytes``
    (one layer's keys and values for ``context`` tokens, default
    :func:`swarm.peer.memory.context_tokens`), ``step_bytes`` (a worker's activations of one
    step), ``coordinator_step_bytes`` (the coordinator's, with the head's logits for every row of
    a decode batch), ``record_bytes`` (the rows the coordinator records per worker stage, for
    failover: ``context`` rows of the hidden size), ``context`` (tokens)."""
    from swarm.peer import memory

    ctx = context or memory.context_tokens(getattr(cfg, "max_position_embeddings", 0) or 0)
    H, hd = cfg.hidden_size, cfg.head_dim
    attn = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    ffn = max(cfg.top_k * cfg.moe_intermediate_size + getattr(cfg, "shared_expert_intermediate_size", 0)
              if cfg.n_experts else 0, cfg.intermediate_size or 0)
    step = memory.activation_bytes(memory.STEP_ROWS, H, attn, ffn)
    logits = memory.activation_bytes(memory.STEP_ROWS, 0, 0, 0, vocab=cfg.vocab_size)
    return {"kv_layer_bytes": memory.kv_cache_bytes(1, ctx, cfg.n_kv_heads, hd), "step_bytes": step,
            "coordinator_step_bytes": step + logits, "record_bytes": ctx * H * memory.ACT_BYTES_PER_VALUE,
            "context": ctx}


@dataclass(frozen=True)
class Span:
    """``peer`` computes units ``start..stop-1`` (experts, or intermediate columns) of one layer."""

    peer: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    """A versioned placement. ``experts[layer]`` and ``dense[layer]`` are spans in peer order
    that tile ``0..E-1`` (resp. ``0..F-1``) without gaps or overlaps.
    """

    version: int
    term: int
    coordinator: str
    peers: tuple[str, ...]  # coordinator first, then workers by peer id: the span order
    experts: Mapping[int, tuple[Span, ...]] = field(default_factory=dict)
    dense: Mapping[int, tuple[Span, ...]] = field(default_factory=dict)
    # Bytes of the coordinator's spans beyond its budget, read from its mapped file when used
    # (the swarm holds too little); not sent to workers.
    streamed_bytes: int = field(default=0, compare=False)

    def workers(self) -> tuple[str, ...]:
        """Peers other than the coordinator that hold at least one span."""
        used = {s.peer for spans in (*self.experts.values(), *self.dense.values()) for s in spans}
        return tuple(p for p in self.peers if p != self.coordinator and p in used)

    def expert_span(self, layer: int, peer: str) -> Span | None:
        return next((s for s in self.experts.get(layer, ()) if s.peer == peer), None)

    def dense_span(self, layer: int, peer: str) -> Span | None:
        return next((s for s in self.dense.get(layer, ()) if s.peer == peer), None)

    def expert_owner(self, layer: int, expert: int) -> str:
        """The peer that computes ``expert`` of ``layer``; the coordinator when unplanned."""
        for s in self.experts.get(layer, ()):
            if s.start <= expert < s.stop:
                return s.peer
        return self.coordinator

    def dense_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Dense layer → its (lo, hi) ranges in span order: the plan :class:`LocalFFN` takes."""
        return {layer: [(s.start, s.stop) for s in spans] for layer, spans in self.dense.items()}

    def bytes_of(self, peer: str, shape: ModelShape, kind: str = "python") -> int:
        """Weight bytes ``peer`` (a peer of ``kind``) must hold for its spans."""
        n_exp = sum(len(s) for spans in self.experts.values() for s in spans if s.peer == peer)
        n_col = sum(len(s) for spans in self.dense.values() for s in spans if s.peer == peer)
        e, c = shape.unit_bytes(kind)
        return n_exp * e + n_col * c

    # ------------------------------------------------------------------ wire form
    def to_dict(self) -> dict:
        """JSON-ready form, for the PlanMessage's metadata."""
        enc = lambda m: {str(l): [[s.peer, s.start, s.stop] for s in spans] for l, spans in m.items()}  # noqa: E731
        return {"version": self.version, "term": self.term, "coordinator": self.coordinator,
                "peers": list(self.peers), "experts": enc(self.experts), "dense": enc(self.dense)}

    @classmethod
    def from_dict(cls, d: object, shape: ModelShape) -> "Plan":
        """Parse and check a plan received from the network against the model's shape.

        Raises RemoteProtocolError naming the field when a type is wrong, a layer
        is not of that kind in the model, or the spans do not tile the layer.
        """
        try:
            version, term, coord = int(d["version"]), int(d["term"]), str(d["coordinator"])
            peers = tuple(str(p) for p in d["peers"])
            experts = {int(l): tuple(Span(str(p), int(a), int(b)) for p, a, b in spans)
                       for l, spans in d["experts"].items()}
            dense = {int(l): tuple(Span(str(p), int(a), int(b)) for p, a, b in spans)
                     for l, spans in d["dense"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RemoteProtocolError(f"malformed plan: {exc!r}") from None
        plan = cls(version, term, coord, peers, experts, dense)
        check_plan(plan, shape)
        return plan


    def to_message(self):
        """The :class:`swarm.peer.net.messages.PlanMessage` that announces this plan to the workers."""
        from swarm.peer.net.messages import Assignment, PlanMessage

        out = [Assignment(layer, s.peer, tuple(range(s.start, s.stop)), ())
               for layer, spans in sorted(self.experts.items()) for s in spans]
        out += [Assignment(layer, s.peer, (), ((s.start, s.stop),))
                for layer, spans in sorted(self.dense.items()) for s in spans]
        return PlanMessage(self.term, self.version, tuple(out))

    @classmethod
    def from_message(cls, msg, coordinator: str, shape: ModelShape) -> "Plan":
        """Rebuild a plan from the PlanMessage ``coordinator`` sent; checked like :meth:`from_dict`."""
        experts: dict[int, list[Span]] = {}
        dense: dict[int, list[Span]] = {}
        for a in msg.assignments:
            ids = list(a.experts)
            if ids and (a.dense or ids != list(range(ids[0], ids[0] + len(ids)))):
                raise RemoteProtocolError(f"plan v{msg.version}: layer {a.layer} experts of {a.peer} "
                                          "are not one contiguous range")
            if ids:
                experts.setdefault(a.layer, []).append(Span(a.peer, ids[0], ids[-1] + 1))
            for lo, hi in a.dense:
                dense.setdefault(a.layer, []).append(Span(a.peer, lo, hi))
        others = sorted({s.peer for t in (experts, dense) for spans in t.values() for s in spans} - {coordinator})
        order = lambda t: {l: tuple(sorted(v, key=lambda s: s.start)) for l, v in t.items()}  # noqa: E731
        plan = cls(msg.version, msg.term, coordinator, (coordinator, *others), order(experts), order(dense))
        check_plan(plan, shape)
        return plan


def check_plan(plan: Plan, shape: ModelShape) -> None:
    """Raise RemoteProtocolError unless every span list tiles its layer in peer order."""
    if plan.version < 0 or plan.term < 0 or plan.coordinator not in plan.peers:
        raise RemoteProtocolError(f"plan v{plan.version}: bad version/term or coordinator not a peer")
    for kind, table, layers, width in (("experts", plan.experts, shape.moe_layers, shape.n_experts),
                                       ("dense", plan.dense, shape.dense_layers, shape.intermediate_size)):
        for layer, spans in table.items():
            if layer not in layers:
                raise RemoteProtocolError(f"plan v{plan.version}: layer {layer} has no {kind} in this model")
            at, order = 0, [plan.peers.index(s.peer) if s.peer in plan.peers else -1 for s in spans]
            for s in spans:
                if s.start != at or s.stop <= s.start or s.peer not in plan.peers:
                    raise RemoteProtocolError(f"plan v{plan.version}: {kind} spans of layer {layer} do not tile")
                at = s.stop
            if at != width or order != sorted(set(order)):
                raise RemoteProtocolError(f"plan v{plan.version}: {kind} spans of layer {layer} do not tile "
                                          f"0..{width} in peer order")


def _shares(weights: dict[str, float], caps: dict[str, float]) -> dict[str, float]:
    """Water-filling: fractions ∝ weights, none above its cap, excess to the uncapped rest."""
    share = {p: 0.0 for p in weights}
    free = {p for p, w in weights.items() if w > 0}
    left = 1.0
    while free and left > 1e-12:
        total = sum(weights[p] for p in free)
        # The ratio first: left * w underflows for subnormal speeds, and shares then sum past 1.
        over = {p for p in free if left * (weights[p] / total) > caps[p]}
        if not over:
            for p in free:
                share[p] += left * (weights[p] / total)
            break
        for p in over:
            share[p] += caps[p]
            left -= caps[p]
        free -= over
    return share


def _cut(width: int, peers: Sequence[str], share: Mapping[str, float], rotate: int) -> list[int]:
    """Largest-remainder counts summing to ``width``; ties rotate with ``rotate`` (the layer)."""
    exact = [share.get(p, 0.0) * width for p in peers]
    counts = [math.floor(x) for x in exact]
    n = len(peers)
    order = sorted(range(n), key=lambda i: (-(exact[i] - counts[i]), (i - rotate) % n))
    for i in order[: width - sum(counts)]:
        counts[i] += 1
    return counts


def build_plan(
    shape: ModelShape,
    coordinator: PeerCapacity,
    workers: Iterable[PeerCapacity],
    *,
    term: int,
    version: int,
    coordinator_share: float = COORDINATOR_SHARE,
    coordinator_budget: int | None = None,
    layers: Collection[int] | None = None,
) -> Plan:
    """Place experts and dense columns over the coordinator and ``workers``.

    Returns a plan whose spans tile every MoE and dense layer; no worker's
    ``plan.bytes_of(peer, shape, kind)`` exceeds its weight budget.
    A worker's weights stay within :meth:`ModelShape.worker_weight_budget` of its
    ``memory_bytes`` (its activations kept out).
    ``coordinator_budget``: bytes of FFN weights the coordinator can keep besides
    what only it holds, its KV cache and activations (None: unbounded, it holds the whole
    model; :meth:`ModelShape.coordinator_weight_budget` of its allowance). What no peer can
    hold within its budget goes to the coordinator anyway, which reads it from its
    model file; ``plan.streamed_bytes`` says how many bytes that is.
    ``layers``: the layers whose FFN is cut (None: every layer); each other layer is the
    coordinator's whole and uncounted in its budget — a mix runs those as whole-layer stages on
    other peers, and here (from the mapped file) only after a stage fails.
    """
    if layers is not None:
        cut, full = set(layers), shape
        whole = dataclasses.replace(shape, moe_layers=tuple(i for i in shape.moe_layers if i not in cut),
                                    dense_layers=tuple(i for i in shape.dense_layers if i not in cut))
        shape = dataclasses.replace(shape, moe_layers=tuple(i for i in shape.moe_layers if i in cut),
                                    dense_layers=tuple(i for i in shape.dense_layers if i in cut))
        plan = build_plan(shape, coordinator, workers, term=term, version=version,
                          coordinator_share=coordinator_share, coordinator_budget=coordinator_budget)
        c = coordinator.peer_id
        experts = {**plan.experts, **{i: (Span(c, 0, shape.n_experts),) for i in whole.moe_layers if shape.n_experts}}
        dense = {**plan.dense, **{i: (Span(c, 0, shape.intermediate_size),) for i in whole.dense_layers
                                  if shape.intermediate_size}}
        plan = dataclasses.replace(plan, experts=dict(sorted(experts.items())), dense=dict(sorted(dense.items())))
        check_plan(plan, full)
        return plan
    workers = sorted((w for w in workers if w.peer_id != coordinator.peer_id), key=lambda w: w.peer_id)
    cap_of = {w.peer_id: w for w in workers}
    peers = (coordinator.peer_id, *(w.peer_id for w in workers))
    c_budget = math.inf if coordinator_budget is None else max(int(coordinator_budget), 0)
    weights = {coordinator.peer_id: max(coordinator.ffn_speed, 1e-9) * coordinator_share}
    caps = {coordinator.peer_id: c_budget / shape.ffn_bytes() if shape.ffn_bytes() else math.inf}
    held_max = {w.peer_id: shape.worker_weight_budget(w.memory_bytes) for w in workers}
    for w in workers:
        usable = w.ffn_speed > 0 and w.rtt_s <= MAX_RTT_S and held_max[w.peer_id] > 0
        weights[w.peer_id] = w.ffn_speed if usable else 0.0
        total = shape.ffn_bytes(w.kind)
        caps[w.peer_id] = held_max[w.peer_id] / total if total else 0.0
    share = _shares(weights, caps)
    share[coordinator.peer_id] += max(1.0 - sum(share.values()), 0.0)  # what nobody can hold
    budget = {coordinator.peer_id: c_budget, **held_max}
    used = {p: 0 for p in peers}

    def spans_for(width: int, column: bool, layers: Sequence[int]) -> dict:
        unit = {p: shape.unit_bytes(cap_of[p].kind if p in cap_of else "python")[column] for p in peers}

        def room(p: str) -> int:
            if not unit[p] or budget[p] == math.inf:
                return width  # unbounded: all of a layer
            return max(int((budget[p] - used[p]) // unit[p]), 0)

        table = {}
        for layer in layers:
            counts = _cut(width, peers, share, layer)
            # Rounding may push a worker past its budget: hand those units to the coordinator.
            for i, p in enumerate(peers[1:], start=1):
                if counts[i] > room(p):
                    counts[0] += counts[i] - room(p)
                    counts[i] = room(p)
            # ... and the coordinator past its own: to workers with room left, if any.
            over = counts[0] - room(peers[0])
            for i, p in enumerate(peers[1:], start=1):
                if over <= 0:
                    break
                if weights[p] > 0:
                    take = min(over, room(p) - counts[i])
                    if take > 0:
                        counts[i] += take
                        counts[0] -= take
                        over -= take
            for p, c in zip(peers, counts):
                used[p] += c * unit[p]
            spans, at = [], 0
            for p, c in zip(peers, counts):
                if c:
                    spans.append(Span(p, at, at + c))
                    at += c
            table[layer] = tuple(spans)
        return table

    experts = spans_for(shape.n_experts, False, shape.moe_layers) if shape.n_experts else {}
    dense = spans_for(shape.intermediate_size, True, shape.dense_layers) if shape.intermediate_size else {}
    streamed = 0 if coordinator_budget is None else max(used[coordinator.peer_id] - c_budget, 0)
    plan = Plan(version, term, coordinator.peer_id, peers, experts, dense, streamed_bytes=int(streamed))
    check_plan(plan, shape)
    return plan


def shortfall(plan: Plan, shape: ModelShape, read_bytes_per_s: float | None = None,
              coordinator_allowance: int | None = None, worker_stages: int = 0,
              kv_layers: int | None = None, not_run_bytes: int = 0) -> dict | None:
    """What the swarm lacks to hold ``plan`` in memory, and the speed to expect; None when
    nothing is missing. ``coordinator_over_bytes``: how far
    :meth:`ModelShape.coordinator_fixed_bytes` (``worker_stages``, ``kv_layers``,
    ``not_run_bytes``) exceeds its ``coordinator_allowance`` (0 when not given or within). Bytes: ``missing_bytes`` (the coordinator's spans beyond its budget, read
    from its model file), ``held_bytes`` and ``ffn_bytes`` (of every expert and MLP);
    ``read_bytes_per_token``: what one decode token reads of the missing part (a routed expert is
    used by ``top_k / n_experts`` of the tokens, a dense column by every one);
    ``read_bytes_per_s``: the model file's read rate past the page cache (``read_bytes_per_s``,
    else :func:`swarm.peer.memory.read_rate`: measured at start, or an assumed disk) and
    ``measured``; ``s_per_token``: the least a decode token takes to read that (seconds);
    ``message``: all of it in words."""
    from swarm.peer import memory

    fixed = shape.coordinator_fixed_bytes(worker_stages, kv_layers, not_run_bytes)
    over = max(fixed - coordinator_allowance, 0) if coordinator_allowance is not None else 0
    if plan.streamed_bytes <= 0 and not over:
        return None
    total = shape.ffn_bytes()
    e, c = shape.unit_bytes()
    moe = len(shape.moe_layers) * shape.n_experts * e
    dense = len(shape.dense_layers) * shape.intermediate_size * c
    used = (shape.top_k / shape.n_experts if shape.n_experts and shape.top_k else 1.0)
    fraction = (moe * used + dense) / (moe + dense) if moe + dense else 1.0
    per_token = math.ceil(plan.streamed_bytes * fraction)
    rate, measured = (read_bytes_per_s, True) if read_bytes_per_s else memory.read_rate()
    s_token = per_token / rate
    gb = lambda n: f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"  # noqa: E731
    how = "measured" if measured else "assumed"
    message = "" if plan.streamed_bytes <= 0 else (f"the swarm's memory holds {gb(total - plan.streamed_bytes)} of the model's {gb(total)} of expert and "
               f"MLP weights: {gb(plan.streamed_bytes)} is missing, and the coordinator reads it from its model file "
               f"for every token that needs it: about {gb(per_token)} a token, at least {s_token:,.2f} s a token at "
               f"the {rate / 1e6:,.0f} MB/s its disk reads ({how}; less where the page cache keeps some). Add a peer "
               f"with at least {gb(plan.streamed_bytes)} free, raise a peer's --memory, or lower --context.")
    if over:
        message += (" " if message else "") + (f"The coordinator's own part (embeddings, attention, head, the KV cache of the layers it runs, activations: "
                    f"{gb(fixed)}) is {gb(over)} more than its memory allows: lower --context, or let a peer with "
                    "more memory coordinate.")
    return {"coordinator_over_bytes": int(over), "missing_bytes": int(plan.streamed_bytes), "held_bytes": int(total - plan.streamed_bytes),
            "ffn_bytes": int(total), "read_bytes_per_token": per_token, "read_bytes_per_s": rate,
            "measured": measured, "s_per_token": s_token, "message": message}


def shortfall_message(plan: Plan, shape: ModelShape, read_bytes_per_s: float | None = None) -> str | None:
    """:func:`shortfall`'s ``message``; None when nothing is streamed."""
    short = shortfall(plan, shape, read_bytes_per_s)
    return None if short is None else short["message"]
