"""RemoteFFN: same build, same plan, local vs swarm → bit-identical logits and tokens.

The swarm here is in-process (coordinator and workers each load their own copy of a tiny
transformers-built MoE checkpoint; messages go through the real wire codec on per-peer
threads). Faults are injected on the encoded frames: dropped, NaN, wrong shapes, stale
terms, lies — the tokens must not change, or ``--verify`` must stop the run.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time

import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN
from swarm.compute.model import load_model
from swarm.errors import VerificationError
from swarm.peer.net import messages as M
from swarm.peer.coordinator.dispatch import RemoteFFN
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.plan import ModelShape, Plan
from swarm.peer.weights.sizes import model_shape
from tests.fakes import LoopbackNet
from swarm.peer.worker.ffn import Worker
from tests.peer._swarm_models import COORD, FAMILIES, PROMPT, W1, W2, build, greedy

DECODE = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: build(family, root) for family in FAMILIES}


class InProcSwarm:
    """A coordinator and workers over a LoopbackNet; each peer loads its own model copy."""

    def __init__(self, path, n_workers: int, *, tamper=None, verify: float = 0.0, slow=None, unplanned=()):
        """``slow(peer, request)``: seconds that worker waits before answering (its compute thread
        busy or descheduled); ``unplanned``: workers the first plan never reaches."""
        self.model = load_model(path)
        self.shape = ModelShape.from_config(self.model.config)
        self.ids = [W1, W2][:n_workers]
        self.plan = build_plan(self.shape, PeerCapacity(COORD, 0, 1.0),
                               [PeerCapacity(w, 10**9, 1.0) for w in self.ids], term=1, version=1)
        self.net = LoopbackNet(tamper)
        self.failed: list[tuple[str, str]] = []
        self.ffn = RemoteFFN(self.model, self.plan,
                             self.net.dispatcher(COORD, on_peer_failed=lambda p, r: self.failed.append((p, r))),
                             verify=verify, rng=random.Random(0))
        self.net.attach(COORD, self.ffn.deliver)
        self.net.on_peer_down(self.ffn.peer_down)
        self.workers = {w: Worker(w, self.shape, load_model(path)) for w in self.ids}
        self.slow = slow
        for w, worker in self.workers.items():
            self.net.attach(w, self._worker_handler(w, worker))
        self.announce(self.plan, [w for w in self.ids if w not in unplanned])

    def _worker_handler(self, w, worker):
        def handle(src, msg):
            match msg:
                case M.PlanMessage():
                    worker.accept_plan(Plan.from_message(msg, src, self.shape))
                case M.ExpertRequest() | M.DenseRequest():
                    if self.slow is not None:
                        time.sleep(self.slow(w, msg))
                    self.net.send(w, src, worker.handle(msg))
        return handle

    def announce(self, plan: Plan, to=None) -> None:
        """Send the plan to every worker (or those of ``to``), ordered before any request that uses it."""
        for w in self.ids if to is None else to:
            try:
                self.net.send(COORD, w, plan.to_message())
            except ConnectionError:
                pass

    def close(self):
        self.net.close()


def local_reference(swarm: InProcSwarm, n: int = DECODE):
    model = load_model(swarm.model.path)
    return greedy(model, LocalFFN(model, swarm.plan.dense_ranges()), n=n)


class SwitchingLocalFFN:
    """The local oracle for a run whose plan changed: LocalFFN under ``plans[i]`` from forward
    ``starts[i]`` on (the dense ranges, and so the sum order, follow the plan)."""

    def __init__(self, model, starts, plans):
        self.backends = [(s, LocalFFN(model, p.dense_ranges())) for s, p in zip(starts, plans)]
        self.forwards = -1

    def ffn(self, layer, x):
        self.forwards += layer == 0
        backend = [b for s, b in self.backends if s <= self.forwards][-1]
        return backend.ffn(layer, x)


def assert_same(a, b):
    (ta, la), (tb, lb) = a, b
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype == np.float32 and np.array_equal(x, y), float(np.max(np.abs(x - y)))


@pytest.mark.parametrize("n_workers", [1, 2], ids=["2-peers", "3-peers"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swarm_is_bit_identical_to_local_with_the_same_plan(checkpoints, family, n_workers):
    swarm = InProcSwarm(checkpoints[family], n_workers)
    try:
        got = greedy(swarm.model, swarm.ffn)
        assert_same(got, local_reference(swarm))
        assert not swarm.failed and swarm.ffn.local_fallbacks == 0
        for w, worker in swarm.workers.items():
            assert worker.served > 0, f"worker {w} got no work"
        if swarm.shape.dense_layers:
            assert any(s.peer != COORD for spans in swarm.plan.dense.values() for s in spans)
    finally:
        swarm.close()


def rewrite_answers(peer, edit):
    """A tamper hook that decodes answers from ``peer``, applies ``edit`` and re-encodes."""
    def tamper(src, dst, data):
        if src != peer:
            return data
        msg = M.decode(data)
        if isinstance(msg, (M.ExpertAnswer, M.DenseAnswer)):
            out = edit(msg)
            return None if out is None else (out if isinstance(out, bytes) else M.encode(out))
        return data
    return tamper


def _field(msg):
    return "outputs" if isinstance(msg, M.ExpertAnswer) else "partials"


def nan_rows(msg):
    a = np.array(getattr(msg, _field(msg)))
    a.reshape(-1)[0] = np.nan
    return _replace(msg, a)


def wrong_shape(msg):
    a = np.array(getattr(msg, _field(msg)))
    return _replace(msg, a[..., :-1].copy())


def wrong_layer(msg):
    return type(msg)(**{**_fields(msg), "layer": msg.layer + 1})


def drop(msg):
    return None


def garbage(msg):
    return b"CLSW" + bytes(40)


def _fields(msg):
    return {f: getattr(msg, f) for f in msg.__dataclass_fields__}


def _replace(msg, a):
    return type(msg)(**{**_fields(msg), _field(msg): a})


@pytest.mark.parametrize("edit", [nan_rows, wrong_shape, wrong_layer, garbage, drop])
def test_bad_answers_are_recomputed_and_tokens_do_not_change(checkpoints, edit, monkeypatch):
    import swarm.peer.coordinator.tracker as C

    monkeypatch.setattr(C, "FIRST_DEADLINE_S", 0.5)  # a dropped answer is declared lost quickly
    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, tamper=rewrite_answers(W1, edit))
    try:
        assert_same(greedy(swarm.model, swarm.ffn), local_reference(swarm))
        assert [p for p, _ in swarm.failed] == [W1]
        assert swarm.workers[W2].served > 0
    finally:
        swarm.close()


def test_killed_worker_mid_generation_then_plan_rebuilt(checkpoints):
    swarm = InProcSwarm(checkpoints["qwen2_moe"], 2)
    rebuilt: list[Plan] = []

    def on_failed(peer, reason):
        swarm.failed.append((peer, reason))
        # What the coordinator's owner does: a new plan without the lost peer, for the next step.
        plan = build_plan(swarm.shape, PeerCapacity(COORD, 0, 1.0),
                          [PeerCapacity(w, 10**9, 1.0) for w in swarm.ids if w != peer],
                          term=1, version=swarm.ffn.plan.version + 1)
        swarm.announce(plan)
        swarm.ffn.set_plan(plan)
        rebuilt.append(plan)

    swarm.ffn.dispatcher.on_peer_failed = on_failed
    served_before = {}

    def on_step(step):
        if step == 5:
            served_before.update({w: x.served for w, x in swarm.workers.items()})
            swarm.net.kill(W2)

    try:
        got = greedy(swarm.model, swarm.ffn, on_step=on_step)
        # Forward 0 is the prefill; the kill lands in forward 6 (decode step 5), which ends under
        # the old plan with W2's rows recomputed; the new plan starts with forward 7.
        model = load_model(swarm.model.path)
        ref = greedy(model, SwitchingLocalFFN(model, [0, 7], [swarm.plan, rebuilt[0]]))
        assert_same(got, ref)
        assert got[0] == local_reference(swarm)[0]  # and the tokens are those of the unchanged plan
        assert [p for p, _ in swarm.failed] == [W2] and len(rebuilt) == 1
        assert swarm.ffn.plan is rebuilt[0] and W2 not in swarm.ffn.plan.peers
        assert swarm.workers[W1].served > served_before[W1]  # the survivor kept working
    finally:
        swarm.close()


@pytest.mark.parametrize("left", [True, False], ids=["left", "lost"])
def test_a_worker_that_leaves_mid_generation_is_no_fault_and_one_lost_is(checkpoints, caplog, left):
    """A worker that closes its link (it leaves: Ctrl-C, SIGTERM) gets no more work and its rows
    are recomputed, as a lost one's are, but it did not fail: no warning, no failure counted, the
    owner not told to mark it down (it re-plans on the link's close). Once a leave was logged as
    a lost peer's fault ("marked down: send failed: no link")."""
    swarm = InProcSwarm(checkpoints["qwen2_moe"], 2)
    served: dict[str, int] = {}

    def on_step(step):
        if step == 5:
            served.update({w: x.served for w, x in swarm.workers.items()})
            swarm.net.kill(W2, left=left)

    try:
        with caplog.at_level(logging.INFO, logger="swarm.peer.coordinator"):
            got = greedy(swarm.model, swarm.ffn, on_step=on_step)
        assert got[0] == local_reference(swarm)[0]
        assert swarm.workers[W2].served == served[W2] and swarm.workers[W1].served > served[W1]
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        failures = swarm.ffn.tracker.of(W2).failures
        if left:
            assert swarm.failed == [] and warnings == [] and failures == 0
            assert W2 not in swarm.ffn.tracker.observations().failed  # status: not "marked down"
        else:
            assert [p for p, _ in swarm.failed] == [W2] and failures >= 1
            assert len(warnings) == 1 and f"peer {W2} marked down: " in warnings[0]
    finally:
        swarm.close()


def test_verify_stops_on_a_lying_worker(checkpoints):
    def lie(msg):
        a = np.array(getattr(msg, _field(msg)))
        a.reshape(-1)[0] += np.float32(1e-3)  # finite, plausible, wrong
        return _replace(msg, a)

    swarm = InProcSwarm(checkpoints["mixtral"], 1, tamper=rewrite_answers(W1, lie), verify=1.0)
    try:
        with pytest.raises(VerificationError, match=f"peer {W1} answered layer"):
            greedy(swarm.model, swarm.ffn)
    finally:
        swarm.close()
    # Without --verify the lie goes through: the oracle sees different numbers.
    swarm = InProcSwarm(checkpoints["mixtral"], 1, tamper=rewrite_answers(W1, lie))
    try:
        _, got = greedy(swarm.model, swarm.ffn, n=1)
        _, ref = local_reference(swarm, n=1)
        assert not np.array_equal(got[0], ref[0])
    finally:
        swarm.close()


def test_verify_passes_honest_workers(checkpoints):
    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, verify=1.0)
    try:
        assert_same(greedy(swarm.model, swarm.ffn, n=3), local_reference(swarm, n=3))
        assert swarm.ffn.verified > 0
    finally:
        swarm.close()


