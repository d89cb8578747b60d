"""SmolLM2-135M-Instruct (the real Q4_1 GGUF): the engine's greedy replies against transformers.

transformers reads the same file (``from_pretrained(dir, gguf_file=…)``) and decodes
greedily; the engine must give the same token ids, and the ``generate`` command must print
the same text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.compute import SamplingParams, generate
from swarm.compute.textgen import generate_text
from swarm.compute.tokenizer import messages_from, tokenizer_for

PROMPTS = [
    messages_from("What is the capital of France?"),
    messages_from("Write a haiku about rain."),
    messages_from("Explain photosynthesis in one sentence.", system="You are a concise science teacher."),
    [
        {"role": "user", "content": "Give me three fruits."},
        {"role": "assistant", "content": "Apple, banana, cherry."},
        {"role": "user", "content": "Now three colors, in 日本語 please."},
    ],
]
REPO = Path(__file__).resolve().parents[2]


_ORACLE_REPLIES: dict[tuple[str, int], list[int]] = {}


def _oracle_greedy(oracle, messages, n: int) -> list[int]:
    """transformers' greedy reply ids (up to and including EOS), memoized per prompt."""
    import torch

    model, tok = oracle
    key = (repr(messages), n)
    if key in _ORACLE_REPLIES:
        return _ORACLE_REPLIES[key]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    _ORACLE_REPLIES[key] = out[0, enc["input_ids"].shape[1]:].tolist()
    return _ORACLE_REPLIES[key]


@pytest.mark.slow
@pytest.mark.parametrize("messages", PROMPTS, ids=["capital", "haiku", "system", "multiturn"])
def test_greedy_32_tokens_match_transformers(smollm2_model, smollm2_oracle, messages):
    tokenizer = tokenizer_for(smollm2_model)
    prompt = tokenizer.encode_chat(messages)
    assert prompt == smollm2_oracle[1].apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ours = list(generate(smollm2_model, prompt, SamplingParams(max_tokens=32, stop_tokens=tokenizer.eos_token_ids)))
    want = _oracle_greedy(smollm2_oracle, messages, 32)
    assert ours == want


@pytest.mark.slow
def test_generate_text_streams_the_oracle_reply(smollm2_model, smollm2_oracle):
    messages = PROMPTS[0]
    want_ids = _oracle_greedy(smollm2_oracle, messages, 32)
    want = smollm2_oracle[1].decode(want_ids, skip_special_tokens=True)
    pieces = list(generate_text(smollm2_model, tokenizer_for(smollm2_model), messages, SamplingParams(max_tokens=32)))
    assert "".join(pieces) == want
    assert len(pieces) > 1 and all(pieces)  # streamed piece by piece, no empty writes


@pytest.mark.slow
def test_cli_generate_prints_the_oracle_text(smollm2_path, smollm2_oracle):
    """``colibri-swarm generate "…" --max-tokens 8`` with the default model, in a fresh process."""
    prompt = "Name a large animal."
    want_ids = _oracle_greedy(smollm2_oracle, messages_from(prompt), 8)
    want = smollm2_oracle[1].decode(want_ids, skip_special_tokens=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONIOENCODING="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "swarm", "generate", prompt, "--max-tokens", "8"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"
