"""web_peer/share.js against its Python twin (swarm/peer/status.py): the same words and the same
fraction for each peer of a few plans — MoE and dense spans, runs of layers, stages."""

from __future__ import annotations

import json

import pytest

from swarm.peer.status import describe_share, share_fraction

pytestmark = pytest.mark.browser

PLANS = [
    {"version": 1, "term": 1, "coordinator": "c", "peers": ["c", "w"],
     "experts": {"0": [["c", 0, 5], ["w", 5, 8]], "2": [["c", 0, 3], ["w", 3, 6], ["c", 6, 8]]},
     "dense": {"1": [["c", 0, 1024], ["w", 1024, 1536]], "3": [["w", 0, 1536]]}},
    {"dense": {str(layer): [["c", 0, 1274], ["w", 1274, 1536]] for layer in range(30)}},
    {"dense": {str(layer): [["c", 0, 1274], ["w", 1274, 1536]] for layer in range(30)}, "stages": [["s", 10, 20]],
     "cost": {"ranges": 1.5}, "layout": "stages"},
]


@pytest.mark.parametrize("plan", PLANS, ids=["moe", "dense", "stages"])
def test_share_js_matches_python(page, plan):
    got = page.evaluate("""async (plan) => {
        const m = await import("./share.js");
        const units = m.unitsFromPlan(plan);
        return Object.fromEntries(["c", "w", "s", "x"].map((p) => [p, [m.describeShare(units, p, 99), m.shareFraction(units, p)]]));
    }""", json.loads(json.dumps(plan)))
    for peer, (words, fraction) in got.items():
        assert words == describe_share(plan, peer), peer
        assert fraction == pytest.approx(share_fraction(plan, peer), abs=1e-12), peer