def test_all_requests_are_sent_before_any_answer_is_awaited(checkpoints):
    # Hold every answer until both workers have received their request of the layer.
    seen, gate = set(), threading.Event()

    def tamper(src, dst, data):
        msg = M.decode(data)
        if isinstance(msg, M.ExpertRequest) and msg.layer == 0:
            seen.add(dst)
            if seen == {W1, W2}:
                gate.set()
        if isinstance(msg, M.ExpertAnswer) and msg.layer == 0:
            assert gate.wait(5.0), "an answer was awaited before every request of the layer was sent"
        return data

    swarm = InProcSwarm(checkpoints["olmoe"], 2, tamper=tamper)
    try:
        swarm.model.forward(PROMPT, swarm.model.new_cache(), ffn=swarm.ffn)
        assert gate.is_set() and not swarm.failed
    finally:
        swarm.close()


def test_layers_the_plan_leaves_wholly_here_run_as_the_local_engine_and_send_nothing(checkpoints):
    """Under a plan that leaves every layer's FFN to the coordinator (the coordinator alone, as
    the planner often picks, or its own stage), RemoteFFN runs each layer as LocalFFN does — not
    through the per-expert dispatch path — sends nothing, and gives LocalFFN's bits; the next
    plan that gives a worker a share goes through dispatch again."""
    sent = []

    def tamper(src, dst, data):
        msg = M.decode(data)
        if isinstance(msg, (M.ExpertRequest, M.DenseRequest)):
            sent.append(msg.layer)
        return data

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 1, tamper=tamper)  # an expert layer and a dense one
    model, ffn = swarm.model, swarm.ffn
    dispatched = []
    for name in ("_moe", "_dense"):
        inner = getattr(ffn, name)
        setattr(ffn, name, lambda layer, *a, inner=inner: dispatched.append(layer) or inner(layer, *a))
    try:
        alone = build_plan(swarm.shape, PeerCapacity(COORD, 0, 1.0), [], term=1, version=2)
        ffn.set_plan(alone)
        ours = model.forward(PROMPT, model.new_cache(), ffn=ffn)
        local = model.forward(PROMPT, model.new_cache(), ffn=LocalFFN(model))
        assert np.array_equal(ours, local) and not sent and not dispatched
        ffn.set_plan(swarm.plan)
        swarm.announce(swarm.plan)
        model.forward(PROMPT, model.new_cache(), ffn=ffn)
        layers = set(range(model.config.n_layers))
        assert set(sent) == layers and set(dispatched) == layers and not swarm.failed
    finally:
        swarm.close()


