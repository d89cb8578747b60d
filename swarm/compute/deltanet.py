"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next's ``linear_attention`` layers) and the
recurrent state it keeps per sequence instead of a KV cache.

Theory of operation
-------------------
Per row the layer projects the normed hidden row to ``qkv`` [2·nk·dk + nv·dv] (queries, keys,
values of every head), the output gate ``z`` [nv·dv], ``b`` and ``a`` [nv]. ``qkv`` goes through
a causal depthwise convolution of K taps over the positions (the last K-1 input rows of the
sequence are the *conv state*) and SiLU; queries and keys are L2-normalised, queries scaled by
``dk**-0.5``. Each value head h reads query/key head ``h // (nv/nk)`` (transformers' grouped
order) or ``h % nk`` (llama.cpp's tiled order). With ``beta = sigmoid(b)`` and the decay
``g = A · softplus(a + dt_bias)`` (``A = -exp(A_log)`` < 0), each head's state S [dk, dv] takes,
position by position (Gated DeltaNet, Yang et al. 2024, eq. 10; transformers
``torch_recurrent_gated_delta_rule``)::

    S ← exp(g) · S
    S ← S + k ⊗ (beta · (v − Sᵀk))        the delta rule: write only what S does not predict
    o = Sᵀ q

then ``o`` is RMS-normed per head (weight [dv]), multiplied by ``silu(z)`` and projected out.

Chunking. Every prefill chunk runs the recurrence one position at a time with the same float32
operations on the same shapes as a decode step, so a chunk of any length, token-by-token
decoding and a batch of sequences (each its own state) give the same state and output bits.
(transformers' prefill uses a chunked closed form: equal up to float rounding, not bitwise.)

State. :class:`RecurrentState` holds one sequence's conv state [K-1, C] and recurrent state
[nv, dk, dv] of one layer and the position it has reached. Unlike KV rows, a state cannot be
cut back to an earlier position; it keeps the state before its last step too, so a step re-run
from the same position (a retried or resent step) is served. Rows from any other position need
the sequence from position 0 (:meth:`RecurrentState.at` raises ``ValueError``), which is how the
swarm rebuilds a moved stage: the coordinator replays the rows that entered it.

Shape legend: T rows, nk key heads of dk, nv value heads of dv, C = 2·nk·dk + nv·dv conv
channels, K conv taps, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from swarm.compute.config import ModelConfig
from swarm.compute.kernels import rms_norm, sigmoid, silu
from swarm.compute.quant import QMatrix

F32 = np.float32
L2_EPS = F32(1e-6)  # transformers' l2norm eps (the FLA library's)
SOFTPLUS_THRESHOLD = F32(20.0)  # torch.nn.functional.softplus: x itself above it


@dataclass(frozen=True)
class DeltaNetWeights:
    """One Gated DeltaNet layer: ``qkv`` [C, H], ``z`` [nv·dv, H], ``b`` and ``a`` [nv, H],
    ``out`` [H, nv·dv] (compact); ``conv`` [C, K], ``dt_bias`` [nv], ``A`` [nv] (= -exp(A_log)),
    ``norm`` [dv] and the layer's norms [H], float32."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    qkv: QMatrix
    z: QMatrix
    b: QMatrix
    a: QMatrix
    out: QMatrix
    conv: np.ndarray
    dt_bias: np.ndarray
    A: np.ndarray
    norm: np.ndarray


def load_deltanet_weights(checkpoint, layer: int) -> DeltaNetWeights:
    """Layer ``layer``'s Gated DeltaNet weights from a checkpoint (matrices compact)."""
    ck = checkpoint
    return DeltaNetWeights(
        attn_norm=ck.load("attn_norm", layer), ffn_norm=ck.load("ffn_norm", layer),
        qkv=ck.matrix("lin_qkv", layer), z=ck.matrix("lin_z", layer), b=ck.matrix("lin_b", layer),
        a=ck.matrix("lin_a", layer), out=ck.matrix("lin_out", layer), conv=ck.load("lin_conv", layer),
        dt_bias=ck.load("lin_dt", layer), A=ck.load("lin_decay", layer), norm=ck.load("lin_norm", layer))


class RecurrentState:
    """One sequence's Gated DeltaNet state in one layer (module docstring, "State").

    ``position``: positions consumed; ``conv`` [K-1, C] f32: the last K-1 pre-convolution rows;
    ``ssm`` [nv, dk, dv] f32: the recurrent state. The arrays are replaced, never written in
    place, so the previous step's stay valid as ``previous``."""

    def __init__(self, config: ModelConfig):
        c = config
        self._shapes = ((c.linear_conv_kernel - 1, conv_channels(c)),
                        (c.linear_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))
        self.position = 0
        self.conv, self.ssm = self._zeros()
        self.previous: tuple[int, np.ndarray, np.ndarray] | None = None

    def _zeros(self) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(self._shapes[0], F32), np.zeros(self._shapes[1], F32)

    def resumes(self, start: int) -> bool:
        """Whether rows from position ``start`` can run on this state."""
        return start in (0, self.position) or (self.previous is not None and self.previous[0] == start)

    def at(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """``(conv, ssm)`` at position ``start``: zeros at 0, the current state, or the one before
        the last step. Raises ValueError for any other position."""
        if start == 0:
            return self._zeros()
        if start == self.position:
            return self.conv, self.ssm
        if self.previous is not None and self.previous[0] == start:
            return self.previous[1], self.previous[2]
        raise ValueError(f"the recurrent state holds position {self.position}; rows from position {start} "
                         "need the sequence from position 0")

    def advance(self, start: int, end: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        """Record the state after positions ``start .. end-1`` (run from :meth:`at` ``(start)``)."""
        if start == self.position and start > 0:
            self.previous = (self.position, self.conv, self.ssm)
        elif start == 0:
            self.previous = None
        self.position, self.conv, self.ssm = end, conv, ssm


def conv_channels(c: ModelConfig) -> int:
    """C: the channels of the causal convolution (queries, keys and values of every head)."""
    return 2 * c.linear_key_heads * c.linear_key_head_dim + c.linear_value_heads * c.linear_value_head_dim


def key_head_of_value_head(c: ModelConfig) -> np.ndarray:
    """[nv] int64: the query/key head each value head reads (grouped, or tiled for llama.cpp's files)."""
    heads = np.arange(c.linear_value_heads)
    return heads % c.linear_key_heads if c.linear_v_tiled else heads // (c.linear_value_heads // c.linear_key_heads)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum(x²) + 1e-6)`` over the last axis, f32 (transformers ``l2norm``)."""
    return (x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)).astype(F32)


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``, ``x`` itself above 20 (torch's threshold), f32."""
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD)))).astype(F32)


