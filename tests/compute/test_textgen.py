"""The ``generate`` command: argument checks, bad model files, and the text seam.

Every failure must be one line on stderr that names what was wrong (the flag, or the
file and its field/tensor), exit code 2, and no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.cli import EXIT_ERROR, main
from swarm.compute import SamplingParams, generate
from swarm.compute.textgen import generate_text
from swarm.compute.tokenizer import messages_from, tokenizer_for

REPO = Path(__file__).resolve().parents[2]


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--max-tokens", "0"], "--max-tokens 0: must be at least 1"),
        (["--temperature", "-1"], "--temperature -1.0: must be ≥ 0"),
        (["--temperature", "nan"], "--temperature nan"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k -3: must be ≥ 0"),
        (["--raw", "--system", "be brief"], "--system has no effect with --raw"),
    ],
)
def test_bad_arguments_name_the_flag(capsys, flags, needle):
    assert main(["generate", "hi", "--model", "/nonexistent/never-read.gguf", *flags]) == EXIT_ERROR
    assert needle in _error_line(capsys)


def _tiny_gguf(path: Path, arch: str) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_model_files(capsys, tmp_path, smollm2_path):
    missing = tmp_path / "absent.gguf"
    assert main(["generate", "hi", "--model", str(missing)]) == EXIT_ERROR
    assert f"{missing}: no such model file" in _error_line(capsys)

    truncated = tmp_path / "truncated.gguf"
    with smollm2_path.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(3_000_000))  # the header says 98 MB of tensors follow
    assert main(["generate", "hi", "--model", str(truncated)]) == EXIT_ERROR
    assert f"{truncated}: " in _error_line(capsys)

    unknown = _tiny_gguf(tmp_path / "unknown.gguf", "foo")
    assert main(["generate", "hi", "--model", str(unknown)]) == EXIT_ERROR
    line = _error_line(capsys)
    assert f"{unknown}: " in line and "general.architecture 'foo'" in line

    empty_dir = tmp_path / "hf"
    empty_dir.mkdir()
    assert main(["generate", "hi", "--model", str(empty_dir)]) == EXIT_ERROR
    assert "config.json" in _error_line(capsys)

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF")
    assert main(["generate", "hi", "--model", str(not_gguf)]) == EXIT_ERROR
    assert f"{not_gguf}: " in _error_line(capsys)


def test_gguf_without_tokenizer_is_named(capsys, tmp_path, smollm2_model):
    """A model whose weights load but whose tokenizer fields are gone: the field is named."""
    from swarm.compute.tokenizer import load_tokenizer
    from swarm.errors import ModelFileError

    metadata = {k: v for k, v in smollm2_model.metadata.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(ModelFileError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: GGUF metadata field "
                                             r"'tokenizer\.ggml\.merges' is missing"):
        load_tokenizer(smollm2_model.path, gguf_metadata=metadata)


def test_bad_file_in_a_fresh_process_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "swarm", "generate", "hi", "--model", str(bad)],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    assert done.returncode == EXIT_ERROR
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"colibri-swarm: error: {bad}: ")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_raw_prompt_is_encoded_without_the_template(smollm2_model):
    """--raw: the text goes to the engine as is; the reply equals decoding the engine's own ids."""
    tokenizer = tokenizer_for(smollm2_model)
    text = "The three primary colors are"
    params = SamplingParams(max_tokens=6)
    ids = list(generate(smollm2_model, tokenizer.encode(text), SamplingParams(max_tokens=6,
                                                                             stop_tokens=tokenizer.eos_token_ids)))
    ids = [i for i in ids if i not in tokenizer.eos_token_ids]
    assert "".join(generate_text(smollm2_model, tokenizer, text, params)) == tokenizer.decode(ids)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_through_the_seam(smollm2_model):
    tokenizer = tokenizer_for(smollm2_model)
    messages = messages_from("Tell me a short story about a cat.")
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    first = "".join(generate_text(smollm2_model, tokenizer, messages, params))
    again = "".join(generate_text(smollm2_model, tokenizer, messages, params))
    ids = list(generate(smollm2_model, tokenizer.encode_chat(messages), params))
    stop = [n for n, i in enumerate(ids) if i in tokenizer.eos_token_ids]
    assert first == again == tokenizer.decode(ids[: stop[0] if stop else len(ids)])


