"""The peer page's share (web_peer/share.js, from a PlanMessage's assignments) against the
coordinator's (swarm/peer/status.py, from the plan dict), over the same plans: the same words,
fraction and per-layer fractions for each peer — MoE and dense spans, an expert set split in
two runs, runs of layers, more groups than the page names. The dashboard draws the
coordinator's shares as they are (test_dashboard.py)."""

from __future__ import annotations

import pytest

from swarm.peer.status import describe_share, layer_fractions, share_fraction

pytestmark = pytest.mark.browser

PEERS = ["c", "w", "x"]  # x holds nothing
PLANS = [
    {"version": 1, "term": 1, "coordinator": "c", "peers": ["c", "w"],
     "experts": {"0": [["c", 0, 5], ["w", 5, 8]], "2": [["c", 0, 3], ["w", 3, 6], ["c", 6, 8]]},
     "dense": {"1": [["c", 0, 1024], ["w", 1024, 1536]], "3": [["w", 0, 1536]]}},
    {"experts": {}, "dense": {str(layer): [["c", 0, 1274], ["w", 1274, 1536]] for layer in range(30)}},
    {"experts": {str(layer): [["c", 0, layer % 5 + 1], ["w", layer % 5 + 1, 8]] for layer in range(12)}, "dense": {}},
]


def assignments(plan: dict) -> list[dict]:
    """The PlanMessage's assignments of a plan dict, as the page receives them: per (layer, peer)
    its experts (indices) and dense ranges."""
    out: dict[tuple[int, str], dict] = {}
    for kind in ("experts", "dense"):
        for layer, spans in plan[kind].items():
            for peer, a, b in spans:
                entry = out.setdefault((int(layer), peer), {"layer": int(layer), "peer": peer, "experts": [], "dense": []})
                if kind == "experts":
                    entry["experts"] += list(range(a, b))
                else:
                    entry["dense"].append([a, b])
    return list(out.values())


@pytest.mark.parametrize("plan", PLANS, ids=["moe-and-dense", "dense-30-layers", "moe-12-groups"])
def test_the_page_computes_the_coordinators_shares(page, plan):
    got = page.evaluate("""async ([assignments, peers]) => {
        const m = await import("./share.js");
        const units = m.unitsFromAssignments(assignments);
        return Object.fromEntries(peers.map((p) => [p, [m.describeShare(units, p), m.shareFraction(units, p),
                                                         m.layerFractions(units, p).map((f) => [f.layer, f.fraction])]]));
    }""", [assignments(plan), PEERS])
    for peer, (words, fraction, layers) in got.items():
        assert words == describe_share(plan, peer, 3), peer  # the page names 3 groups of layers
        assert fraction == pytest.approx(share_fraction(plan, peer), abs=1e-12), peer
        want = layer_fractions(plan, peer)
        assert [layer for layer, _ in layers] == [layer for layer, _ in want], peer
        assert [f for _, f in layers] == pytest.approx([f for _, f in want], abs=1e-12), peer
    assert "… and" in got["w"][0] or plan is not PLANS[2]  # the last plan has more groups than are named
