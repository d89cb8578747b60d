"""A SwiGLU block of the int8 numerics cut at its down rows (swarm/compute/int8_swiglu.py): the
engine's bits through the cut, and the coordinator's check of a block answered by another build
— an honest one (its products summed in float64, then rounded: another order than the
engine's) passes, a lie of either kind (a changed down answer; down rows that do not round
SwiGLU, however self-consistent) does not. Real blocks of Q4_K, Q6_K and Q8_0 and the rigorous
bound of web_peer/int8_activations.py."""

from __future__ import annotations

import numpy as np
import pytest

from swarm.compute import numerics
from swarm.compute.int8_swiglu import check_int8_answer, swiglu_int8
from swarm.compute.kernels import MLPWeights, silu_mul, swiglu
from swarm.compute.quant import QT, QMatrix
from web_peer import int8_activations as X8
from web_peer import kernels as K

H, F = 512, 768
FORMATS = [("q4_k", "q6_k"), ("q6_k", "q4_k"), ("q8_0", "q8_0")]  # gate/up, down


@pytest.fixture(autouse=True)
def int8_numerics(monkeypatch):
    monkeypatch.setattr(numerics, "_numerics", numerics._numerics)
    numerics.set_numerics("int8")


def _block(rng, gate_up: str, down: str) -> MLPWeights:
    def mat(r, c, fmt):
        return QMatrix(K.random_blocks(rng, r, c, fmt, 2e-3), QT[fmt.upper()], c)
    return MLPWeights(mat(F, H, gate_up), mat(F, H, gate_up), mat(H, F, down))


def bound(m: QMatrix, rows: np.ndarray) -> np.ndarray:
    """The coordinator's: web_peer's rigorous bound on the file's blocks, any lane count."""
    fmt = K.block_format(m.qtype.name)
    return X8.blocks_bound(fmt, np.asarray(m.data).reshape(m.data.shape[0], -1, K.block_size(fmt)[1]), rows, 1)