@pytest.mark.slow
def test_empty_prompt_is_refused_by_the_cli_and_an_empty_chat_turn_still_generates(capsys, smollm2_path,
                                                                                   smollm2_model):
    """The CLI refuses an empty prompt, chat or raw, in one line; the engine itself takes an
    empty user message (a valid chat: the template adds the turn markers)."""
    for raw in ([], ["--raw"]):
        assert main(["generate", "", *raw, "--model", str(smollm2_path), "--max-tokens", "2"]) == EXIT_ERROR
        assert "prompt is empty" in _error_line(capsys)
    out = list(generate_text(smollm2_model, tokenizer_for(smollm2_model), messages_from(""),
                             SamplingParams(max_tokens=2)))
    assert len(out) >= 1


def test_tokenizer_of_another_model_is_refused(smollm2_model):
    """Ids beyond the model's vocabulary: a clear ModelFileError, not an engine assertion."""
    from dataclasses import replace

    from swarm.errors import ModelFileError

    tokenizer = tokenizer_for(smollm2_model)
    small = replace(smollm2_model.config, vocab_size=100)

    class SmallVocab:
        config = small

    with pytest.raises(ModelFileError, match=r"Q4_1\.gguf: the tokenizer gave id \d+, but the model's vocabulary has 100"):
        next(generate_text(SmallVocab(), tokenizer, messages_from("hello"), SamplingParams(max_tokens=1)))