SMOL_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.mark.slow
def test_smollm2_dense_ranges_on_two_peers(monkeypatch):
    """The real SmolLM2 GGUF with every dense MLP split over 2 peers: the same greedy tokens as
    the unsplit engine on 3 chat prompts, logits within 1e-4 (+1e-5 relative) — and
    bit-identical to LocalFFN under the same plan."""
    # Every answer must come from the worker: deadlines long enough for a loaded shared machine.
    monkeypatch.setattr("swarm.peer.coordinator.tracker.DEADLINE_MIN_S", 30.0)
    from swarm.compute.default_model import default_model_path
    from swarm.compute.tokenizer import tokenizer_for

    path = default_model_path()
    model = load_model(path)  # the coordinator's (and the local reference's) copy
    tok = tokenizer_for(model)
    shape = ModelShape.from_config(model.config)
    assert not shape.moe_layers and len(shape.dense_layers) == 30
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=1, version=1,
                      coordinator_share=1.0)
    net = LoopbackNet()
    ffn = RemoteFFN(model, plan, net.dispatcher(COORD))
    net.attach(COORD, ffn.deliver)
    worker = Worker(W1, shape, load_model(path))  # the worker's own copy: only its slices are decoded
    worker.accept_plan(plan)
    net.attach(W1, lambda src, msg: net.send(W1, src, worker.handle(msg)))
    same_plan, unsplit = LocalFFN(model, plan.dense_ranges()), LocalFFN(model)
    try:
        for i, text in enumerate(SMOL_PROMPTS):
            ids = tok.encode_chat([{"role": "user", "content": text}])
            swarm = greedy(model, ffn, ids, n=8)
            if i == 0:
                assert_same(swarm, greedy(model, same_plan, ids, n=8))
            toks, logits = greedy(model, unsplit, ids, n=8)
            assert swarm[0] == toks
            for a, b in zip(swarm[1], logits):
                # two partial sums instead of one: float32 rounding, ~1e-4 on logits of ~15
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
        assert worker.served == 3 * 9 * 30 and ffn.local_fallbacks == 0
    finally:
        net.close()


