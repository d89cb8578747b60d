"""The load fed to the planner: :class:`LoadWatch` says when the sequences served change the layout
``auto`` chooses, with hysteresis (the most sequences over a window, a changed choice held a while,
a gap between such re-plans), so a load that comes and goes makes no storm of plans. Pure: fed
the time and the sequences running, with a stand-in for the cost model's choice."""

from __future__ import annotations

from swarm.peer.coordinator.planning import LOAD_HOLD_S, LOAD_REPLAN_GAP_S, LOAD_WINDOW_S, LoadWatch


def choice(n: int) -> str:
    return "stages" if n >= 4 else "local"


def feed(watch: LoadWatch, samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The re-plans ``samples`` (time, running) cause: (time, sequences planned for)."""
    return [(t, n) for t, running in samples if (n := watch.observe(t, running, choice)) is not None]


def test_a_load_that_changes_the_choice_replans_once_after_it_held():
    watch = LoadWatch()
    assert feed(watch, [(float(t), 8) for t in range(12)]) == [(LOAD_HOLD_S, 8)]
    assert watch.planned == 8


def test_a_load_that_does_not_change_the_choice_never_replans():
    watch = LoadWatch()
    assert feed(watch, [(float(t), 1 + t % 3) for t in range(60)]) == []  # 1..3 sequences: local either way
    assert watch.planned == 1


def test_a_load_that_comes_and_goes_makes_no_plan_storm():
    watch = LoadWatch()
    samples = [(float(t), 8 if t % 4 < 2 else 0) for t in range(200)]  # users come and go every two seconds
    assert feed(watch, samples) == [(LOAD_HOLD_S, 8)]  # the window keeps the most: it plans once


def test_a_load_that_ends_goes_back_after_the_window_the_hold_and_the_gap():
    watch = LoadWatch()
    replans = feed(watch, [(float(t), 8) for t in range(6)] + [(float(t), 1) for t in range(6, 80)])
    assert replans[0] == (LOAD_HOLD_S, 8) and replans[1][1] == 1 and len(replans) == 2
    back = replans[1][0]
    assert back >= max(5 + LOAD_WINDOW_S + LOAD_HOLD_S, LOAD_HOLD_S + LOAD_REPLAN_GAP_S)


def test_a_change_that_flips_back_before_it_held_replans_nothing():
    watch = LoadWatch()
    # 8 for a moment, then the window passes before the hold would: the choice is "local" again
    samples = [(0.0, 8)] + [(LOAD_WINDOW_S + 1 + t, 1) for t in range(30)]
    assert feed(watch, samples) == []


def test_choice_for_prices_the_last_plans_inputs_for_a_count_and_only_under_auto(tmp_path):
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.planner import PeerCapacity
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.weights.sizes import model_shape
    from tests.peer._swarm_models import COORD, W1, build

    model = load_model(build("qwen3_moe", tmp_path))
    planning = Planning(model, model_shape(model), COORD, "auto")
    assert planning.choice_for(8) == planning.choice_for(1) is None  # no plan yet: the load changes nothing
    worker = PeerCapacity(W1, 10**9, 10.0, 0.002)
    planning.new_plan(1, 10**9, 10.0, [worker], {W1})
    report = planning.cost_report
    assert report["sequences"] == 1
    lay = planning.stage_layout
    assert planning.choice_for(1) == (report["choice"], lay.stages if lay is not None else None)
    for n in (2, 8, 32):  # a count prices a choice; the same count, the same answer
        assert planning.choice_for(n) == planning.choice_for(n)
    planning.sequences = 8  # what the role sets before it re-plans: the plan carries it
    planning.new_plan(1, 10**9, 10.0, [worker], {W1})
    assert planning.cost_report["sequences"] == 8
    assert planning.choice_for(8) == (planning.cost_report["choice"],
                                      planning.stage_layout.stages if planning.stage_layout is not None else None)
    planning.set_layout("stages")
    planning.new_plan(1, 10**9, 10.0, [worker], {W1})
    assert planning.choice_for(1) is None and planning.choice_for(8) is None  # only auto prices the load


def test_a_stage_plan_prices_its_groups_and_the_api_places_sequences_by_that_price(tmp_path):
    """Under stages on another peer, the plan's pricer is the cost model's over the plan's own
    stages and inputs; the coordinator hands it to its stage dispatch and the API's pool places
    new sequences by it. Without stages on another peer there is none, and the pool goes back to
    the least loaded."""
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import tokenizer_for
    from swarm.peer.coordinator import costmodel as cm
    from swarm.peer.coordinator.api_engine import EngineBackend
    from swarm.peer.coordinator.planner import PeerCapacity
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.weights.sizes import model_shape
    from tests.peer._swarm_models import COORD, W1, add_char_tokenizer, build
    from tests.peer.coordinator.test_stages import staged

    path = add_char_tokenizer(build("qwen3_moe", tmp_path))
    model = load_model(path)
    planning = Planning(model, model_shape(model), COORD, "stages")
    assert planning.pricer() is None  # no plan yet
    worker = PeerCapacity(W1, 10**9, 10.0, 0.002)
    planning.new_plan(1, 10**9, 10.0, [worker], {W1})
    stages = planning.stage_layout.stages
    assert [s.peer for s in stages] == [COORD, W1]
    pricer = planning.pricer()
    assert isinstance(pricer, cm.GroupPricer)
    assert pricer.stages == tuple((s.peer, s.start, s.stop) for s in stages) and pricer.coord.peer_id == COORD

    _, ffn, _, _ = staged(path, stages)
    backend = EngineBackend(model, tokenizer_for(model), model_id="m", ffn=ffn)
    assert backend.scheduler.width == 2 and backend.scheduler.tile is None  # not priced: one per stage
    ffn.set_pricer(pricer)
    backend.set_ffn(ffn)
    # this MoE's groups of fewer rows read more experts: no tile, one scheduler per stage
    assert pricer.row_tile() is None and backend.scheduler.tile is None
    ffn.set_pricer(dense_like(pricer))  # a dense model's weights, most of a step: filled a tile at a time
    backend.set_ffn(ffn)
    assert backend.scheduler.tile == cm.ROW_TILE == dense_like(pricer).row_tile()
    backend.set_ffn(None)  # the coordinator alone: one scheduler, no price
    assert backend.scheduler.width == 1 and backend.scheduler.tile is None
    planning.set_layout("ranges")
    planning.new_plan(1, 10**9, 10.0, [worker], {W1})
    assert planning.pricer() is None


def dense_like(pricer):
    """``pricer``'s peers and stages over 24 dense layers whose weights are most of a decode step."""
    from swarm.peer.coordinator import costmodel as cm

    mb = 2**20
    costs = cm.LayerCosts((2e6,) * 24, (2e7,) * 24, (mb,) * 24, (40 * mb,) * 24, 1e7, 1024)
    n = pricer.costs.n_layers
    stages = [(p, lo * 24 // n, hi * 24 // n) for p, lo, hi in pricer.stages]
    return cm.GroupPricer(costs, pricer.coord, [p for p in pricer._peers.values() if p is not pricer.coord], stages)
