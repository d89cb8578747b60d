"""Layer stages in process: the coordinator's StagedFFN against StageRunners answering from
their own copies of the model on other threads (the hand-off of a real link, without one).
The oracle is the local engine: a stage plan gives bit-identical logits; a stage lost at token
10 gives the same tokens; a stage that forgot a sequence is sent it again."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from swarm.compute.default_model import default_model_path
from swarm.compute.model import load_model
from swarm.errors import LocalProtocolError, MessageError
from swarm.peer.net import messages as m
from swarm.compute.serving import MAX_BATCH_LIMIT
from swarm.peer.coordinator.stages import StagedFFN
from swarm.peer.plan import INLINE_ROWS, Stage, StageLayout, split_layers
from swarm.peer.worker.stages import IN_FLIGHT_S, MAX_SEQUENCES, StageRunner
from tests.peer._swarm_models import COORD, PROMPT, W1, W2, build, greedy

MOE = "qwen3_moe"  # MoE layers 0 and 2, dense layer 1


class Hand:
    """Requests to StageRunners, answered on another thread (as an event loop would); ``down``
    peers refuse the hand-off as a closed link does."""

    def __init__(self, runners: dict[str, StageRunner]):
        self.runners, self.down, self.ffn, self.threads = runners, set(), None, []
        self.failed: list[tuple[str, str]] = []
        self.plans: list[tuple[str, int]] = []  # stage plans sent: (peer, version)
        self.lose_plans = 0  # this many stage plans are lost on the way

    def last_heard(self, peer: str) -> float | None:
        return None

    def peer_failed(self, peer: str, reason: str) -> None:
        self.failed.append((peer, reason))

    def peer_not_ready(self, peer: str, reason: str) -> None:
        pass

    def lead_state(self, term: int) -> bool | None:
        return True

    def send(self, peer: str, req: m.StageRequest | m.StagePlan) -> None:
        if peer in self.down:
            raise ConnectionError(f"no link to {peer}")
        if isinstance(req, m.StagePlan):  # accepted on arrival, as a worker's roles do
            self.plans.append((peer, req.version))
            if self.lose_plans:
                self.lose_plans -= 1
                return
            runner = self.runners[peer]
            runner.accept(StageLayout.from_message(req, COORD, runner.model.config.n_layers))
            return
        t = threading.Thread(target=lambda: self.ffn.deliver(peer, self.runners[peer].handle(req)))
        self.threads.append(t)
        t.start()

    def join(self):
        for t in self.threads:
            t.join(10)


def staged(path, stages: tuple[Stage, ...]) -> tuple[object, StagedFFN, Hand, dict[str, StageRunner]]:
    layout = StageLayout(1, 1, COORD, stages)
    runners = {p: StageRunner(p, load_model(path)) for p in layout.workers()}  # each its own copy
    for r in runners.values():
        r.accept(layout)
    hand = Hand(runners)
    model = load_model(path)
    hand.ffn = StagedFFN(model, layout, hand)
    return model, hand.ffn, hand, runners


def assert_same_run(run, ref):
    assert run[0] == ref[0]
    for a, b in zip(run[1], ref[1], strict=True):
        assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build(MOE, tmp_path_factory.mktemp("stages"))


@pytest.mark.parametrize("stages", [
    (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3)),
    (Stage(W1, 0, 2), Stage(COORD, 2, 3)),
    (Stage(W1, 0, 3),),
], ids=["three", "worker-first", "all-remote"])
def test_a_moe_stage_plan_gives_the_local_bits(moe_dir, stages):
    model, ffn, hand, runners = staged(moe_dir, stages)
    run = greedy(model, ffn)
    hand.join()
    assert_same_run(run, greedy(load_model(moe_dir), None))
    assert ffn.remote_steps == 13 * len([s for s in stages if s.peer != COORD]) and not ffn.failed
    assert all(r.served == 13 for r in runners.values())


def greedy_together(model, ffn, prompts, n, on_step=None):
    """Sequence i joins at step i (its prefill beside the others' decode rows) and takes n greedy
    decode steps, all in shared ``forward_batch`` steps; returns (tokens, logits) per sequence."""
    caches = [model.new_cache() for _ in prompts]
    feed = [list(p) for p in prompts]
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(n + len(prompts)):
        if on_step:
            on_step(step)
        active = [i for i in range(len(prompts)) if i <= step <= i + n]
        for i, row in zip(active, model.forward_batch([(feed[i], caches[i]) for i in active], ffn=ffn)):
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
            feed[i] = [tokens[i][-1]]
    return tokens, logits


def greedy_alone(model, prompt, n):
    """The oracle of :func:`greedy_together`: one sequence, ``Model.forward`` with the local FFN."""
    cache, feed, tokens, logits = model.new_cache(), list(prompt), [], []
    for _ in range(n + 1):
        logits.append(model.forward(feed, cache, last_only=True)[0])
        tokens.append(int(np.argmax(logits[-1])))
        feed = [tokens[-1]]
    return tokens, logits


PROMPTS = [PROMPT, PROMPT[3:8], [9, 2, 77, 5, 31, 60, 12, 8, 4, 50, 21, 11, 70]]


@pytest.mark.parametrize("replan", [False, True], ids=["one-layout", "re-planned-same-stages"])
def test_sequences_batched_through_stages_cross_each_stage_in_one_request_with_their_solo_bits(moe_dir, replan):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3)))
    ffn.pipeline_groups = 1  # the step's sequences as one group (pipelined: test_stages_pipeline.py)
    sent = []
    send = hand.send
    hand.send = lambda peer, req: (sent.append((peer, [s.sequence for s in req.segments])), send(peer, req))

    def on_step(step):  # a re-plan that moves nothing: the later sequences start under a new version
        if replan and step == 1:
            new = StageLayout(1, 2, COORD, ffn.layout.stages)
            for r in runners.values():
                r.accept(new)
            ffn.set_layout(new)

    tokens, logits = greedy_together(model, ffn, PROMPTS, 6, on_step)
    hand.join()
    ref_model = load_model(moe_dir)
    for i, prompt in enumerate(PROMPTS):
        ref = greedy_alone(ref_model, prompt, 6)
        assert tokens[i] == ref[0]
        assert all(np.array_equal(a, b) for a, b in zip(logits[i], ref[1], strict=True))
    steps = 6 + len(PROMPTS)
    assert all(r.served == steps for r in runners.values())  # one request per stage peer per step
    # the planner's inputs: each peer's compute as its answers report it, the wait beyond it
    assert all(ffn.layer_timing[p].s_per_row_layer > 0 and ffn.message_overhead[p] >= 0 for p in (W1, W2))
    assert [len(ids) for p, ids in sent if p == W1] == [1, 2, 3, 3, 3, 3, 3, 2, 1]


def test_smollm2_over_two_stages_gives_the_local_bits():
    path = default_model_path()
    n = load_model(path).config.n_layers
    model, ffn, hand, _ = staged(path, (Stage(COORD, 0, n // 2), Stage(W1, n // 2, n)))
    prompt = [1, 504, 3458, 314, 253, 1345, 30]
    run = greedy(model, ffn, prompt, 6)
    hand.join()
    assert_same_run(run, greedy(load_model(path), None, prompt, 6))


def test_a_stage_lost_at_token_10_moves_to_the_coordinator_with_the_same_tokens(moe_dir):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 2), Stage(W2, 2, 3)))
    failed = hand.failed

    def on_step(step):
        if step == 10:
            hand.down.add(W2)

    run = greedy(model, ffn, PROMPT, 14, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 14)
    assert run[0] == ref[0]
    assert [p for p, _ in failed] == [W2] and "no link" in failed[0][1]
    # its KV cache was rebuilt here from the rows that had entered it: prompt + 10 tokens
    assert ffn.rebuilt_positions == len(PROMPT) + 10
    assert runners[W2].served == 11 and runners[W1].served == 15


def test_a_late_stage_fails_over_too(moe_dir):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 2), Stage(W1, 2, 3)))
    hand.send = lambda peer, req: None  # the request is sent, and no answer ever comes
    ffn.set_rtt(W1, 0.001)
    ffn.timing[W1].s_per_row = 1e-4  # as after earlier answers of its stage: a short deadline
    ffn.timing[W1].fresh = False
    ffn.warm[W1] = {(2, 3)}
    run = greedy(model, ffn, PROMPT, 3)
    assert_same_run(run, greedy(load_model(moe_dir), None, PROMPT, 3))
    assert ffn.failed == {W1} and ffn.timing[W1].failures == 1


def test_a_stage_that_misses_a_deadline_is_kept_and_sent_the_rows_it_missed(moe_dir):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    send, sent = hand.send, []

    def lossy(peer, req):
        sent.append((req.segments[0].start, req.x.shape[0]))
        if len(sent) in (4, 8):  # the requests of decode steps 3 and 7 are lost
            return
        send(peer, req)

    hand.send = lossy
    ffn.set_rtt(W1, 0.001)

    def on_step(step):
        if step == 1:  # as after earlier answers: a short deadline
            hand.join()
            ffn.timing[W1].s_per_row = 1e-4

    run = greedy(model, ffn, PROMPT, 10, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 10)
    assert run[0] == ref[0]
    # each miss: that step ran here (its cache rebuilt), the next one re-sent the missed row
    assert ffn.misses == 2 and not ffn.failed and ffn.timing[W1].misses == 0 and not hand.failed
    n = len(PROMPT)
    assert sent[3:5] == [(n + 2, 1), (n + 2, 2)] and sent[7:9] == [(n + 6, 1), (n + 6, 2)]
    assert runners[W1].served == 9 and ffn.rebuilt_positions > 0


@pytest.mark.parametrize("lost", [0, 1])
def test_a_stage_peer_without_the_layout_is_not_ready_then_serves_again(moe_dir, lost):
    layout = StageLayout(1, 1, COORD, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    runner = StageRunner(W1, load_model(moe_dir))  # it never got the stage plan (lost, restarted)
    hand = Hand({W1: runner})
    hand.lose_plans = lost  # the plan sent again may be lost too: each refused probe re-sends it
    now = [0.0]
    model = load_model(moe_dir)
    hand.ffn = ffn = StagedFFN(model, layout, hand, clock=lambda: now[0])

    def on_step(step):
        now[0] += 0.125  # a probe every NOT_READY_RETRY_S = 0.5 s: every 4th step

    run = greedy(model, ffn, PROMPT, 10, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 10)
    assert run[0] == ref[0]
    # refused the prefill, was sent the plan, got its layers back at the first probe 0.5 s later
    # (with the plan lost: refused that probe too, was sent the plan again, back 0.5 s later still)
    assert hand.plans == [(W1, 1)] * (1 + lost) and not ffn.failed and not hand.failed and not ffn.not_ready
    assert runner.served == 7 - 4 * lost


def test_a_stage_keeps_keys_and_values_of_its_own_layers_only_and_runs_short_steps_inline(moe_dir):
    model = load_model(moe_dir)
    c = model.config
    layout = StageLayout(1, 1, COORD, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    runner = StageRunner(W1, model)
    runner.accept(layout)
    req = lambda start, rows: m.StageRequest(5, 1, 1, (m.StageSegment(7, start, rows),), 1, 3,  # noqa: E731
                                             np.ones((rows, c.hidden_size), np.float32))
    assert not runner.take_inline(req(0, 1))  # not timed yet: to the compute thread
    assert isinstance(runner.handle(req(0, 40)), m.StageAnswer)
    assert not runner.take_inline(req(40, 1))  # a prefill does not time a short step
    assert isinstance(runner.handle(req(40, 1)), m.StageAnswer)
    assert runner.take_inline(req(41, 1)) and not runner.take_inline(req(41, INLINE_ROWS + 1))
    assert runner.inline == 1
    (cache,) = runner._caches.values()
    # Only the stage's own layers hold arrays: layer 0 is the coordinator's, never allocated here.
    assert [k if k is None else k.shape[1] for k in cache.k] == [None, cache.capacity, cache.capacity]
    assert cache.v[0] is None and cache.capacity >= 41 and cache.length == 41
    # A step queued for the compute thread, not yet started, keeps the next one off the event loop.
    gate = threading.Event()
    with ThreadPoolExecutor(1) as compute:
        compute.submit(gate.wait, 10)
        queued = runner.submit(compute, req(41, 1))
        assert not runner.take_inline(req(42, 1)) and not queued.running()
        gate.set()
        assert isinstance(queued.result(10), m.StageAnswer)
    assert runner._busy == 0 and runner.inline == 1 and cache.length == 42


def test_a_stage_that_forgot_the_sequence_is_sent_it_again(moe_dir):
    model, ffn, hand, runners = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    layout = ffn.layout

    def on_step(step):
        if step == 4:  # the worker restarts: same peer, no caches
            hand.join()
            fresh = hand.runners[W1] = StageRunner(W1, load_model(moe_dir))
            fresh.accept(layout)

    run = greedy(model, ffn, PROMPT, 8, on_step)
    hand.join()
    ref = greedy(load_model(moe_dir), None, PROMPT, 8)
    assert run[0] == ref[0]
    # the resent prefix is one batch now, not a prefill and steps: float rounding, not more
    assert max(float(np.abs(a - b).max()) for a, b in zip(run[1], ref[1])) < 1e-4
    assert not ffn.failed and hand.runners[W1].served == 4  # a cache_gap, then a resend from 0


def test_a_truncated_cache_re_runs_the_suffix_on_every_stage(moe_dir):
    model, ffn, hand, _ = staged(moe_dir, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    cache = model.new_cache()
    model.forward(PROMPT, cache, ffn=ffn)
    cache.truncate(4)
    got = model.forward(PROMPT[4:], cache, ffn=ffn)
    hand.join()
    ref_model = load_model(moe_dir)
    ref_cache = ref_model.new_cache()
    ref_model.forward(PROMPT, ref_cache)  # the same steps locally
    ref_cache.truncate(4)
    assert np.array_equal(got, ref_model.forward(PROMPT[4:], ref_cache))


def test_the_stage_runner_refuses_what_is_not_its_own(moe_dir):
    layout = StageLayout(2, 3, COORD, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    runner = StageRunner(W1, load_model(moe_dir))
    x = np.ones((2, 64), np.float32)
    req = lambda start=0, **kw: m.StageRequest(**{**dict(  # noqa: E731
        request_id=5, term=2, plan_version=3, segments=(m.StageSegment(1, start, kw.get("x", x).shape[0]),),
        layer_start=1, layer_stop=3, x=x), **kw})
    assert runner.handle(req()).code == "stale_term"  # no plan yet
    runner.accept(layout)
    assert runner.handle(req(plan_version=2)).code == "stale_term"
    assert "not a stage of this peer" in runner.handle(req(layer_start=0)).message
    assert "[1..16384, 64] float32" in runner.handle(req(x=np.ones((2, 32), np.float32))).message
    assert "NaN" in runner.handle(req(x=np.full((2, 64), np.nan, np.float32))).message
    gap = runner.handle(req(start=5))
    assert gap.code == "cache_gap" and "holds 0 positions" in gap.message
    ok = runner.handle(req())
    assert isinstance(ok, m.StageAnswer) and ok.x.shape == (2, 64) and ok.request_id == 5
    with pytest.raises(Exception, match="term 1"):
        runner.accept(StageLayout(1, 9, COORD, layout.stages))


def test_a_step_of_more_sequences_than_a_stage_keeps_is_served_and_keeps_them_all(moe_dir):
    """A coordinator batching more sequences than MAX_SEQUENCES (join --max-batch 12): each step is
    served and no sequence of it is dropped (its next step finds its cache), nor while other
    steps come between (several schedulers); beyond MAX_BATCH_LIMIT sequences a step is refused,
    naming the limit."""
    layout = StageLayout(1, 1, COORD, (Stage(COORD, 0, 1), Stage(W1, 1, 3)))
    now = [0.0]
    runner = StageRunner(W1, load_model(moe_dir), clock=lambda: now[0])
    runner.accept(layout)
    n = MAX_SEQUENCES + 4
    step = lambda start, count=n: m.StageRequest(  # noqa: E731
        5, 1, 1, tuple(m.StageSegment(s, start, 1) for s in range(count)), 1, 3, np.ones((count, 64), np.float32))
    for start in range(3):
        assert isinstance(runner.handle(step(start)), m.StageAnswer)
    assert runner.served == 3
    too_many = runner.handle(step(0, MAX_BATCH_LIMIT + 1))
    assert too_many.code == "bad_request" and f"at most {MAX_BATCH_LIMIT}" in too_many.message
    one = lambda seq, start: m.StageRequest(  # noqa: E731
        5, 1, 1, (m.StageSegment(seq, start, 1),), 1, 3, np.ones((1, 64), np.float32))
    # Steps of one sequence each in between (another scheduler's): those stepped within
    # IN_FLIGHT_S are in flight and kept, whatever MAX_SEQUENCES says.
    now[0] += IN_FLIGHT_S / 2
    for seq in range(100, 100 + MAX_SEQUENCES):
        assert isinstance(runner.handle(one(seq, 0)), m.StageAnswer)
    assert isinstance(runner.handle(one(0, 3)), m.StageAnswer)
    # Once they have not been stepped for IN_FLIGHT_S, the least recently used give way, down to
    # MAX_SEQUENCES.
    now[0] += IN_FLIGHT_S * 2
    assert isinstance(runner.handle(one(200, 0)), m.StageAnswer)
    assert runner.handle(one(1, 3)).code == "cache_gap"
    assert isinstance(runner.handle(one(200, 1)), m.StageAnswer)
    assert isinstance(runner.handle(one(100 + MAX_SEQUENCES - 1, 1)), m.StageAnswer)


def test_stage_messages_check_their_fields():
    bad_plan = m.StagePlan(term=1, version=1, stages=(m.StageAssignment(W1, 0, 2), m.StageAssignment(W2, 3, 4)))
    with pytest.raises(LocalProtocolError, match=r"stages\[1\]: layers \[3, 4\) do not follow"):
        m.encode(bad_plan)
    ok = m.encode(m.StagePlan(term=1, version=1, stages=(m.StageAssignment(W1, 0, 2),)))
    assert m.decode(ok).stages[0].layer_stop == 2
    with pytest.raises(LocalProtocolError, match=r"layers \[2, 2\): empty range"):
        m.encode(m.StageRequest(request_id=1, term=1, plan_version=1, segments=(m.StageSegment(1, 0, 1),),
                                layer_start=2, layer_stop=2, x=np.ones((1, 4), np.float32)))
    two = (m.StageSegment(1, 0, 1), m.StageSegment(2, 5, 1))
    with pytest.raises(LocalProtocolError, match="segments hold 2 rows but x has 3"):
        m.encode(m.StageRequest(request_id=1, term=1, plan_version=1, segments=two, layer_start=0, layer_stop=2,
                                x=np.ones((3, 4), np.float32)))
    with pytest.raises(LocalProtocolError, match="a sequence appears twice"):
        m.encode(m.StageRequest(request_id=1, term=1, plan_version=1, segments=(two[0], two[0]), layer_start=0,
                                layer_stop=2, x=np.ones((2, 4), np.float32)))
    frame = m.encode(m.StageAnswer(request_id=1, term=1, plan_version=1, segments=two, layer_start=0,
                                   layer_stop=2, compute_s=0.001, x=np.ones((2, 4), np.float32)))
    with pytest.raises(MessageError, match="StageAnswer"):
        m.decode(frame.replace(b'"layer_stop":2', b'"layer_stop":0'))


def test_layouts_and_layer_splits():
    assert split_layers(30, ["a", "b"], [1.0, 1.0]) == (Stage("a", 0, 15), Stage("b", 15, 30))
    assert split_layers(3, ["a", "b", "c"], [100.0, 1.0, 0.0]) == (Stage("a", 0, 2), Stage("b", 2, 3))
    assert split_layers(2, ["a", "b", "c"], [1.0, 1.0, 1.0]) == (Stage("a", 0, 1), Stage("b", 1, 2))
    with pytest.raises(LocalProtocolError, match="positive weight"):
        split_layers(4, ["a"], [0.0])
    with pytest.raises(LocalProtocolError, match="does not follow layer 2"):
        StageLayout(1, 1, COORD, (Stage(COORD, 0, 2), Stage(W1, 3, 4)))
    lay = StageLayout(1, 1, COORD, (Stage(COORD, 0, 2), Stage(W1, 2, 4)))
    assert StageLayout.from_message(lay.to_message(), COORD, 4) == lay
    with pytest.raises(Exception, match="not the model's 0:5"):
        StageLayout.from_message(lay.to_message(), COORD, 5)


@pytest.mark.parametrize("mix", [False, True])
def test_a_plans_workers_and_what_each_holds_count_its_stages(mix):
    """Under stages the per-layer plan holds the coordinator alone (every layer: its own stage's,
    and the workers' should their stage fail); its workers are the stage layout's, and each holds
    the FFN of its own layers — the coordinator not the whole model's. Under a mix the
    coordinator's stage's FFN is cut over the workers too, and each holds its ranges there."""
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.plan import ModelShape, held_bytes, plan_workers

    shape = ModelShape(64, 8, 32, 96, (0, 2, 4), (1, 3, 5))  # MoE layers 0, 2, 4; dense 1, 3, 5
    layout = StageLayout(1, 1, COORD, (Stage(COORD, 0, 2), Stage(W1, 2, 4), Stage(W2, 4, 6)))
    takers = [PeerCapacity(W1, 10**9, 1.0), PeerCapacity(W2, 10**9, 1.0)] if mix else []
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), takers, term=1, version=1, layers=[0, 1])
    e, c = shape.unit_bytes()
    layer = {i: shape.n_experts * e if i in shape.moe_layers else shape.intermediate_size * c for i in range(6)}
    if not mix:
        assert plan.peers == (COORD,) and plan.workers() == ()  # what status counted: no worker
        assert plan.bytes_of(COORD, shape) == sum(layer.values())  # what it showed held: the whole model's FFN
        assert plan_workers(plan, layout) == (W1, W2)
        assert held_bytes(plan, layout, COORD, shape) == layer[0] + layer[1]
    else:
        assert set(plan.workers()) == {W1, W2} and plan_workers(plan, layout) == (*plan.workers(),)
        cut = {p: plan.bytes_of(p, shape) for p in (COORD, W1, W2)}  # layers 2..5 are the coordinator's whole
        assert cut[W1] > 0 and cut[W2] > 0 and sum(cut.values()) == sum(layer.values())
        assert held_bytes(plan, layout, COORD, shape) == cut[COORD] - sum(layer[i] for i in (2, 3, 4, 5))
        assert held_bytes(plan, layout, W1, shape) == cut[W1] + layer[2] + layer[3]
        assert held_bytes(plan, layout, W2, shape) == cut[W2] + layer[4] + layer[5]
    assert held_bytes(plan, layout, W1, shape) >= layer[2] + layer[3]
    assert sum(held_bytes(plan, layout, p, shape) for p in (COORD, W1, W2)) == sum(layer.values())
    assert plan_workers(plan, None) == plan.workers()
    assert held_bytes(plan, None, COORD, shape) == plan.bytes_of(COORD, shape)
