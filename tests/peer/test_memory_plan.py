"""The budget rule and plans that fit it: a peer's allowance (limit less baseline less page-cache
headroom) pays for its weights, its KV cache and its activations, and no plan puts a peer past it."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from swarm.peer import memory
from swarm.peer.coordinator import costmodel
from swarm.peer.coordinator.costmodel import LayerCosts, PeerCost
from swarm.peer.coordinator.planner import PeerCapacity, build_plan, shortfall
from swarm.peer.coordinator.planning import choose_stages
from swarm.peer.plan import ModelShape, reserve_of

MIB, GIB = 1 << 20, 1 << 30
STATUS = "Name:\tpython3\nVmRSS:\t  812344 kB\nRssAnon:\t  307200 kB\nRssFile:\t  505144 kB\nRssShmem:\t       0 kB\n"


# ----------------------------------------------------------------------------- the arithmetic
def test_rss_anon_is_read_from_proc_status_text():
    assert memory.rss_anon(STATUS) == 300 * MIB
    assert memory.rss_anon("Name:\tpython3\nVmRSS:\t 1000 kB\n") is None  # an OS without it
    assert memory.process_baseline() > 0


def test_memory_caps_the_whole_process_like_a_cgroup_limit():
    # The fault: --memory 6568 inside a 7 GiB cgroup, 300 MiB of anonymous memory at start.
    a = memory.allowance(available=60 * GIB, baseline=300 * MIB, cgroup_limit=7 * GIB, cap=6568 * MIB)
    assert a.limit == 6568 * MIB
    assert a.headroom == -(-6568 * MIB // 20)  # 5 % of the limit
    assert a.bytes == 6568 * MIB - 300 * MIB - a.headroom == 6_228_122_009
    assert a.bytes < 6568 * MIB - 300 * MIB  # never the cap itself for weights


def test_the_limit_is_the_tightest_of_machine_cgroup_and_cap():
    a = memory.allowance(available=2 * GIB, baseline=100 * MIB)  # no cgroup, no cap: what we have + what is free
    assert (a.limit, a.headroom) == (2 * GIB + 100 * MIB, -(-(2 * GIB + 100 * MIB) // 20))
    b = memory.allowance(available=60 * GIB, baseline=100 * MIB, cgroup_limit=400 * MIB)
    assert b.limit == 400 * MIB and b.headroom == memory.PAGE_CACHE_FLOOR_BYTES  # 5 % < the floor
    assert b.bytes == 400 * MIB - 100 * MIB - 64 * MIB
    assert memory.allowance(available=0, baseline=900 * MIB, cgroup_limit=512 * MIB).bytes == 0  # never negative
    with pytest.raises(ValueError, match="must be ≥ 0"):
        memory.allowance(available=GIB, baseline=0, cap=-1)
    assert "for weights, KV cache and activations" in b.describe()


def test_kv_cache_and_activations_of_a_qwen3_30b_shape():
    assert memory.kv_cache_bytes(48, 4096, 4, 128) == 768 * MIB  # float32 keys and values
    cfg = qwen3_30b_config()
    r = reserve_of(cfg, context=4096)
    assert r["kv_layer_bytes"] == 16 * MIB and r["record_bytes"] == 32 * MIB
    per_row = 8 * 2048 + (32 + 8) * 128 + 2 * 8 * 768  # copies of H, q/k/v, gate and up of 8 experts
    assert r["step_bytes"] == memory.STEP_ROWS * per_row * 4
    assert r["coordinator_step_bytes"] == r["step_bytes"] + memory.STEP_ROWS * 151936 * 4


def test_context_defaults_to_4096_within_the_models_context(monkeypatch):
    monkeypatch.setattr(memory, "_context", [None])
    assert memory.context_tokens(40960) == 4096 and memory.context_tokens(2048) == 2048
    memory.set_context(1000)
    assert memory.context_tokens(40960) == 1000 and memory.context_tokens(0) == 1000
    memory.set_context(3000)  # all sequences together: may pass one sequence's context
    assert memory.context_tokens(2048) == 3000
    with pytest.raises(ValueError, match="--context must be at least 1"):
        memory.set_context(0)


# ----------------------------------------------------------------------------- models and plans
def qwen3_30b_config(**over) -> SimpleNamespace:
    base = dict(hidden_size=2048, n_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=0,
                n_layers=48, moe_layers=tuple(range(48)), n_heads=32, n_kv_heads=4, head_dim=128,
                vocab_size=151936, max_position_embeddings=40960, shared_expert_intermediate_size=0)
    return SimpleNamespace(**{**base, **over})


def model(cfg, expert_nbytes: int, column_nbytes: int, attn_nbytes: int, embed_nbytes: int, context: int):
    """(ModelShape, LayerCosts, embeddings + head bytes) of a model of ``cfg``, as the role builds them."""
    r = reserve_of(cfg, context)
    shape = dataclasses.replace(ModelShape.from_config(cfg), kv_layer_bytes=r["kv_layer_bytes"], kv_bytes=r["kv_bytes"],
                                step_bytes=r["step_bytes"], coordinator_step_bytes=r["coordinator_step_bytes"],
                                record_bytes=r["record_bytes"], expert_nbytes=expert_nbytes, column_nbytes=column_nbytes)
    moe = set(shape.moe_layers)
    ffn = tuple(cfg.n_experts * expert_nbytes if i in moe else cfg.intermediate_size * column_nbytes
                for i in range(cfg.n_layers))
    shape = dataclasses.replace(shape, resident_nbytes=embed_nbytes + cfg.n_layers * attn_nbytes
                                + len(moe) * cfg.n_experts * cfg.hidden_size * 4)
    costs = LayerCosts((1e6,) * cfg.n_layers, (1e6,) * cfg.n_layers, (attn_nbytes,) * cfg.n_layers, ffn, 1e6,
                       cfg.hidden_size, kv_bytes=r["kv_bytes"], step_bytes=r["step_bytes"],
                       coord_step_bytes=r["coordinator_step_bytes"], record_bytes=r["record_bytes"])
    return shape, costs, embed_nbytes


def plan_like_the_coordinator(mode, shape, costs, own, allowances, speeds):
    """What CoordinatorRole._plan_layout and _new_plan do: the stage layout (None: ranges) and
    the FFN plan, with each peer's planned bytes counted here, apart from the planner."""
    ids = list(allowances)
    coord, workers = ids[0], ids[1:]
    me = PeerCost(coord, max(allowances[coord] - own, 0), speeds[coord])
    holders = [PeerCost(w, allowances[w], speeds[w], 0.001) for w in workers]
    stages, report = choose_stages(mode, costs, me, holders)
    caps = [PeerCapacity(w, allowances[w], speeds[w], 0.001) for w in workers]
    cut = None
    if stages is not None:
        held = {s.peer: sum(costs.stage_bytes(i) for i in range(s.start, s.stop)) for s in stages if s.peer != coord}
        if report["choice"] == "mix":
            cut = range(stages[0].start, stages[0].stop)
            caps = [dataclasses.replace(c, memory_bytes=max(c.memory_bytes - held.get(c.peer_id, 0), 0)) for c in caps]
        else:
            caps = []
    n_stage_workers = len({s.peer for s in stages or () if s.peer != coord})
    # The coordinator keeps the KV cache of the layers whose attention it runs: all of them
    # without stages, its own stages' layers with them.
    kv_layers = shape.n_layers if stages is None else sum(s.stop - s.start for s in stages if s.peer == coord)
    budget = shape.coordinator_weight_budget(allowances[coord], n_stage_workers, None if stages is None else kv_layers)
    plan = build_plan(shape, PeerCapacity(coord, 0, speeds[coord]), caps, term=1, version=1,
                      coordinator_budget=budget, layers=cut)
    planned = {p: 0 for p in ids}
    kv = shape.kv_layer_bytes
    for s in stages or ():
        if s.peer != coord:
            planned[s.peer] += sum(costs.layer_bytes(i) for i in range(s.start, s.stop)) + (s.stop - s.start) * kv
    for w in workers:
        planned[w] += plan.bytes_of(w, shape) + (shape.step_bytes if planned[w] or plan.bytes_of(w, shape) else 0)
    reserve = kv_layers * kv + shape.coordinator_step_bytes + n_stage_workers * shape.record_bytes
    if stages is not None and report["choice"] != "mix":  # whole stages: its layers, embeddings and head
        planned[coord] = own + sum(costs.layer_bytes(i) for s in stages if s.peer == coord
                                   for i in range(s.start, s.stop)) + reserve
        streamed = 0
    else:  # ranges or a mix: what only it holds, its FFN share in memory (the rest is streamed)
        streamed = plan.streamed_bytes
        fixed = shape.resident_nbytes + reserve
        e, c = shape.unit_bytes()
        mine = (sum(len(s) * e for layer, spans in plan.experts.items() if cut is None or layer in cut
                    for s in spans if s.peer == coord)
                + sum(len(s) * c for layer, spans in plan.dense.items() if cut is None or layer in cut
                      for s in spans if s.peer == coord))  # a mix: the stage workers' layers are not its own
        if fixed > allowances[coord]:  # its own part alone is too much: none of its FFN share is in memory, and it says so
            assert mine == streamed
            short = shortfall(plan, shape, coordinator_allowance=allowances[coord], worker_stages=n_stage_workers,
                              kv_layers=None if stages is None else kv_layers)
            assert short["coordinator_over_bytes"] == fixed - allowances[coord] and "more than its memory" in short["message"]
            fixed = allowances[coord]
        planned[coord] = fixed + mine - streamed
    return stages, report, plan, planned, streamed


