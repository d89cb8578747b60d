"""A swarm computes with its coordinator's numerics (docs/weights.md, "Two numerics"): the
coordinator role plans over fake links carrying every message through the real wire codec, and
gives work only to peers of its own numerics — under int8 only to peers of its own build, whose
answers it recomputes to the bit. A peer left out is recorded once, never marked down, and a page
left out is told why (Standby ``other_numerics``)."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.compute import numerics
from swarm.peer.net import messages as M
from swarm.peer.node import numeric_build
from tests.peer._swarm_models import peer_id
from tests.peer.coordinator.test_standby import (  # noqa: F401  (model: a fixture)
    OLD_PAGE, PAGE, READS, FakeLink, coordinator, hello, model, plan_and_announce)

SAME, OTHER_BUILD, OTHER_NUMERICS = peer_id("same"), peer_id("other-build"), peer_id("other-numerics")
READS_NUMERICS = READS.replace("notices:standby", "notices:standby,other_numerics")  # this release's page


@pytest.fixture
def restored_numerics(monkeypatch):
    """The process's numerics as they were, restored after the test; the environment untouched."""
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)


def python_peer(peer: str, build: M.NumericBuild, model_hash: str) -> FakeLink:
    h = dataclasses.replace(hello(peer, kind="python", blas=build.blas, gflops=50.0, model_hash=model_hash),
                            build=build)
    return FakeLink(peer, h)


def _links(model, ours: M.NumericBuild, theirs: M.NumericBuild) -> list[FakeLink]:
    other_build = dataclasses.replace(ours, numpy=ours.numpy + ".post1")  # same numerics, another build
    return [FakeLink(PAGE, hello(PAGE, blas=READS_NUMERICS)), python_peer(SAME, ours, model.content_hash()),
            python_peer(OTHER_BUILD, other_build, model.content_hash()),
            python_peer(OTHER_NUMERICS, theirs, model.content_hash()), FakeLink(OLD_PAGE, hello(OLD_PAGE))]


def test_an_int8_coordinator_gives_work_only_to_its_own_build(tmp_path, model, restored_numerics):
    numerics.set_numerics("float32")
    theirs = numeric_build()
    numerics.set_numerics("int8")
    ours = numeric_build()
    assert (ours.numerics, theirs.numerics) == ("int8", "float32")
    links = _links(model, ours, theirs)
    role = coordinator(tmp_path, model, "ranges", links)
    assert role.node.hello.build == ours
    for _ in range(2):  # a second plan records nothing again
        plan = plan_and_announce(role)
    assert set(plan.workers()) - {role.node.peer_id} == {SAME}
    left = [e for e in role.node.activity if e["what"] == "left out"]
    assert sorted(e["peer_id"] for e in left) == sorted([PAGE, OTHER_BUILD, OTHER_NUMERICS, OLD_PAGE])
    by_peer = {e["peer_id"]: e["detail"] for e in left}
    assert by_peer[OTHER_NUMERICS] == "it computes float32, this coordinator int8"
    assert "another build of the int8 numerics" in by_peer[OTHER_BUILD] and ".post1" in by_peer[OTHER_BUILD]
    assert not role._failed_at and not any(e["what"] == "marked down" for e in role.node.activity)
    (notice,) = links[0].of(M.Standby)[-1:]
    assert notice.reason == "other_numerics" and notice.version == plan.version
    assert notice.message == "this swarm's coordinator computes with the int8 numerics, which this page's kernels do not give"
    assert role.node.placement["standby"][PAGE]["reason"] == "other_numerics"
    # a page that reads Standby but not this later reason would refuse the frame: it is sent none,
    # and status still says why it stands by
    assert links[-1].of(M.Standby) == [] and role.node.placement["standby"][OLD_PAGE]["reason"] == "other_numerics"


def test_a_float32_coordinator_leaves_out_int8_peers_only(tmp_path, model, restored_numerics):
    numerics.set_numerics("int8")
    theirs = numeric_build()
    numerics.set_numerics("float32")
    ours = numeric_build()
    links = _links(model, ours, theirs)
    role = coordinator(tmp_path, model, "ranges", links)
    plan = plan_and_announce(role)
    # another float32 build and a page are checked within the bound of float reassociation, as before
    assert set(plan.workers()) - {role.node.peer_id} == {PAGE, SAME, OTHER_BUILD, OLD_PAGE}
    left = [e for e in role.node.activity if e["what"] == "left out"]
    assert [(e["peer_id"], e["detail"]) for e in left] == [(OTHER_NUMERICS, "it computes int8, this coordinator float32")]
    assert not links[0].of(M.Standby)


