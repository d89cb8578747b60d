"""Sampling and the generation loop (a generator of token ids).

Order of the filters follows transformers' ``LogitsProcessor`` chain for
``generate(do_sample=True)``: temperature, then top-k, then top-p (nucleus; the
smallest set of most likely tokens whose probability reaches ``top_p``).
``temperature`` below :data:`TEMPERATURE_FLOOR` means greedy (argmax; ties to the lowest
id), as vLLM does (its ``_SAMPLING_EPS``): dividing by a smaller temperature overflows float32
into NaN probabilities, and the distribution is one-hot well before that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from swarm.compute.kernels import softmax

F32 = np.float32
TEMPERATURE_FLOOR = 1e-5  # below this, sampling is greedy
# Prompt rows per forward call while prefilling: bounds one step's time (running streams keep
# flowing between chunks) and its scratch memory. A row's bits do not depend on it: every
# kernel computes a row from that row alone (swarm/compute/quant.py).
PREFILL_CHUNK = 64


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` ≥ 0 (below :data:`TEMPERATURE_FLOOR`: greedy), ``top_k`` ≥ 0 (0: off), 0 < ``top_p`` ≤ 1,
    ``seed`` (None: fresh entropy), ``max_tokens`` ≥ 0, ``stop_tokens`` (ids that end the
    reply; the stop token itself is yielded last)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop_tokens: tuple[int, ...] = field(default=())

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
    """
    params = params or SamplingParams()
    rng = np.random.default_rng(params.seed)
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
        tok = sample(logits, params, rng)
        yield tok
        if tok in stops or i + 1 == params.max_tokens:
            return
        logits = model.forward([tok], cache, ffn=ffn, last_only=True)[0]