def test_48_layers_17_gb_over_three_7_gib_peers_fit_with_room_or_say_what_is_missing():
    cfg = qwen3_30b_config()
    attn, embed = 11_300_000, 373_000_000
    expert = (17_000_000_000 - embed - 48 * attn) // (48 * 128)  # 17.0 GB in all
    shape, costs, own = model(cfg, expert, 0, attn, embed, 4096)
    assert abs(sum(costs.layer_bytes(i) for i in range(48)) + embed - 17.0e9) < 1e6
    speeds = {"coord": 10.0, "peer-a": 10.0, "peer-b": 10.0}
    baseline = 300 * MIB
    # --memory 6568 in a 7 GiB cgroup (the fault's setting): three stages, each within its
    # allowance, the page-cache headroom free; the coordinator keeps its own layers' KV cache only.
    capped = {p: memory.allowance(available=60 * GIB, baseline=baseline, cgroup_limit=7 * GIB, cap=6568 * MIB).bytes
              for p in speeds}
    for mode in ("auto", "stages"):
        stages, report, plan, planned, streamed = plan_like_the_coordinator(mode, shape, costs, own, capped, speeds)
        assert stages is not None and streamed == 0 and {s.peer for s in stages} == set(speeds), (mode, report)
        for p in speeds:
            assert planned[p] <= capped[p], (mode, planned, capped)
            assert planned[p] + baseline <= 6568 * MIB - 328 * MIB  # the page-cache headroom stays free
    # --memory 6000: 3 × 5.6 GB cannot hold 17 GB with the KV cache: said, never past a budget.
    short_of = {p: memory.allowance(available=60 * GIB, baseline=baseline, cgroup_limit=7 * GIB, cap=6000 * MIB).bytes
                for p in speeds}
    for mode in ("auto", "stages", "mix"):
        stages, report, plan, planned, streamed = plan_like_the_coordinator(mode, shape, costs, own, short_of, speeds)
        assert all(planned[p] <= short_of[p] for p in speeds), (mode, planned, short_of)
        assert stages is None and report["choice"] == "ranges"  # no stage layout fits
        assert 0.5e9 < streamed < 2.5e9
        short = shortfall(plan, shape, read_bytes_per_s=500e6)
        assert short["missing_bytes"] == streamed and f"{streamed / 1e9:.2f} GB is missing" in short["message"]
        assert "lower --context" in short["message"] and "500 MB/s its disk reads (measured" in short["message"]
        assert short["read_bytes_per_token"] == pytest.approx(streamed * 8 / 128, abs=1)
        assert short["s_per_token"] == pytest.approx(streamed * 8 / 128 / 500e6, rel=1e-6)
        stage = next(e for e in report["estimates"] if e["layout"] == "stages")
        assert "GB missing" in stage["note"]