def causal_conv(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution + SiLU of rows ``x`` [T, C] after the ``state`` rows [K-1, C]
    with taps ``w`` [C, K]; [T, C] f32. Tap by tap, each output row's bits depend only on its K
    input rows."""
    K, T = w.shape[1], x.shape[0]
    padded = np.concatenate([state, x])  # [K-1+T, C]
    acc = padded[0:T] * w[:, 0]
    for j in range(1, K):
        acc += padded[j:j + T] * w[:, j]
    return silu(acc)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                     ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence over T positions, one at a time: q, k [T, nv, dk] (per value head), v [T, nv, dv],
    decay = exp(g) and beta [T, nv], state ``ssm`` [nv, dk, dv], all float32 → (outputs [T, nv, dv],
    the new state: a new array, ``ssm`` is left as it was). Compiled: :mod:`swarm.compute.deltakernel`."""
    arrays = [np.ascontiguousarray(a, dtype=F32) for a in (q, k, v, decay, beta)]
    state = np.array(ssm, dtype=F32, order="C")  # copied: the caller may keep the old state
    out = np.empty(v.shape, F32)
    _kernel()(*arrays, state, out)
    return out, state


_delta_rule = None


def prepare_kernel() -> None:
    """Load (or, the first time on a machine, compile) the recurrence now, not in a first request."""
    _kernel()


def _kernel():
    """The compiled recurrence, loaded (or compiled once per machine) on first use, after the block
    kernels, which set numba's cache directory."""
    global _delta_rule
    if _delta_rule is None:
        from swarm.compute.kernels import prepare_row_kernels
        from swarm.compute.quant import compiling

        prepare_row_kernels()
        with compiling("Gated DeltaNet recurrence"):
            from swarm.compute.deltakernel import delta_rule

            _delta_rule = delta_rule
    return _delta_rule


def deltanet_attention(c: ModelConfig, w: DeltaNetWeights, layer: int, h: np.ndarray, seqs: list) -> np.ndarray:
    """Gated DeltaNet of the normed rows ``h`` [T, H] f32 of one or more sequences.

    ``seqs``: ``(first row, end row, cache, start position)`` per sequence; each runs from its
    cache's state of this layer at ``start`` (``cache.recurrent(layer)``) and leaves it at
    ``start + rows``. Projections run on the union of the rows (a row's result depends only on
    the row), the convolution and the recurrence per sequence. Returns [T, H] f32.
    Raises ValueError when a sequence's state cannot resume at its start (module docstring)."""
    T = h.shape[0]
    nk, nv, dk, dv = c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    states = [cache.recurrent(layer) for _, _, cache, _ in seqs]
    starts = [state.at(start) for state, (_, _, _, start) in zip(states, seqs)]  # all checked before any work
    qkv = w.qkv.matmul(h)  # [T, C]
    z = w.z.matmul(h).reshape(T, nv, dv)
    beta = sigmoid(w.b.matmul(h))  # [T, nv]
    decay = np.exp(w.A * softplus(w.a.matmul(h) + w.dt_bias)).astype(F32)  # [T, nv]
    heads = key_head_of_value_head(c)
    core = np.empty((T, nv, dv), F32)
    for (lo, hi, _, start), state, (conv0, ssm0) in zip(seqs, states, starts):
        mixed = causal_conv(qkv[lo:hi], conv0, w.conv)  # [t, C]
        t = hi - lo
        q = l2_normalize(mixed[:, :nk * dk].reshape(t, nk, dk)) * F32(dk ** -0.5)
        k = l2_normalize(mixed[:, nk * dk:2 * nk * dk].reshape(t, nk, dk))
        v = np.ascontiguousarray(mixed[:, 2 * nk * dk:].reshape(t, nv, dv))
        core[lo:hi], ssm = gated_delta_rule(np.ascontiguousarray(q[:, heads]), np.ascontiguousarray(k[:, heads]),
                                            v, decay[lo:hi], beta[lo:hi], ssm0)
        conv = np.concatenate([conv0, qkv[lo:hi]])[-(c.linear_conv_kernel - 1):]
        state.advance(start, start + t, np.ascontiguousarray(conv), ssm)
    gated = rms_norm(core, w.norm, c.rms_norm_eps) * silu(z)  # [T, nv, dv]
    return w.out.matmul(np.ascontiguousarray(gated.reshape(T, nv * dv), dtype=F32))
