"""Sampling and the generation loop (a generator of token ids).

Before any filter, a sequence's logits are adjusted by its request (:func:`adjust_logits`):
``logit_bias`` adds a constant per token id, then ``presence_penalty`` and
``frequency_penalty`` subtract, per token ``j`` generated ``c[j]`` times so far,
``c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`` (OpenAI API reference,
"Parameter details", frequency and presence penalties). All of it runs where the logits are
sampled — on the coordinator, after the forward pass — so the forward pass, and every peer's
part of it, is the same with or without them.

Order of the filters follows transformers' ``LogitsProcessor`` chain for
``generate(do_sample=True)``: temperature, then top-k, then top-p (nucleus; the
smallest set of most likely tokens whose probability reaches ``top_p``).
``temperature`` below :data:`TEMPERATURE_FLOOR` means greedy (argmax; ties to the lowest
id), as vLLM does (its ``_SAMPLING_EPS``): dividing by a smaller temperature overflows float32
into NaN probabilities, and the distribution is one-hot well before that.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from swarm.compute.kernels import softmax

F32 = np.float32
TEMPERATURE_FLOOR = 1e-5  # below this, sampling is greedy
# Prompt rows per forward call while prefilling: bounds one step's time (running streams keep
# flowing between chunks) and its scratch memory. A row's bits do not depend on it: every
# kernel computes a row from that row alone (swarm/compute/quant.py).
PREFILL_CHUNK = 64
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI)
MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's top_logprobs)


class Constraint(Protocol):
    """What a sequence's output must follow (:mod:`swarm.compute.constrain`): ``allowed()`` is
    the mask of the tokens that may come next (bool [V]); ``advance(token)`` takes the sampled one."""

    def allowed(self) -> np.ndarray: ...

    def advance(self, token: int) -> None: ...


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` ≥ 0 (below :data:`TEMPERATURE_FLOOR`: greedy), ``top_k`` ≥ 0 (0: off), 0 < ``top_p`` ≤ 1,
    ``seed`` (None: fresh entropy), ``max_tokens`` ≥ 0, ``stop_tokens`` (ids that end the
    reply; the stop token itself is yielded last); ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] and ``logit_bias`` (``(token id, bias)`` pairs, bias in
    [-100, 100]) adjust the logits (:func:`adjust_logits`); ``logprobs``: None reports none,
    ``k`` ≥ 0 reports each sampled token's log-probability and the ``k`` most likely tokens'
    (:class:`Sampled`); ``constraint``: makes each sequence's :class:`Constraint` (e.g. a
    :class:`~swarm.compute.constrain.JsonGrammar`), whose mask is applied after the adjustments;
    ``prompt_logprobs`` (with ``logprobs``): report the prompt's tokens too, each under the
    distribution after the tokens before it (:func:`scored`; the first token has none)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop_tokens: tuple[int, ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    constraint: Callable[[], Constraint] | None = field(default=None, compare=False)
    prompt_logprobs: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and self.seed < 0:  # numpy's default_rng refuses negative seeds
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS or t < 0 for t, b in self.logit_bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (how many alternatives to report)")

    @property
    def adjusts_logits(self) -> bool:
        """Whether :func:`adjust_logits` changes anything under these params."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class Sampled:
    """One sampled token. With ``params.logprobs`` set: ``logprob``, the token's log-probability
    under the model's distribution (the log-softmax of the raw logits, float32, before any
    adjustment or filter — what the model says, whatever the request did to pick), and ``top``:
    the ``params.logprobs`` most likely ``(id, logprob)``, most likely first (ties: lower id)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def adjust_logits(logits: np.ndarray, params: SamplingParams, counts: Mapping[int, int]) -> np.ndarray:
    """Logits [V] f32 with ``params.logit_bias`` added, then the presence and frequency
    penalties subtracted for the tokens generated so far (``counts``: id → times generated),
    in float32: ``z[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`` (OpenAI).
    Returns ``logits`` itself when nothing changes it, else a new array."""
    if not params.adjusts_logits:
        return logits
    z = logits.astype(F32, copy=True)
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), np.int64, len(params.logit_bias))
        z[ids] += np.array([b for _, b in params.logit_bias], F32)
    if counts and (params.presence_penalty or params.frequency_penalty):
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        c = np.fromiter(counts.values(), F32, len(counts))
        z[ids] -= c * F32(params.frequency_penalty) + F32(params.presence_penalty)
    return z


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of logits [V] in float32: ``z - max(z) - log(sum(exp(z - max(z))))``."""
    z = logits.astype(F32, copy=False)
    shifted = z - z.max()
    return shifted - np.log(np.add.reduce(np.exp(shifted), dtype=F32))


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(id, logprob)`` of ``logprobs`` [V], most likely first, ties to
    the lower id."""
    if k <= 0:
        return ()
    k = min(k, logprobs.size)
    best = np.argpartition(-logprobs, k - 1)[:k]
    best = best[np.lexsort((best, -logprobs[best]))]
    return tuple((int(i), float(logprobs[i])) for i in best)


class Sampler:
    """One sequence's sampling: its random generator (seeded by ``params.seed``), the counts
    of the tokens it generated (for the penalties) and its constraint. Calling it with the next
    logits [V] f32 picks a token (:func:`adjust_logits`, the constraint's mask — disallowed
    tokens to -inf —, then :func:`sample`) and counts it."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: Counter[int] = Counter()
        self.constraint = params.constraint() if params.constraint is not None else None

    def __call__(self, logits: np.ndarray) -> Sampled:
        params = self.params
        z = adjust_logits(logits, params, self.counts)
        if self.constraint is not None:
            z = np.where(self.constraint.allowed(), z, F32(-np.inf)).astype(F32, copy=False)
        token = sample(z, params, self.rng)
        if self.constraint is not None:
            self.constraint.advance(token)
        self.counts[token] += 1
        if params.logprobs is None:
            return Sampled(token)
        lp = log_softmax(logits)
        return Sampled(token, float(lp[token]), top_logprobs(lp, params.logprobs))


def scored(logits: np.ndarray, tokens: Sequence[int], k: int) -> list[Sampled]:
    """Each of ``tokens`` [n] as :class:`Sampled` under the matching row of ``logits`` [≥ n, V]
    f32 (row i: the distribution that ``tokens[i]`` was drawn from — for a prompt, the row of
    the token before it): its logprob and the ``k`` most likely, the log-softmax of the raw
    logits as for a sampled token."""
    out = []
    for i, token in enumerate(tokens):
        lp = log_softmax(logits[i])
        out.append(Sampled(int(token), float(lp[token]), top_logprobs(lp, k)))
    return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from logits [V] f32 under ``params``."""
    if params.temperature < TEMPERATURE_FLOOR:
        return int(np.argmax(logits))
    z = logits.astype(F32) / F32(params.temperature)
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z).astype(F32)
    p = softmax(z)
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order], dtype=np.float64)
        # keep tokens until the cumulative mass reaches top_p (always at least one)
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0)
    p64 = p.astype(np.float64)
    p64 /= p64.sum()
    return int(rng.choice(p64.size, p=p64))


def generate(model, prompt_tokens: Iterable[int], params: SamplingParams | None = None, *,
             cache=None, ffn=None) -> Iterator[int]:
    """Yield generated token ids one at a time.

    The prompt is prefilled in chunks of :data:`PREFILL_CHUNK` rows (as the batch scheduler
    cuts it); each new token is then decoded with the KV cache.
    Stops after ``params.max_tokens`` tokens or after yielding a stop token. ``ffn`` is the
    FFN backend (default: local). ``cache`` may carry an earlier conversation's prefix.
    Each token is picked by one :class:`Sampler`, as the batch scheduler picks it.
    """
    params = params or SamplingParams()
    sampler = Sampler(params)
    cache = cache if cache is not None else model.new_cache()
    tokens = list(prompt_tokens)
    if not tokens:
        raise ValueError("generate needs at least one prompt token")
    stops = set(params.stop_tokens)
    if params.max_tokens == 0:
        return
    for lo in range(0, len(tokens), PREFILL_CHUNK):
        logits = model.forward(tokens[lo:lo + PREFILL_CHUNK], cache, ffn=ffn, last_only=True)[0]
    for i in range(params.max_tokens):
        tok = sampler(logits).token
        yield tok
        if tok in stops or i + 1 == params.max_tokens:
            return
        logits = model.forward([tok], cache, ffn=ffn, last_only=True)[0]
