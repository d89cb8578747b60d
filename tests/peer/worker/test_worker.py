"""Worker: answers from its own slices with the engine's bits; refuses bad requests with an Error."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest

from swarm.compute.ffn import LocalFFN, swiglu_ffn
from swarm.compute.model import load_model
from swarm.errors import MessageError, RemoteProtocolError, StaleTermError
from swarm.peer.net import messages as M
from swarm.peer.net import wire
from swarm.peer.worker import ffn as worker_mod
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.plan import ModelShape
from swarm.peer.election.driver import ElectionDriver
from swarm.keys.identity import Identity
from swarm.peer.node import Node
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.worker.ffn import Worker
from swarm.peer.weights.shipping import SliceCache, build_manifest
from swarm.peer.weights.shipping_aio import SliceFetcher
from swarm.peer.weights.slices import ModelSlicer, specs_for
from swarm.peer.worker.role import WorkerRole
from tests.peer._swarm_models import COORD, W1, W2, build


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build("qwen3_moe", tmp_path_factory.mktemp("w"))  # layers 0, 2 MoE; layer 1 dense
    model = load_model(path)
    shape = ModelShape.from_config(model.config)
    assert shape.hidden_size == H and shape.moe_layers == (0, 2) and shape.dense_layers == (1,)
    plan = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0), PeerCapacity(W2, 10**9, 1.0)],
                      term=4, version=2)
    return model, shape, plan


@pytest.fixture
def worker(setup):
    model, shape, plan = setup
    w = Worker(W1, shape, load_model(model.path))
    w.accept_plan(plan)
    return w


H = 64  # hidden size of the tiny qwen3_moe (tests/compute/tiny_models.py)


def x_rows(n, H=H, seed=0):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)


def expert_request(plan, layer, ids, counts, rows, *, term=None, version=None, rid=7):
    return M.ExpertRequest(rid, plan.term if term is None else term, plan.version if version is None else version,
                           layer, np.array(ids, np.int32), np.array(counts, np.int32), rows)


def test_expert_answer_equals_the_local_computation(setup, worker):
    model, shape, plan = setup
    span = plan.expert_span(0, W1)
    x = x_rows(9)
    ids = [span.start, span.stop - 1]
    req = expert_request(plan, 0, ids, [4, 5], x)
    ans = M.decode(M.encode(worker.handle(M.decode(M.encode(req)))))  # through the wire both ways
    assert isinstance(ans, M.ExpertAnswer) and ans.request_id == 7 and (ans.term, ans.plan_version) == (4, 2)
    assert np.array_equal(ans.outputs[:4], swiglu_ffn(model.expert_weights(0, ids[0]), x[:4]))
    assert np.array_equal(ans.outputs[4:], swiglu_ffn(model.expert_weights(0, ids[1]), x[4:]))


def test_dense_answer_sums_with_the_other_spans_to_local_ffn(setup, worker):
    model, shape, plan = setup
    x = x_rows(5)
    s = plan.dense_span(1, W1)
    ans = worker.handle(M.DenseRequest(3, 4, 2, 1, ((s.start, s.stop),), x))
    assert isinstance(ans, M.DenseAnswer) and ans.partials.shape == (1, 5, H)
    parts = [ans.partials[0] if sp.peer == W1 else swiglu_ffn(model.dense_weights(1, sp.start, sp.stop), x)
             for sp in plan.dense[1]]
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    assert np.array_equal(total, LocalFFN(model, plan.dense_ranges()).ffn(1, x))


def refused(worker, req, code, match):
    ans = worker.handle(req)
    assert isinstance(ans, M.Error), ans
    assert ans.code == code and ans.request_id == req.request_id
    assert match in ans.message, ans.message
    M.encode(ans)  # a valid frame goes back


def test_stale_and_unknown_terms_and_versions_are_refused(setup, worker):
    _, _, plan = setup
    span = plan.expert_span(0, W1)
    ok = dict(ids=[span.start], counts=[2], rows=x_rows(2))
    refused(worker, expert_request(plan, 0, **ok, term=3), "stale_term", "request of term 3 v2")
    refused(worker, expert_request(plan, 0, **ok, version=1), "stale_term", "serves term 4 v2")
    refused(worker, expert_request(plan, 0, **ok, term=5), "stale_term", "term 5")
    with pytest.raises(StaleTermError, match="stale"):
        worker.accept_plan(plan)  # the same version again
    older = build_plan(setup[1], PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=3, version=9)
    with pytest.raises(StaleTermError, match="plan term 3 v9 is stale"):
        worker.accept_plan(older)


def test_previous_plan_is_served_until_the_next_one(setup, worker):
    _, shape, plan = setup
    new = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=4, version=3)
    worker.accept_plan(new)
    span = plan.expert_span(0, W1)
    assert isinstance(worker.handle(expert_request(plan, 0, [span.start], [1], x_rows(1))), M.ExpertAnswer)
    newer = build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=5, version=1)
    worker.accept_plan(newer)  # a new term: nothing of term 4 is served any more
    refused(worker, expert_request(new, 0, [0], [1], x_rows(1)), "stale_term", "serves term 5 v1")


@pytest.mark.parametrize("case, match", [
    ("expert of another peer", "outside this worker's"),
    ("dense layer as experts", "gives this worker no experts"),
    ("wrong hidden size", f"must be [n, {H}] float32"),
    ("f16 rows", "float32"),
    ("NaN rows", "NaN or infinity"),
    ("too many rows", "exceed"),
])
def test_bad_expert_requests_are_refused(setup, worker, case, match, monkeypatch):
    _, _, plan = setup
    span = plan.expert_span(0, W1)
    other = plan.expert_span(0, W2)
    layer, ids, counts, rows = 0, [span.start], [3], x_rows(3)
    if case == "expert of another peer":
        ids = [other.start]
    elif case == "dense layer as experts":
        layer = 1
    elif case == "wrong hidden size":
        rows = x_rows(3, H=H - 1)
    elif case == "f16 rows":
        rows = rows.astype(np.float16)
    elif case == "NaN rows":
        rows[1, 5] = np.nan
    elif case == "too many rows":
        monkeypatch.setattr(worker_mod, "MAX_REQUEST_ROWS", 2)
    refused(worker, expert_request(plan, layer, ids, counts, rows), "bad_request", match)


def test_bad_dense_requests_are_refused(setup, worker):
    _, _, plan = setup
    s = plan.dense_span(1, W1)
    o = plan.dense_span(1, W2)
    refused(worker, M.DenseRequest(1, 4, 2, 1, ((o.start, o.stop),), x_rows(2)), "bad_request", "not this worker's")
    refused(worker, M.DenseRequest(1, 4, 2, 1, ((s.start, s.stop - 1),), x_rows(2)), "bad_request", "not this worker's")
    refused(worker, M.DenseRequest(1, 4, 2, 0, ((s.start, s.stop),), x_rows(2)), "bad_request", "not this worker's")
    refused(worker, M.DenseRequest(1, 4, 2, 1, ((s.start, s.stop),), np.full((2, H), np.inf, np.float32)),
            "bad_request", "NaN or infinity")


def test_no_plan_yet_is_refused(setup):
    model, shape, plan = setup
    w = Worker(W1, shape, model)
    refused(w, expert_request(plan, 0, [0], [1], x_rows(1)), "stale_term", "no plan yet")


def test_inconsistent_frames_never_reach_the_worker(setup):
    _, _, plan = setup
    data = bytearray(M.encode(expert_request(plan, 0, [1, 2], [1, 1], x_rows(2))))
    frame = wire.decode_frame(data)
    counts = frame.tensors[1]  # row_counts, a view into data
    at = counts.__array_interface__["data"][0] - np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    data[at + 4:at + 8] = (5).to_bytes(4, "little")  # claims 6 rows, 2 are sent
    with pytest.raises(MessageError, match="row_counts sum to 6 but rows has 2 rows"):
        M.decode(bytes(data))
    with pytest.raises(RemoteProtocolError):
        M.decode(bytes(data[:40]))  # truncated


def test_lazy_slices_only_what_the_plan_assigns(setup):
    model, shape, plan = setup
    fresh = load_model(model.path)
    w = Worker(W1, shape, fresh)
    w.accept_plan(plan)
    nbytes = w.prepare()
    assert nbytes > 0
    mine = {(l, e) for l, spans in plan.experts.items() for s in spans if s.peer == W1 for e in range(s.start, s.stop)}
    assert set(fresh._experts) == mine  # no other expert was ever decoded
    assert not fresh._dense  # dense ranges are copied out of the file, the whole MLP is never kept



class CoordLink:
    """The coordinator's end of a worker's link, recording what the worker answers (``is_open``
    False: as a real link once closed)."""
    peer_id, hello, is_open = COORD, None, True

    def __init__(self):
        self.sent = []

    def on(self, message_type, handler):
        pass

    def on_close(self, handler):
        pass

    async def send(self, msg):
        self.sent.append(msg)


def worker_role(tmp_path, model) -> WorkerRole:
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(os.urandom(32)), certificate=ident.rtc_certificate(), peer_id=W1,
                status_path=tmp_path / "status.json")
    return WorkerRole(node, model, ElectionDriver(node, model is not None, on_leader=None, on_admitted=None))


def one_worker_plan(shape, version: int):
    return build_plan(shape, PeerCapacity(COORD, 0, 1.0), [PeerCapacity(W1, 10**9, 1.0)], term=4, version=version)


def test_the_worker_role_keeps_one_plan_ready_event_per_term_not_one_per_re_plan(setup, tmp_path):
    model, shape, _ = setup

    async def main():
        role, link = worker_role(tmp_path, load_model(model.path)), CoordLink()
        try:
            for version in range(1, 5):
                await role._on_plan(link, one_worker_plan(shape, version).to_message())
                assert role.server.serves(4, version)
        finally:
            role.stop()
        return list(role._plans_ready), link.sent

    ready, sent = asyncio.run(main())
    assert ready == [(4, 4)] and sent == []


def test_a_plan_whose_slices_cannot_come_is_answered_bad_plan_and_the_link_kept(setup, tmp_path):
    model, shape, _ = setup
    plan = one_worker_plan(shape, 1)
    spec = specs_for(plan, W1)[0]
    blob, meta = ModelSlicer(model.path).extract(spec)
    meta["shape"] = dataclasses.asdict(shape)

    async def main():
        role, link = worker_role(tmp_path, None), CoordLink()
        link.is_open = False  # the link to the weights' source closes before the slice comes
        fetcher = role._fetchers[COORD] = SliceFetcher(link, model.content_hash(), SliceCache(tmp_path / "cache"))
        fetcher.offers.put_nowait(build_manifest(blob, meta))
        try:
            await role._on_plan(link, plan.to_message())  # PeerLostError inside: answered, not raised
        finally:
            role.stop()
        return link.sent

    (answer,) = asyncio.run(main())
    assert isinstance(answer, M.Error) and answer.code == "bad_plan" and "closed while fetching" in answer.message


def test_a_stopped_worker_role_serves_no_request(setup, tmp_path):
    """While `join` closes its links after the roles stopped, a request that still arrives gets
    no answer (its rows are recomputed by the coordinator), not a shut-down executor's error."""

    async def main():
        role, link = worker_role(tmp_path, None), CoordLink()
        msg = M.DenseRequest(1, 4, 1, 0, ((0, 8),), x_rows(2))
        await role._serve(link, msg, None)  # no model here: refused with a reason
        role.stop()
        await role._serve(link, msg, None)
        return link.sent

    (answer,) = asyncio.run(main())
    assert isinstance(answer, M.Error) and answer.code == "model"