@pytest.mark.slow
def test_reader_closing_the_pipe_ends_quietly(smollm2_path):
    """`colibri-swarm generate … | head -c 5`: exit 141 (SIGPIPE's code), no traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm", "generate", "Count from one to one hundred in words.",
         "--model", str(smollm2_path), "--max-tokens", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO,
    )
    assert len(proc.stdout.read(5)) == 5
    proc.stdout.close()
    try:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 141
    finally:
        proc.kill()
    assert "Traceback" not in err


@pytest.mark.slow
def test_hf_directory_model_generates_like_transformers(tmp_path, capsys, smollm2_oracle):
    """--model DIR: a small random Llama saved by transformers with SmolLM2's tokenizer files
    (tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_oracle[1]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        max_position_embeddings=512, initializer_range=0.3,  # wide weights: decisive, varied argmax
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = "Hello there"
    enc = tokenizer.apply_chat_template(
        messages_from(prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=2)
    want_ids = out[0, enc["input_ids"].shape[1]:].tolist()
    assert len(set(want_ids)) > 2  # the oracle reply is not a degenerate repeat
    assert main(["generate", prompt, "--model", str(tmp_path), "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(want_ids, skip_special_tokens=True) + "\n"


def test_prompt_past_the_context_is_one_line_before_any_work(capsys, smollm2_path, smollm2_model):
    """prompt + --max-tokens past the model's context: one line naming the numbers, exit 2. When
    the prompt's bytes alone show it (at least bytes / the longest token's bytes tokens), before
    encoding: the line names the bytes and that bound; else the line names the counted tokens."""
    tok = tokenizer_for(smollm2_model)
    ctx = smollm2_model.config.max_position_embeddings
    text = tok.apply_chat_template(messages_from("hi"))
    nbytes, n = len(text.encode()), len(tok.encode_chat(messages_from("hi")))
    fewest = -(-nbytes // 81)  # SmolLM2's longest vocabulary entry is 81 bytes
    assert 0 < fewest < n and fewest + ctx > ctx
    assert main(["generate", "hi", "--local", "--model", str(smollm2_path), "--max-tokens", str(ctx)]) == EXIT_ERROR
    assert _error_line(capsys) == (f"colibri-swarm: error: the prompt in its chat template is {nbytes} bytes, so at "
                                   f"least {fewest} tokens (no token of this model stands for more than 81 bytes), "
                                   f"and max_tokens is {ctx}: more than the model's context of {ctx} tokens; shorten "
                                   "the prompt or ask for fewer tokens")
    # The bound fits, the counted tokens do not: refused once encoded, naming the count.
    most = ctx - n + 1
    assert fewest + most <= ctx
    assert main(["generate", "hi", "--local", "--model", str(smollm2_path), "--max-tokens", str(most)]) == EXIT_ERROR
    assert _error_line(capsys) == (f"colibri-swarm: error: the prompt is {n} tokens and max_tokens is {most}: "
                                   f"{ctx + 1} > the model's context of {ctx} tokens; shorten the prompt "
                                   "or ask for fewer tokens")


def test_sliding_window_is_the_limit_where_the_engine_cannot_pass_it():
    """A model with an attention window shorter than its context is limited by the window."""
    from types import SimpleNamespace

    from swarm.compute.textgen import context_limit

    assert context_limit(SimpleNamespace(max_position_embeddings=32768, sliding_window=4096)) == 4096
    assert context_limit(SimpleNamespace(max_position_embeddings=8192, sliding_window=None)) == 8192
    assert context_limit(SimpleNamespace(max_position_embeddings=0, sliding_window=None)) is None


def test_stats_count_the_stop_token_and_say_why_the_reply_ended(smollm2_model):
    """The one token loop the CLI and the API share reports what OpenAI's usage and finish_reason need."""
    from swarm.compute.textgen import GenerationStats, encode_prompt, stream_reply

    tok = tokenizer_for(smollm2_model)
    ids = encode_prompt(smollm2_model, tok, messages_from("Say OK."), 64)
    done = GenerationStats()
    toks = list(generate(smollm2_model, ids, SamplingParams(max_tokens=64, stop_tokens=tok.eos_token_ids)))
    text = "".join(stream_reply(smollm2_model, tok, ids, SamplingParams(max_tokens=64), stats=done))
    assert text == tok.decode([t for t in toks if t not in tok.eos_token_ids])
    assert (done.prompt_tokens, done.completion_tokens) == (len(ids), len(toks))
    assert done.finish_reason == ("stop" if toks[-1] in tok.eos_token_ids else "length")
    cut = GenerationStats()
    assert "".join(stream_reply(smollm2_model, tok, ids, SamplingParams(max_tokens=2), stats=cut))
    assert (cut.completion_tokens, cut.finish_reason) == (2, "length")


def test_a_servers_own_context_bounds_a_request_and_is_named(smollm2_model):
    """A server bound narrower than the model (a swarm's join --context: the KV cache its memory
    plan reserves) refuses prompt + max_tokens past it, naming that bound and the model's."""
    from swarm.compute.textgen import context_limit, encode_prompt
    from swarm.errors import ContextLengthError

    tok = tokenizer_for(smollm2_model)
    ctx = context_limit(smollm2_model.config)
    assert context_limit(smollm2_model.config, 64) == 64 and context_limit(smollm2_model.config, ctx * 2) == ctx
    ids = encode_prompt(smollm2_model, tok, "hello there", 8, context=64)
    with pytest.raises(ContextLengthError) as err:
        encode_prompt(smollm2_model, tok, "hello there", 64 - len(ids) + 1, context=64)
    assert str(err.value) == (f"the prompt is {len(ids)} tokens and max_tokens is {64 - len(ids) + 1}: 65 > this "
                              f"server's context of 64 tokens (its join --context; the model's is {ctx}); shorten "
                              "the prompt or ask for fewer tokens")
