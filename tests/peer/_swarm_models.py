"""Tiny MoE checkpoints for the swarm tests: the engine tests' transformers-built ones
(tests/compute/tiny_models.py: configs and seeds committed, routers scaled so top-k is
decisive). Qwen3-MoE there has a dense layer (``mlp_only_layers``), so both the expert path
and the dense-range path of the swarm are exercised; Qwen2-MoE has a gated shared expert.
Also the helpers the swarm tests share: peer ids, a greedy run, a character tokenizer.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np

from tests.compute.tiny_models import MOE_FAMILIES, TINY, build_tiny

FAMILIES = MOE_FAMILIES


def peer_id(name: str) -> str:
    """A well-formed peer id (26 base32 characters) derived from ``name``."""
    return base64.b32encode(hashlib.sha256(name.encode()).digest()[:16]).decode().lower().rstrip("=")


COORD, W1, W2 = peer_id("coordinator"), peer_id("worker-1"), peer_id("worker-2")
VOCAB = {family: TINY[family][0]["vocab_size"] for family in FAMILIES}


def build(family: str, root: Path, variant: int = 0) -> Path:
    """Save the tiny ``family`` checkpoint under ``root`` and return its directory.

    ``variant`` > 0 nudges one weight: the same architecture, another model (another hash).
    """
    out = root / (family if variant == 0 else f"{family}-variant{variant}")
    build_tiny(family, out)
    if variant:
        from safetensors.numpy import load_file, save_file

        (file,) = sorted(out.glob("*.safetensors"))
        tensors = load_file(str(file))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + variant * 1e-3
        save_file(tensors, str(file), metadata={"format": "pt"})
    return out


PROMPT = [3, 17, 42, 91, 5, 64, 7, 1, 80, 33]  # token ids < 96, the tiny models' vocabulary


def greedy(model, ffn, prompt=PROMPT, n=12, on_step=None):
    """Prefill as one batch, then greedy decode; returns (tokens, [logits per step])."""
    cache = model.new_cache()
    logits = [model.forward(prompt, cache, ffn=ffn)]
    tokens = []
    for step in range(n):
        tok = int(np.argmax(logits[-1][-1]))
        tokens.append(tok)
        if on_step:
            on_step(step)
        logits.append(model.forward([tok], cache, ffn=ffn))
    return tokens, logits


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def add_char_tokenizer(model_dir: Path) -> Path:
    """Give a tiny checkpoint a tokenizer: token i is the printable ASCII character 32 + i (the
    vocabulary's first 95 ids), and a minimal chat template, so the API and the chat client
    can run on it."""
    from tokenizers import Tokenizer, decoders, models

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.BPE(vocab={chr(32 + i): i for i in range(min(vocab, 95))}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model_dir