@pytest.mark.parametrize("family,qtype", [("llama", "Q8_0"), ("qwen2_moe", "Q4_1")],
                         ids=["dense-Q8_0", "moe-Q4_1"])
def test_an_int8_swarm_gives_the_bits_of_the_local_int8_run_checked_bit_for_bit(family, qtype, tmp_path, monkeypatch):
    """Under the int8 numerics (coordinator and workers share this process's) a tiny dense model
    in Q8_0 and a MoE in Q4_1 over 3 peers give the logits of the local int8 run under the same
    plan bit for bit, every answer recomputed by the coordinator and found equal (--verify 100 %);
    and they are not float32's (the int8 kernels ran)."""
    import gguf

    from swarm.compute import numerics
    from tests.compute.tiny_gguf import write_gguf_from_hf
    from tests.compute.tiny_models import build_tiny

    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    hf, _ = build_tiny(family, tmp_path / family)
    path = write_gguf_from_hf(hf, family, tmp_path / f"{family}.gguf", qtype=gguf.GGMLQuantizationType[qtype])
    numerics.set_numerics("int8")
    swarm = InProcSwarm(path, 2, verify=1.0)
    try:
        got = greedy(swarm.model, swarm.ffn, n=4)
        assert_same(got, local_reference(swarm, n=4))
        assert not swarm.failed and swarm.ffn.local_fallbacks == 0 and swarm.ffn.verified > 0
        assert all(worker.served > 0 for worker in swarm.workers.values())
        numerics.set_numerics("float32")
        _, f32 = local_reference(swarm, n=4)
        assert not np.array_equal(got[1][0], f32[0])
        assert np.abs(got[1][0] - f32[0]).max() < 0.1 * np.abs(f32[0]).max()  # the same model, int8 rounding
    finally:
        swarm.close()


