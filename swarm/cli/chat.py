"""``colibri-swarm generate`` through the swarm, and ``colibri-swarm chat``: both stream from the
coordinator's OpenAI API (:mod:`swarm.peer.client` finds it and speaks to it)."""

from __future__ import annotations

import argparse
import sys

from swarm.errors import SwarmError
from swarm.peer.client import (
    RETRY_S, Endpoint, api_token, api_url_from_status, find_endpoint, local_peer, make_endpoint, request_body,
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
    for piece in stream_chat_retrying(endpoint, body, rediscover=not api, on_retry=_say_retrying):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def _say_retrying(exc: SwarmError) -> None:
    print(f"\n[{exc}; trying the next coordinator, for up to {RETRY_S:g} s]", file=sys.stderr, flush=True)


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


HELP = "/reset clears the conversation, /exit (or Ctrl-D) leaves"


def main_chat(args: argparse.Namespace, *, input_fn=input) -> int:
    """``colibri-swarm chat``: a REPL with history, streamed through the coordinator's API."""
    from swarm.terminal import console as terminal_console
    from swarm.terminal import esc

    console = terminal_console(soft_wrap=False)
    endpoint = find_endpoint(args.api)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    console.print(f"[dim]colibri-swarm chat via {esc(endpoint.url)} — {HELP}[/]")
    while True:
        try:
            line = input_fn("> ")
        except EOFError:
            console.print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(system)
            console.print("[dim]conversation cleared[/]")
            continue
        if text.startswith("/"):
            console.print(f"[yellow]unknown command {esc(text.split()[0])}[/]; {HELP}")
            continue
        history.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            for piece in stream_chat_retrying(endpoint, request_body(history, args), rediscover=not args.api,
                                              on_retry=_say_retrying):
                reply.append(piece)
                console.print(piece, end="", markup=False, soft_wrap=True)
        except SwarmError as exc:
            history.pop()  # the turn did not happen; the user may retry it
            console.print(f"\n[red]{esc(exc)}[/]")
            continue
        console.print()
        history.append({"role": "assistant", "content": "".join(reply)})