def random_case(rng: random.Random):
    moe = rng.random() < 0.7
    n_layers = rng.randint(1, 64)
    E = rng.choice([8, 16, 60, 64, 128]) if moe else 0
    hd = rng.choice([64, 128])
    nh = rng.choice([4, 8, 16, 32])
    cfg = qwen3_30b_config(hidden_size=rng.choice([256, 1024, 2048, 4096]), n_experts=E, top_k=min(rng.choice([1, 2, 8]), E) if moe else 0,
                           moe_intermediate_size=rng.choice([64, 768, 1408]) if moe else 0,
                           intermediate_size=0 if moe and rng.random() < 0.7 else rng.choice([512, 5632, 11008]),
                           n_layers=n_layers, moe_layers=tuple(i for i in range(n_layers) if moe and (i or rng.random() < 0.5)),
                           n_heads=nh, n_kv_heads=rng.choice([k for k in (1, 2, 4, 8) if nh % k == 0]), head_dim=hd,
                           vocab_size=rng.choice([32000, 151936]), max_position_embeddings=rng.choice([2048, 32768]))
    expert = rng.randint(1, 8 << 20) if moe else 0
    column = rng.randint(1, 30_000) if cfg.intermediate_size else 0
    shape, costs, own = model(cfg, expert, column, rng.randint(0, 50 << 20), rng.randint(0, 600 << 20),
                              rng.choice([256, 2048, 4096, 8192]))
    total = sum(costs.layer_bytes(i) for i in range(n_layers)) + own
    n = rng.randint(1, 6)
    ids = ["coord", *(f"w{i}" for i in range(1, n))]
    allowances = {p: int(total * rng.uniform(0.02, 1.5) / max(n - 1, 1)) + rng.choice([0, own]) for p in ids}
    speeds = {p: rng.choice([0.5, 1.0, 5.0, 30.0]) for p in ids}
    return shape, costs, own, allowances, speeds