def test_a_warming_peer_is_recomputed_without_being_marked_failed(checkpoints):
    # A peer still installing its slices answers Error: within its warm-up window its rows are
    # recomputed here and it keeps its place; afterwards an Error marks it failed as usual.
    ready = threading.Event()

    def not_ready_yet(src, dst, data):
        msg = M.decode(data)
        if src == W1 and isinstance(msg, (M.ExpertAnswer, M.DenseAnswer)) and not ready.is_set():
            return M.encode(M.Error(msg.request_id, "bad_request", "this peer holds no weights for that yet"))
        return data

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, tamper=not_ready_yet)
    try:
        swarm.ffn.set_plan(swarm.plan, warming={W1: 60.0})
        assert_same(greedy(swarm.model, swarm.ffn, n=2), local_reference(swarm, n=2))
        assert not swarm.failed and swarm.ffn.local_fallbacks > 0 and W1 in swarm.ffn.plan.workers()
        ready.set()
        before = swarm.workers[W1].served
        greedy(swarm.model, swarm.ffn, n=1)
        assert swarm.workers[W1].served > before  # in use once ready
        ready.clear()
        swarm.ffn.warm({W1: 0.0})  # window over
        assert_same(greedy(swarm.model, swarm.ffn, n=2), local_reference(swarm, n=2))
        assert [p for p, _ in swarm.failed] == [W1]
    finally:
        swarm.close()


def test_verify_tolerates_float_reassociation_only_for_approximate_peers(checkpoints):
    def nudge(msg):
        a = np.array(getattr(msg, _field(msg)))
        a *= np.float32(1 + 1e-6)  # what another float32 kernel may give: same up to rounding
        return _replace(msg, a)

    swarm = InProcSwarm(checkpoints["mixtral"], 1, tamper=rewrite_answers(W1, nudge), verify=1.0)
    try:
        swarm.ffn.set_approximate({W1})
        tokens, _ = greedy(swarm.model, swarm.ffn, n=3)
        assert tokens == local_reference(swarm, n=3)[0] and swarm.ffn.verified > 0
        swarm.ffn.set_approximate(set())  # a peer of our own build must match bit for bit
        with pytest.raises(VerificationError):
            greedy(swarm.model, swarm.ffn, n=1)
    finally:
        swarm.close()


def _mapped_rss(path) -> int:
    """Bytes of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    import re

    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.slow
def test_a_killed_workers_experts_are_read_from_the_file_and_not_kept(tmp_path):
    """The coordinator holds its budgeted share; when the worker holding the rest dies, its rows
    are recomputed from the coordinator's mapped file (same bits as the local run) and those
    experts' pages leave the coordinator's resident set again."""
    from tests.multihost.test_capacity import random_moe_gguf

    path = random_moe_gguf(tmp_path / "moe.gguf", layers=2, hidden=256, experts=32, top_k=8, expert_ffn=512,
                           heads=4, kv_heads=2)
    model = load_model(path)
    shape = model_shape(model)
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=1, version=1,
                      coordinator_budget=4 * shape.expert_bytes)  # its speed would earn it 1/3: the budget wins
    assert plan.bytes_of(COORD, shape) <= 4 * shape.expert_bytes and plan.streamed_bytes == 0
    net = LoopbackNet()
    failed = []
    ffn = RemoteFFN(model, plan, net.dispatcher(COORD, on_peer_failed=lambda p, r: failed.append(p)))
    net.attach(COORD, ffn.deliver)
    net.on_peer_down(ffn.peer_down)
    own = tmp_path / "worker.gguf"  # the worker's own copy: its pages are not the coordinator's
    shutil.copy(path, own)
    worker = Worker(W1, shape, load_model(own))
    worker.accept_plan(plan)
    net.attach(W1, lambda src, msg: net.send(W1, src, worker.handle(msg)))
    try:
        ids = list(range(3, 40))
        cache = model.new_cache()
        model.forward(ids[:20], cache, ffn)  # the worker answers: the coordinator reads its own share only
        served = worker.served
        held = _mapped_rss(path)
        net.kill(W1)
        ffn.peer_down(W1)
        got = model.forward(ids[20:], cache, ffn)
        assert failed == [W1] and ffn.local_fallbacks > 0 and worker.served == served
        # The worker's share (~21 MiB; 17 tokens × top-8 route to nearly all of it) was read from
        # the file and given back; what stays is the kernel's fault-around of neighbouring pages.
        grew = _mapped_rss(path) - held
        assert grew < 0.4 * plan.bytes_of(W1, shape), (grew, plan.bytes_of(W1, shape))
        local = load_model(path)
        want = local.forward(ids[20:], _prefilled(local, ids[:20]), LocalFFN(local))
        assert np.array_equal(got, want)
    finally:
        net.close()


def _prefilled(model, ids):
    cache = model.new_cache()
    model.forward(ids, cache, LocalFFN(model))
    return cache


def test_a_changed_share_gets_the_first_request_deadline_again():
    """A worker whose share changed loads new slices before its first answer: that request gets
    FIRST_DEADLINE_S, and its time is not taken as the peer's compute speed."""
    from swarm.peer.coordinator.dispatch import _share
    from swarm.peer.coordinator.tracker import FIRST_DEADLINE_S, PeerTiming

    t = PeerTiming(rtt_s=0.001)
    assert t.deadline_s(8) == FIRST_DEADLINE_S
    t.observe(0.021, 10)  # first answer ever: ~2 ms per row
    t.observe(0.021, 10)
    quick = t.deadline_s(10)
    assert quick < 1.0
    t.fresh = True  # what RemoteFFN sets when a new plan changes this peer's spans
    assert t.deadline_s(10) == FIRST_DEADLINE_S
    t.observe(5.0, 10)  # loading its new slices took seconds: not its compute speed
    assert t.deadline_s(10) == pytest.approx(quick)

    shape = ModelShape(8, 16, 4, 0, (0,), ())
    a = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0), PeerCapacity(W2, 10**9, 1.0)],
                   term=1, version=1)
    b = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=1, version=2)
    assert _share(a, W1) != _share(b, W1) and _share(b, W2) == set()


