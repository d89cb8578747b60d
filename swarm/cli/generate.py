"""``colibri-swarm generate PROMPT``: one reply, streamed to stdout — through the swarm's
coordinator (its OpenAI API, found as ``chat`` finds it) when asked or when a peer runs here, else
by the engine on this machine (:func:`swarm.compute.textgen.generate_text`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swarm.cli.chat import say_retrying
from swarm.compute.sampling import SamplingParams
from swarm.compute.textgen import MAX_TEMPERATURE, generate_text
from swarm.compute.tokenizer import messages_from, tokenizer_for
from swarm.errors import ModelFileError, SwarmError
from swarm.peer.client import (
    Endpoint, api_token, api_url_from_status, find_endpoint, local_peer, make_endpoint, request_body,
    stream_chat_retrying,
)


def main_generate_swarm(args: argparse.Namespace) -> int | None:
    """``generate`` through the swarm; None when no peer runs here and neither ``--swarm`` nor
    ``--api`` was given (the caller then runs the engine locally).

    Raises: SwarmError when a peer runs here (a worker) but no coordinator's API can be found:
    the user asked the swarm, so it does not silently run the model locally instead.
    """
    api = getattr(args, "api", None)
    endpoint = find_endpoint(api, mdns=True) if args.swarm or api else _quiet_endpoint()
    if endpoint is None:
        return None
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    body = request_body(messages, args)
    if getattr(args, "raw", False):  # no chat template: the API's text completion
        del body["messages"]
        body["prompt"] = args.prompt
    out = sys.stdout
    for piece in stream_chat_retrying(endpoint, body, rediscover=not api, on_retry=say_retrying):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def _quiet_endpoint() -> Endpoint | None:
    """The swarm's API when a peer runs here: its own when it coordinates, else the coordinator's
    mDNS record. None (no mDNS wait) when no peer runs here."""
    doc = local_peer()
    if doc is None:
        return None
    url = api_url_from_status(doc)
    if url is not None:
        return make_endpoint(url, api_token())
    try:
        return find_endpoint(None, mdns=True)
    except SwarmError as exc:
        raise SwarmError(f"a peer of the swarm runs here (role {doc.get('role')}), but {exc}; "
                         "or pass --local to run the model on this machine alone") from None


def main_generate(args: argparse.Namespace) -> int:
    """``colibri-swarm generate PROMPT``: stream a reply to stdout; return the exit code.

    Raises: :class:`~swarm.errors.SwarmError` subclasses for bad arguments, a model file
    that is missing, truncated or unsupported (:class:`~swarm.errors.ModelFileError`), or a
    failed default-model download; ``swarm.cli`` prints them as one line.
    """
    from swarm.compute.model import load_model

    params = SamplingParams(**sampling_kwargs(args))
    path = _model_path(args.model)
    messages: Sequence[Mapping[str, Any]] | str = (
        args.prompt if args.raw else messages_from(args.prompt, system=args.system)
    )
    out = sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(errors="replace")  # a non-UTF-8 terminal gets '?' rather than a crash
    # A spinner on stderr while the model loads and the prompt is prefilled (seconds on a large
    # model); it goes when the first piece of the reply is printed. A BrokenPipeError from a
    # closed stdout is swarm.cli's to handle.
    with _spinner(f"loading {path.name}") as status:
        model = load_model(path)
        tokenizer = tokenizer_for(model)
        status.update("reading the prompt")
        pieces = generate_text(model, tokenizer, messages, params)
        first = next(pieces, "")
    out.write(first)
    out.flush()
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def _spinner(text: str):
    """A transient one-line spinner on stderr (rich), shown only when stderr is a terminal."""
    from swarm.terminal import console

    return console(stderr=True).status(text, spinner="dots")


def _model_path(arg: str | None) -> Path:
    if arg is None:
        from swarm.compute.default_model import default_model_path

        return default_model_path(notice=lambda line: print(line, file=sys.stderr, flush=True))
    path = Path(arg).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such model file or directory (--model takes a GGUF file or an HF directory)")
    return path


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling options from the CLI (``generate`` and ``chat``), checked: keyword arguments of
    :class:`~swarm.compute.sampling.SamplingParams`.

    Raises: :class:`~swarm.errors.SwarmError`, one line naming the flag and its rule.
    """
    checks = [
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, "must be at least 1"),
        ("--temperature", args.temperature, 0.0 <= args.temperature <= MAX_TEMPERATURE,
         f"must be ≥ 0 and ≤ {MAX_TEMPERATURE:g} (0 = greedy)"),
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
