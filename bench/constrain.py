"""Per-token cost of constrained decoding (a JSON schema) with llguidance and xgrammar, at the
default model's vocabulary: the time to compute one token's mask, and to apply it to the logits.

A walk of ``--tokens`` steps: at each, the library computes the mask of allowed tokens, the mask
is applied to random logits [V] f32, and a token is fed back: the best allowed, but every third
step an allowed quote, brace, bracket, comma, colon or digit when there is one, so the walk leaves
strings and crosses the object's structure as a reply does. ``mask`` is the library's time per step (the
mask, plus taking the token: a library may compute ahead there); ``apply``, numpy's or torch's.
Prints JSON (median and p90 per step, in ms).

    python3 bench/constrain.py [--tokens 200] [--vocab 150000]

``--vocab N`` above the model's grows its vocabulary to N entries, each new one two of its
tokens joined (so the entries stay text-like), to measure a larger vocabulary's masks (Qwen's
is ~151k) without its files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "city": {"type": "string"}},
    "required": ["name", "age", "tags", "city"], "additionalProperties": False}


def _stats(times_s: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times_s)
    return {"median_ms": round(statistics.median(ms), 4), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
            "steps": len(ms)}


def bench_llguidance(tok, tokens: int, rng: np.random.Generator) -> dict:
    import llguidance
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids[0])
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    mask = lln.allocate_token_bitmask(1, tok.vocab_size)
    structural = _structural(tok)
    mask_s, apply_s, out = [], [], []
    for _ in range(tokens):
        if matcher.is_stopped():
            break
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, mask)
        t1 = time.perf_counter()
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        t2 = time.perf_counter()
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:tok.vocab_size].astype(bool)
        logits[~allowed] = -np.inf
        t3 = time.perf_counter()
        token = _pick(logits, allowed, structural, len(out))
        t4 = time.perf_counter()
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
        mask_s.append(t1 - t0 + time.perf_counter() - t4)
        apply_s.append(t3 - t2)
    return {"library": f"llguidance {_version('llguidance')}",
            "tokenizer_setup_s": round(setup, 3), "schema_compile_s": round(compile_s, 4),
            "mask": _stats(mask_s), "apply": _stats(apply_s), "text": tok.decode(out)[:120]}


def bench_xgrammar(tok, tokens: int, rng: np.random.Generator) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(_hf(tok), vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    structural = _structural(tok)
    mask_s, apply_s, out = [], [], []
    for _ in range(tokens):
        if matcher.is_terminated():
            break
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        t1 = time.perf_counter()
        logits = torch.from_numpy(rng.standard_normal(tok.vocab_size).astype(np.float32))[None]
        t2 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, mask)
        t3 = time.perf_counter()
        token = _pick(logits[0].numpy(), torch.isfinite(logits[0]).numpy(), structural, len(out))
        t4 = time.perf_counter()
        assert matcher.accept_token(token)
        out.append(token)
        mask_s.append(t1 - t0 + time.perf_counter() - t4)
        apply_s.append(t3 - t2)
    return {"library": f"xgrammar {_version('xgrammar')}", "tokenizer_setup_s": round(setup, 3),
            "schema_compile_s": round(compile_s, 4), "mask": _stats(mask_s), "apply": _stats(apply_s),
            "text": tok.decode(out)[:120]}


def _structural(tok) -> np.ndarray:
    """Ids of one-character tokens that end or open JSON values."""
    return np.array([tok.encode(c, add_special_tokens=False)[0] for c in '"}],{[:1'], np.int64)


def _pick(logits: np.ndarray, allowed: np.ndarray, structural: np.ndarray, step: int) -> int:
    """Every third step an allowed structural token when there is one, else the best allowed."""
    if step % 3 == 0:
        ok = structural[allowed[structural]]
        if ok.size:
            return int(ok[0])
    return int(np.argmax(np.where(allowed, logits, -np.inf)))


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _hf(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, eos_token=tok.tokenizer.id_to_token(tok.eos_token_ids[0]))


def _grown(tok, n: int):
    """``tok`` with its BPE vocabulary grown to ``n`` entries (new ids after the old ones)."""
    import dataclasses

    from tokenizers import Tokenizer

    state = json.loads(tok.tokenizer.to_str())
    vocab = state["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    rng = np.random.default_rng(1)
    next_id = max(tok.vocab_size, max(vocab.values()) + 1)
    while next_id < n:
        a, b = pieces[rng.integers(len(pieces))], pieces[rng.integers(len(pieces))]
        if a + b not in vocab:
            vocab[a + b] = next_id
            next_id += 1
    for added in state.get("added_tokens", []):
        vocab.pop(added["content"], None)
    return dataclasses.replace(tok, tokenizer=Tokenizer.from_str(json.dumps(state)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=0, help="grow the vocabulary to this many entries")
    args = ap.parse_args()
    from swarm.compute.default_model import default_model_path
    from swarm.compute.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    if args.vocab > tok.vocab_size:
        tok = _grown(tok, args.vocab)
    results = {"vocab": tok.vocab_size, "schema": SCHEMA}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            results[name] = fn(tok, args.tokens, np.random.default_rng(0))
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