@pytest.mark.slow
def test_experts_beyond_the_coordinators_budget_are_streamed_not_kept(tmp_path, monkeypatch):
    """A swarm too small for the model: the coordinator computes the shortfall from its mapped
    file at each use, with the local run's bits, and its resident set stays near its budget."""
    monkeypatch.setattr("swarm.peer.coordinator.tracker.DEADLINE_MIN_S", 30.0)  # a loaded machine: no missed answers
    from tests.multihost.test_capacity import random_moe_gguf

    path = random_moe_gguf(tmp_path / "moe.gguf", layers=2, hidden=256, experts=32, top_k=8, expert_ffn=1024,
                           heads=4, kv_heads=2)
    model = load_model(path)
    shape = model_shape(model)
    budget = 4 * shape.expert_bytes
    # The budget rule (docs/capacity.md): a range worker's weights get its allowance less one
    # step's activations: 192 rows × (8 hidden-wide copies + q/k/v + gate and up of the top 8
    # experts) × 4 bytes. An allowance of 8 experts plus those holds exactly 8 experts.
    acts = (128 + 64) * (8 * 256 + (4 + 2 * 2) * (256 // 4) + 2 * 8 * 1024) * 4
    assert shape.step_bytes == acts
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 8 * shape.expert_bytes + acts, 1.0)],
                      term=1, version=1, coordinator_budget=budget)
    # 2 layers × 32 experts: the worker holds 8, the coordinator keeps 4, it streams the other 52.
    assert plan.streamed_bytes == (2 * 32 - 8 - 4) * shape.expert_bytes
    own = tmp_path / "worker.gguf"
    shutil.copy(path, own)
    worker = Worker(W1, shape, load_model(own))
    worker.accept_plan(plan)
    net = LoopbackNet()
    ffn = RemoteFFN(model, plan, net.dispatcher(COORD))
    net.attach(COORD, ffn.deliver)
    net.attach(W1, lambda src, msg: net.send(W1, src, worker.handle(msg)))
    try:
        ids = list(range(3, 40))
        got = model.forward(ids, model.new_cache(), ffn)
        assert worker.served > 0 and ffn.local_fallbacks == 0
        # Without giving pages back the ~35 MiB streamed would stay resident on top of these.
        assert _mapped_rss(path) < shape.resident_nbytes + budget + 0.4 * plan.streamed_bytes
        local = load_model(own)
        assert np.array_equal(got, local.forward(ids, local.new_cache(), LocalFFN(local)))
    finally:
        net.close()


# ------------------------------------------------------------------ deadlines and plan hand-over
STEADY_DELAY_S = 0.6  # each answer of the slow worker: more than the old fixed deadline allowed


@pytest.mark.slow
def test_a_slow_but_steady_worker_is_never_marked_down(checkpoints):
    """Every answer of the worker comes STEADY_DELAY_S late (a busy machine): its deadline
    follows its observed answer times, so it keeps its share and its answers are used."""
    from swarm.peer.coordinator.dispatch import MISS_LIMIT

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 1, slow=lambda w, msg: STEADY_DELAY_S)
    try:
        assert_same(greedy(swarm.model, swarm.ffn, n=3), local_reference(swarm, n=3))
        t = swarm.ffn.timing[W1]
        assert not swarm.failed and swarm.ffn.failed == set()
        assert t.misses < MISS_LIMIT and swarm.ffn.remote_rows > 0
        assert t.deadline_s(1) > STEADY_DELAY_S  # learned, where a fixed 0.25 s floor was not
    finally:
        swarm.close()


