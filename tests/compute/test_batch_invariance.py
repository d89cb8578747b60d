"""A row's result depends only on the row: attention, the router, every QMatrix encoding, a
model layer and the whole forward pass give the same bits for a row computed in one call of T
rows, in splits (one row at a time, ragged chunks), and beside other sequences' rows — T from 1
to 200, across SMALL_T (the most rows one block-kernel call takes)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from swarm.compute.kernels import attention
from swarm.compute.model import load_model
from swarm.compute.quant import SMALL_T, QMatrix
from tests.compute.test_quant_kernels import K_QUANTS, PLAIN, QUANTIZED, encoded
from tests.compute.tiny_gguf import write_gguf_from_hf

F32 = np.float32
T_MAX = 200
assert T_MAX > 3 * SMALL_T
# ragged cuts of 0..T_MAX: single rows, odd chunks, chunks just under, at and over SMALL_T
CUTS = [0, 1, 2, 9, 10, 10 + SMALL_T - 1, 10 + 2 * SMALL_T, 10 + 3 * SMALL_T + 1, T_MAX - 1, T_MAX]


def splits(T: int) -> list[list[tuple[int, int]]]:
    """Ways to cut rows 0..T into consecutive calls: one row each, and ragged chunks."""
    ragged = sorted({min(c, T) for c in CUTS})
    return [[(t, t + 1) for t in range(T)], list(zip(ragged[:-1], ragged[1:]))]


@pytest.mark.parametrize("T", [1, 3, SMALL_T + 1, T_MAX])
def test_attention_rows_do_not_depend_on_the_call(T):
    """Queries at positions start..start+T-1 in one call, or in any split (each part at its own
    start, the cache holding what follows it too), give the same bits; GQA, odd head dim."""
    rng = np.random.default_rng(T)
    nh, nkv, hd, start = 6, 2, 20, 5
    q = rng.normal(size=(T, nh, hd)).astype(F32)
    k = rng.normal(size=(nkv, start + T + 3, hd)).astype(F32)
    v = rng.normal(size=(nkv, start + T + 3, hd)).astype(F32)
    whole = attention(q, k, v, start)
    for cut in splits(T):
        got = np.concatenate([attention(q[a:b], k, v, start + a) for a, b in cut])
        assert np.array_equal(got, whole), cut
    # what lies past a query's position is never read
    k2, v2 = k.copy(), v.copy()
    k2[:, start + T:], v2[:, start + T:] = np.nan, np.nan
    assert np.array_equal(attention(q, k2, v2, start), whole)


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 8])
def test_blocked_attention_rows_are_rows_computed_alone(groups):
    """The kernel takes query rows several at a time per key/value head (a GQA group's heads,
    consecutive positions), sharing key and value loads; each row still gets the bits of that
    row computed alone (one query, one head): GQA groups 1..8, T and cached positions S on and
    off the blocks' and the eight-lane edges, a head dim with a tail past its last multiple of 8."""
    rng = np.random.default_rng(groups)
    nkv = 2
    nh = groups * nkv
    for T, start, hd in ((1, 0, 16), (1, 7, 16), (5, 8, 16), (9, 3, 20), (17, 15, 8), (33, 40, 24)):
        q = rng.normal(size=(T, nh, hd)).astype(F32)
        k = rng.normal(size=(nkv, start + T, hd)).astype(F32)
        v = rng.normal(size=(nkv, start + T, hd)).astype(F32)
        got = attention(q, k, v, start).reshape(T, nh, hd)
        for t in range(T):
            for h in range(nh):
                kvh = h // groups
                alone = attention(q[t:t + 1, h:h + 1], k[kvh:kvh + 1, :start + t + 1], v[kvh:kvh + 1, :start + t + 1],
                                  start + t)
                assert np.array_equal(got[t, h], alone[0]), (T, start, hd, t, h)


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS + PLAIN, ids=lambda q: q.name)
def test_qmatrix_rows_do_not_depend_on_the_call(qtype):
    """Every encoding, T = 1..T_MAX: a row alone, in ragged chunks, and inside a bigger batch
    with other rows around it give the same bits."""
    cols = 256
    m = QMatrix(encoded(qtype, 37, cols, 21), qtype, cols)
    x = np.random.default_rng(22).normal(size=(T_MAX, cols)).astype(F32)
    whole = m.matmul(x)
    for cut in splits(T_MAX):
        got = np.concatenate([m.matmul(x[a:b]) for a, b in cut])
        assert np.array_equal(got, whole), (qtype.name, cut[:3])
    for T in (2, SMALL_T, SMALL_T + 1, 2 * SMALL_T + 5):
        assert np.array_equal(m.matmul(x[T_MAX - T:]), whole[T_MAX - T:]), (qtype.name, T)


@pytest.fixture(scope="module", params=[("qwen2_moe", None), ("qwen2_moe", "Q4_1"), ("llama", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1] or 'F32'}")
def model(request, tiny, tmp_path_factory):
    """Qwen2-MoE (router, experts, a gated shared expert) in F32 and Q4_1, Llama (dense) in Q8_0."""
    family, qtype = request.param
    hf, path = tiny(family)
    if qtype is not None:
        path = write_gguf_from_hf(hf, family, tmp_path_factory.mktemp("gguf") / f"{family}.gguf",
                                  qtype=gguf.GGMLQuantizationType[qtype])
    return load_model(path)


def test_router_and_layer_rows_do_not_depend_on_the_call(model):
    c = model.config
    x = np.random.default_rng(5).normal(size=(T_MAX, c.hidden_size)).astype(F32)
    for layer in range(c.n_layers):
        if model.is_moe_layer(layer):
            whole = model.router_logits(layer, x)
            for cut in splits(T_MAX):
                assert np.array_equal(np.concatenate([model.router_logits(layer, x[a:b]) for a, b in cut]), whole)
    # one layer over a prefill of T_MAX positions, or the same positions fed in ragged chunks
    cache = model.new_cache()
    whole = model.layers(x, cache, 0, 0, 1)
    for cut in splits(T_MAX)[1:]:
        cache = model.new_cache()
        got = np.concatenate([model.layers(x[a:b], cache, a, 0, 1) for a, b in cut])
        assert np.array_equal(got, whole), cut


def test_forward_rows_do_not_depend_on_the_call(model):
    """Logits of a T_MAX-token prefill in one call, in ragged chunks, and through forward_batch
    beside other sequences' prefill and decode rows."""
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, model.config.vocab_size, T_MAX).tolist()
    whole = model.forward(tokens, model.new_cache())
    for cut in splits(T_MAX)[1:]:
        cache = model.new_cache()
        got = np.concatenate([model.forward(tokens[a:b], cache) for a, b in cut])
        assert np.array_equal(got, whole), cut
    # the same chunks, each step beside a 3-token sequence and a decode row of others
    cache, others = model.new_cache(), [model.new_cache(), model.new_cache()]
    ragged = splits(T_MAX)[1]
    for a, b in ragged:
        parts = [(rng.integers(0, model.config.vocab_size, 3).tolist(), others[0]), (tokens[a:b], cache),
                 (rng.integers(0, model.config.vocab_size, 1).tolist(), others[1])]
        got = model.forward_batch(parts)
        assert np.array_equal(got[1], whole[b - 1]), (a, b)