@pytest.mark.parametrize("mode", ["auto", "stages", "mix"])
def test_no_plan_puts_a_peer_past_its_allowance(mode):
    rng = random.Random(f"fit-{mode}")
    chosen = set()
    for _ in range(300):
        shape, costs, own, allowances, speeds = random_case(rng)
        stages, report, plan, planned, streamed = plan_like_the_coordinator(mode, shape, costs, own, allowances, speeds)
        for p, held in planned.items():
            assert held <= allowances[p], (p, held, allowances[p], report["choice"])
        if stages is not None and report["choice"] != "mix":
            assert streamed == 0
            fit = costmodel.stage_fit(costs, PeerCost("coord", max(allowances["coord"] - own, 0), 1.0),
                                      [PeerCost(p, allowances[p], 1.0) for p in allowances if p != "coord"],
                                      [(s.peer, s.start, s.stop) for s in stages])
            assert all(a <= b for a, b in fit.values())
        chosen.add(report["choice"])
    assert "ranges" in chosen and chosen - {"ranges"}  # both fitting and not fitting cases were drawn


def test_status_and_the_dashboard_say_what_is_missing():
    import io
    from pathlib import Path

    from rich.console import Console

    from swarm.peer.status import render, share_fraction

    shape = ModelShape(hidden_size=16, n_experts=64, moe_intermediate_size=8, intermediate_size=0, top_k=8,
                       moe_layers=tuple(range(4)), dense_layers=(), expert_nbytes=4 << 20)  # 1.07 GB in all
    plan = build_plan(shape, PeerCapacity("c" * 26, 0, 1.0), [PeerCapacity("w" * 26, 600 << 20, 1.0)],
                      term=1, version=3, coordinator_budget=100 << 20)
    short = shortfall(plan, shape, read_bytes_per_s=250e6)
    assert short["missing_bytes"] == plan.streamed_bytes == (1024 - 700) << 20
    assert short["read_bytes_per_token"] == plan.streamed_bytes // 8  # each expert: 8 tokens in 64
    placement = {"term": 1, "version": 3, "streamed_bytes": plan.streamed_bytes, **plan.to_dict(), "shortfall": short}
    doc = {"peer_id": "c" * 26, "name": "laptop", "role": "coordinator", "swarm_id": "s", "placement": placement,
           "peers": [{"peer_id": "w" * 26, "name": "box", "kind": "python", "linked": True}]}
    out = io.StringIO()
    Console(file=out, width=100, force_terminal=False, color_system=None).print(render(doc))
    text = " ".join(out.getvalue().split())
    assert "memory: the swarm's memory holds 734 MB of the model's 1.07 GB" in text
    assert "340 MB is missing" in text and "at least 0.17 s a token at the 250 MB/s" in text
    assert 0 < share_fraction(placement, "w" * 26) < 1  # the shortfall is no layer of the plan
    page = Path(__file__).resolve().parents[2] / "web_peer"
    assert 'id="plan-shortfall"' in (page / "dashboard.html").read_text()
    assert "plan.shortfall?.message" in (page / "dashboard.js").read_text()


