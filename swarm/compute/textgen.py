"""Text in, text out: the ``colibri-swarm generate`` command on top of the engine.

:func:`generate_text` is the seam between text and tokens: chat messages (or a raw
prompt) → chat template → token ids → the engine's token generator → streaming
detokenization → text pieces. It takes any model the engine's ``generate`` accepts;
the swarm's coordinator streams through the same path by passing its remote FFN backend.
:func:`main_generate` is the CLI around it: pick the model file (``--model`` or the
default model), check the arguments, stream the reply to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarm.compute.sampling import SamplingParams, generate
from swarm.compute.tokenizer import TextTokenizer, messages_from, tokenizer_for
from swarm.errors import ModelFileError, SwarmError

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the signal


def generate_text(
    model: Any,
    tokenizer: TextTokenizer,
    messages: Sequence[Mapping[str, Any]] | str,
    params: SamplingParams,
    *,
    ffn: Any = None,
) -> Iterator[str]:
    """Yield the reply to ``messages`` as text pieces, as soon as each is complete UTF-8.

    messages: chat messages (``[{"role", "content"}, ...]``), rendered with the checkpoint's
        chat template and its generation prompt; or a ``str``, encoded as is (with BOS when
        the checkpoint asks for it) — ``--raw``.
    params: sampling options; the end-of-sequence ids of the tokenizer and of the model
        config are added to ``params.stop_tokens``. A stop token ends the reply unprinted.
    ffn: the FFN backend handed to the engine's ``generate`` (None: local; the swarm passes
        its remote backend here).
    Raises: :class:`~swarm.errors.ChatTemplateError` if the template rejects the messages;
    :class:`~swarm.errors.ModelFileError` if the tokenizer yields ids outside the model's
    vocabulary.
    """
    if isinstance(messages, str):
        prompt_ids = tokenizer.encode(messages, add_special_tokens=True)
    else:
        prompt_ids = tokenizer.encode_chat(messages)
    if not prompt_ids:
        raise SwarmError("the prompt is empty after tokenization; give some text")
    vocab = model.config.vocab_size
    if max(prompt_ids) >= vocab:
        raise ModelFileError(
            f"{tokenizer.source}: the tokenizer gave id {max(prompt_ids)}, but the model's vocabulary "
            f"has {vocab} entries; the tokenizer files do not belong to this model"
        )
    stop = tuple(dict.fromkeys(
        [*params.stop_tokens, *tokenizer.eos_token_ids, *(getattr(model.config, "eos_token_ids", ()) or ())]
    ))
    decoder = tokenizer.stream_decoder()
    for token in generate(model, prompt_ids, replace(params, stop_tokens=stop), ffn=ffn):
        if token in stop:
            break
        if piece := decoder.push(token):
            yield piece
    if rest := decoder.flush():
        yield rest


def main_generate(args: argparse.Namespace) -> int:
    """``colibri-swarm generate PROMPT``: stream a reply to stdout; return the exit code.

    Raises: :class:`~swarm.errors.SwarmError` subclasses for bad arguments, a model file
    that is missing, truncated or unsupported (:class:`~swarm.errors.ModelFileError`), or a
    failed default-model download; ``swarm.cli`` prints them as one line.
    """
    from swarm.compute.model import load_model

    params = SamplingParams(**_sampling_kwargs(args))
    if getattr(args, "swarm", False):
        raise SwarmError("generate --swarm: running through a swarm is not available in this build; drop --swarm")
    if args.raw and args.system is not None:
        raise SwarmError("--system has no effect with --raw (no chat template is applied); drop one of them")
    path = _model_path(args.model)
    model = load_model(path)
    tokenizer = tokenizer_for(model)
    messages: Sequence[Mapping[str, Any]] | str = (
        args.prompt if args.raw else messages_from(args.prompt, system=args.system)
    )
    out = sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")  # a non-UTF-8 terminal gets '?' rather than a crash
    try:
        for piece in generate_text(model, tokenizer, messages, params):
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
    except BrokenPipeError:
        # The reader went away (`… | head`): stop generating, and point stdout at /dev/null so
        # the interpreter's final flush does not raise again (Python docs, "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        return EXIT_BROKEN_PIPE
    return 0


def _model_path(arg: str | None) -> Path:
    if arg is None:
        from swarm.compute.default_model import default_model_path

        return default_model_path()
    path = Path(arg).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such model file or directory (--model takes a GGUF file or an HF directory)")
    return path


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling options from the CLI, checked; a bad value is a one-line error naming the flag."""
    checks = [
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, "must be at least 1"),
        ("--temperature", args.temperature, args.temperature >= 0.0, "must be ≥ 0 (0 = greedy)"),
        ("--top-p", args.top_p, 0.0 < args.top_p <= 1.0, "must be in (0, 1]"),
        ("--top-k", args.top_k, args.top_k >= 0, "must be ≥ 0 (0 = all tokens)"),
    ]
    for flag, value, ok, rule in checks:
        if not ok:
            raise SwarmError(f"{flag} {value}: {rule}")
    return dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
