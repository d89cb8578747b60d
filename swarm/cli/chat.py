"""``colibri-swarm chat``: a REPL streamed from the coordinator's OpenAI API
(:mod:`swarm.peer.client` finds it and speaks to it)."""

from __future__ import annotations

import argparse
import sys

from swarm.errors import SwarmError
from swarm.peer.client import RETRY_S, check_reachable, find_endpoint, request_body, stream_chat_retrying


def say_retrying(exc: SwarmError) -> None:
    """Tell the user a request is being retried on the next coordinator (stderr)."""
    print(f"\n[{exc}; trying the next coordinator, for up to {RETRY_S:g} s]", file=sys.stderr, flush=True)


HELP = "/reset clears the conversation, /exit (or Ctrl-D) leaves"


def main_chat(args: argparse.Namespace, *, input_fn=input) -> int:
    """``colibri-swarm chat``: a REPL with history, streamed through the coordinator's API."""
    from swarm.terminal import console as terminal_console
    from swarm.terminal import esc

    console = terminal_console(soft_wrap=False)
    endpoint = find_endpoint(args.api)
    if args.api:  # a named API that does not answer is said once, before the first turn (a found one
        check_reachable(endpoint)  # may be between coordinators: the turns look for the next one)
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
                                              on_retry=say_retrying):
                reply.append(piece)
                console.print(piece, end="", markup=False, soft_wrap=True)
        except SwarmError as exc:
            history.pop()  # the turn did not happen; the user may retry it
            console.print(f"\n[red]{esc(exc)}[/]")
            continue
        console.print()
        history.append({"role": "assistant", "content": "".join(reply)})
