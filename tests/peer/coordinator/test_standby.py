"""A page the plan gives no work is told it stands by, and why: the coordinator role plans over
fake links that carry every message through the real wire codec, and each page without work gets
a Standby of that plan with the right reason — none when it has work, none when its Hello does not
read Standby; the codec refuses a malformed Standby naming the field."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from swarm.errors import LocalProtocolError, MessageError
from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator import standby
from swarm.peer.coordinator.planner import PeerCapacity
from swarm.peer.coordinator.role import CoordinatorRole
from swarm.peer.net import messages as M
from swarm.peer.net import wire
from swarm.peer.node import Node
from swarm.peer.plan import ModelShape, Plan, Span
from tests.peer._swarm_models import build, peer_id

PAGE, OLD_PAGE, PY = peer_id("page"), peer_id("old-page"), peer_id("python")
READS = "webgpu kernels:q4_0,q4_1,q8_0 notices:standby"


class Election:
    term = 4

    def is_refused(self, peer: str) -> bool:
        return False

    def reachable(self, peer: str) -> bool:
        return True


class FakeLink:
    """A link whose sends go through the wire codec, both ways, and are kept in ``got``."""

    def __init__(self, peer: str, hello: M.Hello, rtt_s: float = 0.002) -> None:
        self.peer_id, self.hello, self.rtt_s, self.got = peer, hello, rtt_s, []

    async def send(self, msg) -> None:
        self.got.append(M.decode(M.encode(msg)))

    def of(self, kind):
        return [m for m in self.got if isinstance(m, kind)]


def hello(peer: str, kind: str = "browser", blas: str = READS, memory: int = 1 << 30, gflops: float = 5.0,
          model_hash: str | None = None) -> M.Hello:
    return M.Hello(peer_id=peer, protocol_version=wire.PROTOCOL_VERSION,
                   build=M.NumericBuild("web_peer", "", blas, "webgpu", "f32"), model_hash=model_hash,
                   memory_budget=memory, ffn_gflops=gflops, peer_kind=kind, adapter_limits={},
                   adapter_features=(), name=peer[:8])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build("qwen3_moe", tmp_path_factory.mktemp("standby")))


def coordinator(tmp_path, model, layout: str, links: list[FakeLink], gflops: float = 50.0) -> CoordinatorRole:
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json", model_hash=model.content_hash(), memory_budget=1 << 30,
                ffn_gflops=gflops)
    for link in links:
        node.links[link.peer_id] = link
    role = CoordinatorRole(node, model, Election(), layout=layout)

    async def offered(link, plan) -> bool:  # shipping slices is not what is tested here
        return True

    role._announcer._offer = offered
    return role


def plan_and_announce(role: CoordinatorRole) -> Plan:
    async def go():
        plan = role._new_plan()
        await role._announce(plan)
        return plan
    return asyncio.run(go())


def test_a_page_of_a_model_the_coordinator_holds_stands_by_for_it_and_an_older_page_is_told_nothing(tmp_path, model):
    page, old = FakeLink(PAGE, hello(PAGE)), FakeLink(OLD_PAGE, hello(OLD_PAGE, blas="webgpu kernels:q4_0"))
    role = coordinator(tmp_path, model, "auto", [page, old])
    plan = plan_and_announce(role)
    assert role.planning.cost_report["choice"] != "ranges" and PAGE not in plan.workers()
    (notice,) = page.got
    assert isinstance(notice, M.Standby) and (notice.term, notice.version) == (plan.term, plan.version)
    assert notice.reason == "fits_python_peers"
    assert notice.message.startswith("the model fits the Python peers (1 peer, 1.0 GiB offered)")
    assert old.got == []  # it would refuse kind 21 and drop its link
    # status and the dashboard show why, for every page without work (an older page too)
    standing = role.node.placement["standby"]
    assert standing[PAGE] == {"reason": "fits_python_peers", "message": notice.message}
    assert standing[OLD_PAGE]["reason"] == "fits_python_peers"


def test_a_page_with_work_gets_the_plan_and_no_standby_then_one_when_it_loses_the_work(tmp_path, model):
    page = FakeLink(PAGE, hello(PAGE))
    role = coordinator(tmp_path, model, "ranges", [page])
    first = plan_and_announce(role)
    assert PAGE in first.workers()
    assert [type(m) for m in page.got] == [M.PlanMessage] and not page.of(M.Standby)
    role.set_layout("stages")  # whole layers only: a page runs none
    second = plan_and_announce(role)
    (notice,) = page.of(M.Standby)
    assert (notice.version, notice.reason) == (second.version, "layout_excludes_pages") and second.version > first.version
    assert "--layout stages" in notice.message
    assert len(page.of(M.PlanMessage)) == 1  # the plan itself goes only to those it gives work
    assert role.node.placement["standby"][PAGE]["reason"] == "layout_excludes_pages"


@pytest.mark.parametrize("page_hello, rtt_s, reason, words", [
    (hello(PAGE, memory=1), 0.002, "too_little_memory", "holds no expert or MLP slice"),
    (hello(PAGE, memory=0), 0.002, "too_little_memory", "offers no memory"),
    (hello(PAGE, gflops=1e-9), 0.002, "too_slow", "measured speed (0.0 GFLOP/s) would slow the swarm"),
    (hello(PAGE), 6.0, "slow_link", "round trip to the coordinator (6.0 s)"),
], ids=["little-memory", "no-memory", "slow", "slow-link"])
def test_under_ranges_a_page_placement_leaves_out_is_told_why(tmp_path, model, page_hello, rtt_s, reason, words):
    page = FakeLink(PAGE, page_hello, rtt_s)
    role = coordinator(tmp_path, model, "ranges", [page], gflops=1000.0)
    plan = plan_and_announce(role)
    assert PAGE not in plan.workers()
    (notice,) = page.got
    assert notice.reason == reason and words in notice.message, notice


def test_a_page_marked_down_stands_by_until_it_is_tried_again(tmp_path, model):
    page = FakeLink(PAGE, hello(PAGE))
    role = coordinator(tmp_path, model, "ranges", [page])
    role.mark_down(PAGE)
    plan_and_announce(role)
    (notice,) = page.got
    assert notice.reason == "failed_recently"


def test_notices_name_the_python_peers_and_skip_busy_pages():
    shape = ModelShape(8, 0, 0, 64, (), (0, 1))
    busy, idle, coord = peer_id("busy"), peer_id("idle"), peer_id("coord")
    plan = Plan(3, 2, coord, (coord, busy), dense={i: (Span(coord, 0, 32), Span(busy, 32, 64)) for i in (0, 1)})
    caps = {p: PeerCapacity(p, 1 << 30, 5.0, kind="browser") for p in (busy, idle)}
    out = standby.notices(plan, [busy, idle], caps, layout="auto", choice="stages", shape=shape,
                          python_peers=3, python_bytes=int(12.4 * 2**30))
    assert set(out) == {idle} and (out[idle].term, out[idle].version) == (2, 3)
    assert out[idle].message == ("the model fits the Python peers (3 peers, 12.4 GiB offered); this page would be "
                                 "used if they ran short")
    # the same plan priced as ranges: the idle page's share rounded to nothing
    slow = standby.notices(plan, [busy, idle], caps, layout="auto", choice="ranges", shape=shape,
                           python_peers=3, python_bytes=0)
    assert slow[idle].reason == "too_slow"


def test_reads_standby_only_from_the_notices_word():
    build = M.NumericBuild("web_peer", "", READS, "webgpu", "f32")
    assert standby.reads_standby(build)
    for blas in ("webgpu", "webgpu kernels:q4_0", "webgpu notices:", "webgpu notices:standbys", "standby"):
        assert not standby.reads_standby(dataclasses.replace(build, blas=blas)), blas
    assert standby.reads_standby(dataclasses.replace(build, blas="webgpu notices:other,standby"))
    # a reason added later goes only to a page that names it too
    assert not standby.reads_standby(build, "other_numerics") and standby.reads_standby(build, "too_slow")
    newer = dataclasses.replace(build, blas=READS + ",other_numerics")
    assert standby.reads_standby(newer, "other_numerics") and standby.reads_standby(newer, "slow_link")
    assert not standby.reads_standby(dataclasses.replace(build, blas="webgpu notices:other_numerics"), "other_numerics")


@pytest.mark.parametrize("fields, what", [
    ({"reason": "bored"}, "reason: expected one of"),
    ({"message": ""}, "message: 1..200 characters, got 0"),
    ({"message": "x" * 201}, "message: 1..200 characters, got 201"),
    ({"message": "two\nlines"}, "message: control characters"),
    ({"message": "bell\x07"}, "message: control characters"),
    ({"term": -1}, "term: expected an integer"),
    ({"version": "6"}, "version: expected an integer"),
])
def test_a_malformed_standby_is_refused_naming_the_field(fields, what):
    good = {"term": 3, "version": 6, "reason": "too_slow", "message": "x"}
    frame = wire.encode_frame(21, M.schema._JSON_ENCODER.encode({**good, **fields}).encode(), [])
    with pytest.raises(MessageError, match="Standby \\(kind 21\\): " + what.replace("(", "\\(").replace(")", "\\)")):
        M.decode(frame)
    with pytest.raises(LocalProtocolError, match=what.split(":")[0]):
        M.encode(M.Standby(**{**good, **fields}))
    assert M.decode(wire.encode_frame(21, M.schema._JSON_ENCODER.encode(good).encode(), [])) == M.Standby(**good)