def test_one_late_answer_is_recomputed_and_the_worker_kept(checkpoints):
    """One answer comes after its deadline (a scheduling hiccup): those rows are recomputed, the
    tokens do not change, the peer keeps its share, and the late answer's time is learned."""
    swarm = None
    seen = []

    def slow(w, msg):
        seen.append(msg.request_id)
        if len(seen) != 8:  # the 8th request: past the prefill, the deadline is a learned one
            return 0.0
        p = swarm.ffn.tracker.pending_of(msg.request_id)
        return p.deadline - p.sent_at + 0.2

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 1, slow=slow)
    try:
        assert_same(greedy(swarm.model, swarm.ffn, n=6), local_reference(swarm, n=6))
        assert not swarm.failed and swarm.ffn.local_fallbacks >= 1
        t0 = time.monotonic()
        while swarm.ffn.timing[W1].late < 1:  # the late answer is still timed when it comes
            assert time.monotonic() - t0 < 30, "the late answer was never timed"
            time.sleep(0.05)
        assert swarm.workers[W1].served == len(seen)
    finally:
        swarm.close()


@pytest.mark.parametrize("silent", [False, True], ids=["link-open", "link-silent"])
def test_a_worker_that_stops_answering_is_recomputed_within_the_bound(checkpoints, silent):
    """A worker stops answering at decode step 2 (hung: its link stays open). Its rows are
    recomputed, the tokens do not change, and it is marked down after MISS_LIMIT misses —
    at the first when its link is silent too — each wait within the deadline's ceiling."""
    from swarm.peer.coordinator.dispatch import MISS_LIMIT

    hung = threading.Event()
    tamper = rewrite_answers(W1, lambda msg: None if hung.is_set() else msg)
    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, tamper=tamper)
    if silent:
        swarm.ffn.dispatcher.heard = lambda p: time.monotonic() - (60.0 if p == W1 and hung.is_set() else 0.0)
    try:
        got = greedy(swarm.model, swarm.ffn, n=5, on_step=lambda step: step == 2 and hung.set())
        assert_same(got, local_reference(swarm, n=5))
        assert [p for p, _ in swarm.failed] == [W1]
        reason = swarm.failed[0][1]
        assert ("nothing heard" in reason) if silent else (f"{MISS_LIMIT} misses" in reason), reason
        missed = [p for p in swarm.ffn.tracker._late.values() if p.peer == W1]
        assert len(missed) == (1 if silent else MISS_LIMIT)
        t = swarm.ffn.timing[W1]
        for p in missed:  # no wait beyond the ceiling: the bound is MISS_LIMIT × ceiling
            assert p.deadline - p.sent_at <= t.ceiling_s(p.rows)
        assert swarm.workers[W2].served > 0 and W2 not in swarm.ffn.failed
    finally:
        swarm.close()


def test_a_worker_that_stops_answering_and_beating_costs_one_deadline_then_fails_by_silence(checkpoints):
    """At decode step 2 W1 stops answering and nothing more is heard from it (its process
    killed, its link not closed yet). After its first miss it is suspect: it is sent nothing
    and its rows are computed here at once — one wait, not MISS_LIMIT doubled ones, and no
    further miss counted — until it is marked down when its link has been silent SILENCE_S
    (its last contact set back that far at step 5). W2 keeps its share; tokens and logits
    are the local run's."""
    from swarm.peer.coordinator.tracker import SILENCE_S

    hung = threading.Event()
    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, tamper=rewrite_answers(W1, lambda m: None if hung.is_set() else m))
    heard, sent = {}, []  # heard: W1's last contact once it stopped (others: now)
    swarm.ffn.dispatcher.heard = lambda p: heard.get(p, time.monotonic())
    send = swarm.ffn.dispatcher.send
    swarm.ffn.dispatcher.send = lambda peer, msg: (sent.append((peer, hung.is_set())), send(peer, msg))[1]

    def on_step(step):
        if step == 2:
            heard[W1] = time.monotonic()
            hung.set()
        if step == 5:
            heard[W1] = time.monotonic() - SILENCE_S - 1.0

    try:
        got = greedy(swarm.model, swarm.ffn, n=8, on_step=on_step)
        assert_same(got, local_reference(swarm, n=8))
        assert sent.count((W1, True)) == 1  # the missed request; not one per doubled deadline
        assert sent.count((W2, True)) >= 6 * 2  # W2 still has its share in every layer it holds
        missed = [s for s in swarm.ffn.tracker._late.values() if s.peer == W1]
        assert len(missed) == 1 and swarm.ffn.timing[W1].misses == 1
        assert swarm.ffn.tracker.withheld >= 2  # steps 3 and 4 at least: computed here, not sent
        assert [p for p, _ in swarm.failed] == [W1] and "nothing heard" in swarm.failed[0][1], swarm.failed
        assert swarm.ffn.failed == {W1} and W2 not in swarm.ffn.failed
    finally:
        swarm.close()