def float64_products(products):
    """Another build's honest int8 products: the same integers, summed in float64 then rounded."""
    out = []
    for m, rows in products:
        q, dx, _ = X8.planes(K.block_format(m.qtype.name), rows, m.cols)
        x8 = q.astype(np.float64) * np.repeat(dx.astype(np.float64), m.cols // dx.shape[1], axis=1)
        out.append((x8 @ m.dequantize().astype(np.float64).T).astype(np.float32))
    return out


@pytest.mark.parametrize("fmts", FORMATS, ids="-".join)
def test_the_cut_block_gives_the_engines_bits_and_an_honest_other_build_passes(fmts):
    rng = np.random.default_rng(3)
    w = _block(rng, *fmts)
    x = (rng.standard_normal((3, H)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    y, rows = swiglu_int8(w, x)
    assert np.array_equal(y, swiglu(w, x))  # the engine's int8 block, through the cut
    assert check_int8_answer(w, x, y, rows, bound) is None
    y64, rows64 = swiglu_int8(w, x, float64_products)
    assert not np.array_equal(y64, y)  # another order: other bits
    assert check_int8_answer(w, x, y64, rows64, bound) is None


@pytest.mark.parametrize("fmts", FORMATS, ids="-".join)
def test_a_lie_of_either_kind_is_caught(fmts):
    rng = np.random.default_rng(4)
    w = _block(rng, *fmts)
    x = rng.standard_normal((2, H)).astype(np.float32)
    y, rows = swiglu_int8(w, x)
    scale = np.abs(y).max()
    for at, by in (((0, 3), 1e-4), ((1, 0), -1e-3)):  # a wrong down answer, the rows honest
        lie = y.copy()
        lie[at] += by * scale
        assert "beyond the int8 bound" in check_int8_answer(w, x, lie, rows, bound)
    # down rows that are a rounding of something else, the answer their own product
    g, u = (m.matmul(x) for m in (w.gate, w.up))
    h = silu_mul(g, u)
    for what in ("zeros", "one value", "another row"):
        other = h.copy()
        if what == "zeros":
            other[:] = 0.0
        elif what == "one value":
            j = int(np.argsort(np.abs(h[0]))[F // 2])  # a middling value moved three steps
            other[0, j] += 3 * np.abs(h[0, :256]).max() / 127 * np.sign(h[0, j] or 1.0)
        else:
            other = h[::-1].copy()
        bad = w.down.int8_rows(np.ascontiguousarray(other))
        why = check_int8_answer(w, x, w.down.matmul_int8_rows(bad), bad, bound)
        assert why is not None and "down-row" in why, (what, why)


def test_malformed_rows_are_refused_not_raised():
    rng = np.random.default_rng(5)
    w = _block(rng, "q4_k", "q6_k")
    x = rng.standard_normal((2, H)).astype(np.float32)
    y, rows = swiglu_int8(w, x)
    assert "expected uint8" in check_int8_answer(w, x, y, rows[:, :-64], bound)
    assert "expected uint8" in check_int8_answer(w, x, y, rows[:1], bound)
    nan = rows.copy()
    nan[0, F:F + 4] = np.array([np.nan], np.float32).view(np.uint8)
    assert "not finite" in check_int8_answer(w, x, y, nan, bound)
    low = rows.copy()
    low[1, 0] = 0x80  # -128
    assert "-128" in check_int8_answer(w, x, y, low, bound)
    pad = rows.copy()
    pad[0, -1] = 1
    assert "other bytes" in check_int8_answer(w, x, y, pad, bound)


@pytest.mark.parametrize("fmt", X8.X8_FORMATS)
def test_the_coarse_bound_holds_the_value_by_value_one(fmt):
    # M read from the sub-scales alone (the coordinator's, many times faster on K-quants) is never
    # below the value-by-value M, and at most a few times it
    rng = np.random.default_rng(6)
    m = QMatrix(K.random_blocks(rng, 300, 1024, fmt, 2e-3), QT[fmt.upper()], 1024)
    x = (rng.standard_normal((3, 1024)) * rng.uniform(1e-2, 1e2, (3, 1))).astype(np.float32)
    x[:, 256:288] = 0.0
    rows = m.int8_rows(x)
    blocks = np.asarray(m.data).reshape(300, -1, K.block_size(fmt)[1])
    exact, coarse = (X8.blocks_bound(fmt, blocks, rows, 1, coarse=c) for c in (False, True))
    assert (coarse >= exact).all() and (coarse <= 2.5 * exact).all()


def test_a_sampled_answer_of_many_rows_is_checked_on_a_few_drawn_after_it_came(monkeypatch):
    """The coordinator checks a sampled int8 answer on INT8_CHECKED_ROWS of its rows, drawn once
    it is here (a prompt's answer of thousands of rows took a minute and gigabytes to check whole):
    an honest one passes, a lie in every row is caught, rows of another count are refused."""
    import random

    from swarm.errors import VerificationError
    from swarm.peer.coordinator import dispatch
    from swarm.peer.coordinator.bounds import int8_product_bound
    from swarm.peer.net.messages import DenseAnswerInt8

    rng = np.random.default_rng(5)
    w = _block(rng, "q4_k", "q6_k")
    n = 40
    x = (rng.standard_normal((n, H)) * rng.uniform(0.1, 10, (n, 1))).astype(np.float32)
    y, rows = swiglu_int8(w, x, float64_products)  # another build's honest answer
    checked: list[int] = []

    def counting(w_, x_, y_, rows_, product_bound):
        checked.append(x_.shape[0])
        assert product_bound is int8_product_bound
        return check_int8_answer(w_, x_, y_, rows_, bound)

    monkeypatch.setattr(dispatch, "check_int8_answer", counting)
    coordinator = type("Coordinator", (), {"_rng": random.Random(1), "verified": 0})()

    def verify(answer: np.ndarray, down_rows: np.ndarray) -> None:
        msg = DenseAnswerInt8(1, 1, 1, 0, ((0, F),), answer[None], down_rows)
        dispatch.RemoteFFN._verify_int8(coordinator, "w1", 0, "dense 0:768", w, x, answer, msg)  # type: ignore[arg-type]

    verify(y, rows)
    assert checked == [dispatch.INT8_CHECKED_ROWS] and coordinator.verified == 1
    lie = y + 1e-3 * np.abs(y).max(axis=1, keepdims=True)
    with pytest.raises(VerificationError, match="beyond the int8 bound"):
        verify(lie, rows)
    with pytest.raises(VerificationError, match="39 down rows for 40 rows"):
        verify(y, rows[1:])


def test_the_bound_for_any_lane_count_is_the_widest_of_them():
    """``lanes=1`` bounds every lane count: for a narrow row (a Q8_0 down slice 64 wide, two
    blocks) a 32-lane slice's tree takes more roundings than one lane's chain, so its bound
    must be at least each of theirs."""
    rng = np.random.default_rng(9)
    m = QMatrix(K.random_blocks(rng, 16, 64, "q8_0", 2e-3), QT["Q8_0"], 64)
    rows = m.int8_rows((rng.standard_normal((2, 64)) * 3).astype(np.float32))
    blocks = np.asarray(m.data).reshape(16, -1, K.block_size("q8_0")[1])
    anyone = X8.blocks_bound("q8_0", blocks, rows, 1)
    for lanes in (2, 8, 32, 256):
        assert (anyone >= X8.blocks_bound("q8_0", blocks, rows, lanes)).all(), lanes