def test_the_standby_reasons_of_python_and_the_page_agree():
    # The page decodes a Standby's reason against its own list (web_peer/wire.js): one reason
    # missing there and the page would refuse the frame and drop its link.
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "web_peer" / "wire.js").read_text()
    (js,) = re.findall(r"export const STANDBY_REASONS = \[([^\]]*)\];", text)
    assert tuple(re.findall(r'"([a-z_]+)"', js)) == M.STANDBY_REASONS
    assert "other_numerics" in M.STANDBY_REASONS
    main = (Path(__file__).resolve().parents[3] / "web_peer" / "main.js").read_text()
    assert "notices:standby,other_numerics" in main  # this release's page reads it


def test_a_peer_that_left_and_returns_is_noted_again(tmp_path, model, restored_numerics):
    numerics.set_numerics("int8")
    theirs = numeric_build()
    numerics.set_numerics("float32")
    link = python_peer(OTHER_NUMERICS, theirs, model.content_hash())
    role = coordinator(tmp_path, model, "ranges", [link])
    plan_and_announce(role)
    del role.node.links[OTHER_NUMERICS]
    plan_and_announce(role)
    role.node.links[OTHER_NUMERICS] = link
    plan_and_announce(role)
    assert [e["peer_id"] for e in role.node.activity if e["what"] == "left out"] == [OTHER_NUMERICS] * 2


GPU = peer_id("int8-gpu")


def _int8_gpu_peer(ours: M.NumericBuild, model_hash: str, x8: str = "q4_k,q6_k,q8_0") -> FakeLink:
    build = dataclasses.replace(ours, blas=f"wgpu 0.32.0 Vulkan x8:{x8} adapter:llvmpipe")  # GpuFfn.build()
    assert build.numerics == "int8" and build.gpu_adapter == "llvmpipe"
    return python_peer(GPU, build, model_hash)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    import gguf

    from swarm.compute.model import load_model
    from tests.compute.tiny_gguf import write_gguf_from_hf
    from tests.compute.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("q8")
    hf, _ = build_tiny("qwen3_moe", root / "hf", intermediate_size=128, moe_intermediate_size=64)
    return load_model(write_gguf_from_hf(hf, "qwen3_moe", root / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("layout", ["ranges", "auto", "stages"])
def test_an_int8_coordinator_gives_ranges_to_an_int8_gpu_peer_of_a_model_its_gemvs_read(tmp_path, q8_model,
                                                                                        restored_numerics, layout):
    numerics.set_numerics("int8")
    ours = numeric_build()
    role = coordinator(tmp_path, q8_model, layout, [_int8_gpu_peer(ours, q8_model.content_hash())])
    plan = plan_and_announce(role)
    # priced by its announced speed, as a GPU peer (a tiny model: the cost model may keep it local)
    assert GPU in plan.workers() or layout != "ranges"
    stages = role.planning.stage_layout
    assert stages is None or GPU not in {s.peer for s in stages.stages}  # ranges only: no stage
    assert not [e for e in role.node.activity if e["what"] == "left out"]


def test_an_int8_gpu_peer_is_left_out_for_a_model_its_gemvs_do_not_read(tmp_path, model, restored_numerics):
    numerics.set_numerics("int8")
    ours = numeric_build()
    role = coordinator(tmp_path, model, "ranges", [_int8_gpu_peer(ours, model.content_hash())])
    plan = plan_and_announce(role)
    assert GPU not in plan.workers()
    (left,) = [e for e in role.node.activity if e["what"] == "left out"]
    assert left["peer_id"] == GPU and "GPU peer of the int8 numerics" in left["detail"]
    assert "is F32" in left["detail"] and "Q4_K, Q6_K, Q8_0" in left["detail"]  # names the type
    assert not role._failed_at


def test_an_int8_gpu_peer_is_left_out_for_a_type_its_own_gemvs_do_not_read(tmp_path, q8_model, restored_numerics):
    numerics.set_numerics("int8")
    role = coordinator(tmp_path, q8_model, "ranges", [_int8_gpu_peer(numeric_build(), q8_model.content_hash(), "q4_k")])
    assert GPU not in plan_and_announce(role).workers()
    (left,) = [e for e in role.node.activity if e["what"] == "left out"]
    assert "is Q8_0; its int8 GEMVs read Q4_K" in left["detail"]
