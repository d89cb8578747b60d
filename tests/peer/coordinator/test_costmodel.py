"""The planner's cost model with synthetic peers: low RTT and a big FFN → per-layer ranges; a
high RTT → stages; a peer that cannot hold its layers' FFN whole → a mix (the coordinator's
stage cut into ranges); memory caps always respected; a peer observed slow gets less."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.compute.default_model import default_model_path
from swarm.compute.model import load_model
from swarm.peer.coordinator import costmodel as cm
from swarm.peer.coordinator.costmodel import LayerCosts, PeerCost

MB = 2**20
ALL = cm.BUILDABLE  # what status --json prices


def layers(n=24, attn_flops=2e6, ffn_flops=2e8, attn_bytes=1 * MB, ffn_bytes=20 * MB, hidden=1024) -> LayerCosts:
    return LayerCosts((attn_flops,) * n, (ffn_flops,) * n, (attn_bytes,) * n, (ffn_bytes,) * n, 1e7, hidden)


def peers(rtt_s: float, coord_memory: int = 200 * MB, gflops=(10.0, 10.0, 10.0)):
    coord = PeerCost("c", coord_memory, gflops[0])
    return coord, [PeerCost(f"w{i}", 400 * MB, g, rtt_s) for i, g in enumerate(gflops[1:], 1)]


def test_low_rtt_and_a_big_ffn_choose_per_layer_ranges():
    coord, workers = peers(rtt_s=0.0002)
    best, estimates = cm.choose(layers(), coord, workers)
    assert best.layout == "ranges", estimates
    by = {e.layout: e for e in estimates}
    assert not by["local"].fits  # the coordinator cannot hold the model
    assert by["ranges"].decode_s < 0.6 * by["stages"].decode_s  # three peers on every layer at once


def test_a_high_rtt_chooses_stages():
    coord, workers = peers(rtt_s=0.010)
    best, estimates = cm.choose(layers(ffn_flops=2e7), coord, workers)
    assert best.layout == "stages", estimates
    by = {e.layout: e for e in estimates}
    assert by["stages"].decode_s * 3 < by["ranges"].decode_s  # one message per stage, not per layer
    assert [s[0] for s in best.stages][0] == "c"  # the coordinator's layers come first


def test_the_coordinator_alone_wins_when_it_holds_everything_and_links_are_slow():
    coord, workers = peers(rtt_s=0.005, coord_memory=10**12)
    best, _ = cm.choose(layers(ffn_flops=2e7), coord, workers)
    assert best.layout in ("local", "stages") and best.stages == (("c", 0, 24),)


def test_peers_that_take_ranges_only_count_under_ranges_alone():
    """A browser page or a peer without the model file cannot hold a stage: it is priced under
    ranges, where it can make the split worth its round trips, and never given a stage."""
    coord = PeerCost("c", 10**12, 10.0)
    page = PeerCost("page", 400 * MB, 30.0, 0.0002)
    alone, _ = cm.choose(layers(), coord, [])
    best, estimates = cm.choose(layers(), coord, [], range_only=[page])
    assert best.layout == "ranges" and best.decode_s < 0.5 * alone.decode_s, estimates
    assert dict(best.shares)["page"] > 0
    by = {e.layout: e for e in estimates}
    assert by["stages"].stages == (("c", 0, 24),)  # no stage for it
    far = PeerCost("page", 400 * MB, 30.0, 0.010)  # over a slow link it is not worth a round trip a layer
    assert cm.choose(layers(ffn_flops=2e7), coord, [], range_only=[far])[0].layout in ("local", "stages")


def test_a_link_observed_dear_makes_its_messages_dear():
    """A peer whose stage answers showed 10 ms of waiting beyond RTT and compute is priced with
    it, not with the constant: the coordinator alone wins where the constant said stages."""
    coord = PeerCost("c", 10**12, 10.0)
    fast = PeerCost("w1", 10**12, 14.0, 0.001, observed=True)
    costs = layers(ffn_flops=2e7)
    assert cm.choose(costs, coord, [fast])[0].layout in ("stages", "mix")
    dear = PeerCost("w1", 10**12, 14.0, 0.001, observed=True, overhead_s=0.010)
    best, estimates = cm.choose(costs, coord, [dear])
    assert best.stages == (("c", 0, 24),), estimates


def test_the_coordinator_alone_is_kept_unless_another_placement_is_clearly_faster():
    coord = PeerCost("c", 10**12, 10.0)
    costs = layers(ffn_flops=2e7)
    by = lambda w: {e.layout: e for e in cm.choose(costs, coord, [w])[1]}  # noqa: E731
    slightly = PeerCost("w1", 10**12, 12.0, 0.001, observed=True)  # a stage of every layer: ~12 % faster
    est = by(slightly)
    assert 1 - cm.REMOTE_MARGIN < est["stages"].decode_s / est["local"].decode_s < 0.95
    assert cm.choose(costs, coord, [slightly])[0].layout == "local"
    clearly = PeerCost("w1", 10**12, 20.0, 0.001, observed=True)
    assert cm.choose(costs, coord, [clearly])[0].layout == "stages"


def test_a_peer_observed_slow_gets_less():
    costs = layers()
    coord, (a, b) = peers(rtt_s=0.0002)
    slow_b = PeerCost(b.peer_id, b.memory_bytes, 1.0, b.rtt_s, observed=True)  # claimed 10, answers at 1
    shares = dict(cm.estimate_ranges(costs, coord, [a, slow_b]).shares)
    assert shares["w2"] < shares["w1"] / 5
    stages = cm.stage_layers(costs, coord, [a, slow_b])
    held = {p: hi - lo for p, lo, hi in stages}
    assert held.get("w2", 0) < held["w1"]


def mix_memory(costs: LayerCosts, e: cm.Estimate) -> dict[str, float]:
    """Bytes each peer holds under a mix: the coordinator's attention of its stage and its FFN
    share there; a worker its stage's layers and its FFN share of the coordinator's stage."""
    (_, _, k), *tail = e.stages
    ffn_k = sum(costs.ffn_bytes[:k])
    held = {pid: share * ffn_k for pid, share in e.shares}
    held["c"] += sum(costs.attn_bytes[:k])
    for pid, lo, hi in tail:
        held[pid] += sum(costs.layer_bytes(i) for i in range(lo, hi))
    return held


def test_a_peer_that_cannot_hold_its_layers_ffn_whole_gets_a_mix():
    # four big MoE layers, each a quarter of the model: whole layers do not fit, cut FFN does
    costs = layers(n=4, attn_bytes=2 * MB, ffn_bytes=100 * MB, ffn_flops=2e7)
    coord, w = PeerCost("c", 150 * MB, 10.0), PeerCost("w1", 300 * MB, 10.0, 0.010)
    assert cm.choose(costs, coord, [w], layouts=("local", "ranges", "stages"))[0].layout == "ranges"
    best, estimates = cm.choose(costs, coord, [w])
    by = {e.layout: e for e in estimates}
    assert not by["stages"].fits and not by["local"].fits and by["ranges"].fits
    assert best.layout == "mix", estimates
    assert best.stages == (("c", 0, 2), ("w1", 2, 4))  # two layers cut into ranges, then one stage
    assert best.decode_s < 0.8 * by["ranges"].decode_s  # three messages a token instead of four
    held = mix_memory(costs, best)
    assert held["c"] <= coord.memory_bytes and held["w1"] <= w.memory_bytes
    # a big FFN on a fast link: per-layer ranges keep both peers busy on every layer and win again
    big = layers(n=4, attn_bytes=2 * MB, ffn_bytes=100 * MB, ffn_flops=2e9)
    assert cm.choose(big, coord, [PeerCost("w1", 300 * MB, 10.0, 0.0001)])[0].layout == "ranges"


def test_no_candidate_fits_falls_back_to_ranges():
    costs = layers()
    coord = PeerCost("c", 1 * MB, 10.0)
    best, estimates = cm.choose(costs, coord, [PeerCost("w1", 2 * MB, 10.0, 0.001)], layouts=ALL)
    assert best.layout == "ranges" and not any(e.fits for e in estimates)
    # what status --json shows of a placement that cannot be built: no time, in strict JSON
    shown = {e["layout"]: e for e in cm.report(costs, coord, [], best, estimates)["estimates"]}
    assert shown["stages"]["decode_s"] is None and shown["mix"]["prefill_s"] is None
    json.dumps(shown, allow_nan=False)
    note = cm.estimate_stages(costs, coord, []).note
    need = sum(costs.stage_bytes(i) for i in range(costs.n_layers))
    assert note.startswith(f"the peers together hold too little: the layers with their KV cache need {need / 1e9:.2f} GB, "
                           f"the peers have {coord.memory_bytes / 1e9:.2f} GB") and "GB missing" in note
    with pytest.raises(ValueError, match="unknown layouts"):
        cm.choose(costs, coord, [], layouts=("pipeline",))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600), st.floats(0.1, 100.0), st.floats(0.0, 0.02)), min_size=1, max_size=5),
       st.integers(30, 600), st.integers(1, 40))
def test_memory_caps_are_always_respected(spec, coord_mb, n):
    costs = layers(n=n)
    coord = PeerCost("c", coord_mb * MB, 5.0)
    workers = [PeerCost(f"w{i}", mb * MB, g, rtt) for i, (mb, g, rtt) in enumerate(spec)]
    mem = {p.peer_id: p.memory_bytes for p in (coord, *workers)}
    stages = cm.stage_layers(costs, coord, workers)
    if stages is not None:
        assert [lo for _, lo, _ in stages] == [0, *[hi for _, _, hi in stages[:-1]]] and stages[-1][2] == n
        for pid, lo, hi in stages:
            assert sum(costs.layer_bytes(i) for i in range(lo, hi)) <= mem[pid]
    ranges = cm.estimate_ranges(costs, coord, workers)
    assert math.isclose(sum(s for _, s in ranges.shares), 1.0, rel_tol=1e-9)
    for pid, share in ranges.shares:
        if pid != "c":
            assert share * sum(costs.ffn_bytes) <= mem[pid] * (1 + 1e-9)
    mix = cm.estimate_mix(costs, coord, workers)
    if mix.fits:
        assert mix.stages[0][:2] == ("c", 0) and mix.stages[-1][2] == n
        assert math.isclose(sum(s for _, s in mix.shares), 1.0, rel_tol=1e-9)
        for pid, held in mix_memory(costs, mix).items():
            assert held <= mem[pid] * (1 + 1e-9) + 1
    best, _ = cm.choose(costs, coord, workers)
    assert best.fits or not any(e.fits for e in _)


def test_layer_costs_of_smollm2_from_its_header():
    model = load_model(default_model_path())
    costs = LayerCosts.from_model(model)
    c = model.config
    assert costs.n_layers == c.n_layers and costs.hidden_size == c.hidden_size
    attn_weights = c.hidden_size * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.hidden_size
    assert costs.attn_flops[0] == 2 * attn_weights
    assert costs.ffn_flops[0] == 2 * 3 * c.hidden_size * c.intermediate_size
    # compact: Q4_1 is 20 bytes per 32 weights (some tensors of the file are Q8_0 / F16: at most 2 bytes)
    assert 20 / 32 * 3 * c.hidden_size * c.intermediate_size <= costs.ffn_bytes[0] <= 2 * 3 * c.hidden_size * c.intermediate_size
    report = cm.report(costs, *peers(0.001), *cm.choose(costs, *peers(0.001), layouts=ALL))
    assert report["model"]["layers"] == c.n_layers and {e["layout"] for e in report["estimates"]} == set(ALL)