def test_under_stages_the_coordinators_ffn_budget_counts_only_its_own_layers_attention():
    """A stage layout the cost model found to fit gives the coordinator an FFN budget that holds
    its own stages' FFN: the attention of the workers' layers is not charged to it (it maps them
    but runs them only after a failover), so nothing is streamed and no shortfall is said."""
    cfg = qwen3_30b_config()
    attn, embed = 11_300_000, 373_000_000
    expert = (17_000_000_000 - embed - 48 * attn) // (48 * 128)
    shape, costs, own = model(cfg, expert, 0, attn, embed, 4096)
    speeds = {"coord": 10.0, "peer-a": 10.0, "peer-b": 10.0}
    allow = memory.allowance(available=60 * GIB, baseline=300 * MIB, cgroup_limit=7 * GIB, cap=6568 * MIB).bytes
    me = PeerCost("coord", max(allow - own, 0), speeds["coord"])
    stages, report = choose_stages("stages", costs, me, [PeerCost(w, allow, speeds[w], 0.001) for w in ("peer-a", "peer-b")])
    mine = [i for s in stages if s.peer == "coord" for i in range(s.start, s.stop)]
    assert report["choice"] == "stages" and 0 < len(mine) < 48
    not_run = sum(b for i, b in enumerate(costs.attn_bytes) if i not in mine)
    assert not_run == (48 - len(mine)) * attn
    budget = shape.coordinator_weight_budget(allow, 2, len(mine), not_run)
    assert budget == allow - (shape.resident_nbytes - not_run + len(mine) * shape.kv_layer_bytes
                              + shape.coordinator_step_bytes + 2 * shape.record_bytes)
    plan = build_plan(shape, PeerCapacity("coord", 0, 10.0), [], term=1, version=1, coordinator_budget=budget,
                      layers=mine)
    assert plan.streamed_bytes == 0
    assert shortfall(plan, shape, coordinator_allowance=allow, worker_stages=2, kv_layers=len(mine),
                     not_run_bytes=not_run) is None
    # Charged every layer's attention (the old rule), the same layout streamed part of its own FFN.
    old = build_plan(shape, PeerCapacity("coord", 0, 10.0), [], term=1, version=1,
                     coordinator_budget=shape.coordinator_weight_budget(allow, 2, len(mine)), layers=mine)
    assert old.streamed_bytes > 0