def test_a_worker_that_has_not_the_plan_is_kept_and_sent_it_again(checkpoints, monkeypatch):
    """The plan never reached W1: its refusal (stale_term, no plan yet) is not a failure. Its
    rows are recomputed, it gets no more requests of that plan but a probe now and then, it is
    sent the plan again, and once it has it, it computes its share."""
    import swarm.peer.coordinator.tracker as C

    refusals, resent = [], []

    def count_refusals(src, dst, data):
        msg = M.decode(data)
        if src == W1 and isinstance(msg, M.Error):
            refusals.append(msg.code)
        return data

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 2, tamper=count_refusals, unplanned=(W1,))

    def send_again(peer, reason):  # what the coordinator's owner does
        resent.append((peer, reason))
        swarm.announce(swarm.ffn.plan, [peer])

    swarm.ffn.dispatcher.on_peer_not_ready = send_again
    try:
        monkeypatch.setattr(C, "NOT_READY_RETRY_S", 3600.0)  # no probe in this phase
        assert_same(greedy(swarm.model, swarm.ffn, n=3), local_reference(swarm, n=3))
        assert not swarm.failed and W1 in swarm.ffn.plan.workers()
        assert refusals == ["stale_term"] and [p for p, _ in resent] == [W1]  # held after one refusal
        assert "no plan yet" in resent[0][1]
        assert swarm.workers[W1].served == 0 and swarm.workers[W2].served > 0
        monkeypatch.setattr(C, "NOT_READY_RETRY_S", 0.0)  # the next request probes it
        swarm.ffn.not_ready[W1] = (*swarm.ffn.not_ready[W1][:2], 0.0)
        assert_same(greedy(swarm.model, swarm.ffn, n=3), local_reference(swarm, n=3))
        assert swarm.workers[W1].served > 0 and W1 not in swarm.ffn.not_ready and not swarm.failed
        assert refusals == ["stale_term"]  # the plan sent again was there before the probe
    finally:
        swarm.close()


def test_a_worker_that_links_anew_is_priced_by_its_new_hello_until_it_answers_again(checkpoints, tmp_path):
    """A peer that restarts (maybe on other hardware, or with other settings) links anew: the
    coordinator drops what its old answers showed of its speed, and the next plan prices it by its
    new hello until it answers again. Once its old speed stayed in every plan and in status."""
    import asyncio
    from types import SimpleNamespace

    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.coordinator.role import CoordinatorRole
    from swarm.peer.node import Node

    swarm = InProcSwarm(checkpoints["qwen3_moe"], 1)
    planning = Planning(swarm.model, model_shape(swarm.model), COORD, "stages")
    restarted = PeerCapacity(W1, 10**9, 1000.0, 0.002)  # its new hello: 1000 GFLOP/s

    def priced() -> dict:
        planning.new_plan(1, 10**9, 1.0, [restarted], {W1}, swarm.ffn.plan, swarm.ffn.tracker.observations())
        return next(p for p in planning.cost_report["peers"] if p["peer_id"] == W1)

    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json", model_hash="m" * 64, memory_budget=1 << 30, ffn_gflops=1.0)
    role = CoordinatorRole(node, None, SimpleNamespace(term=1))  # type: ignore[arg-type]

    async def link_up_again():
        role.start()
        role.ffn = swarm.ffn
        for callback in list(node.on_link_up):  # what the mesh does when the new link opens
            callback(SimpleNamespace(peer_id=W1, hello=None))
        await role.stop()

    try:
        swarm.ffn.set_rtt(W1, 1e-6)  # in process: an answer's time is all compute
        greedy(swarm.model, swarm.ffn, n=3)
        before = priced()
        assert before["observed"] and before["gflops"] != pytest.approx(1000.0)  # its answers, timed here
        asyncio.run(link_up_again())
        assert swarm.ffn.tracker.observations().of(W1).s_per_row is None
        after = priced()
        assert not after["observed"] and after["gflops"] == pytest.approx(1000.0)
        greedy(swarm.model, swarm.ffn, n=2)  # it answers again: observed again
        assert priced()["observed"]
    finally:
        swarm.close()
