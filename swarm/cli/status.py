"""``colibri-swarm status [--json] [--watch]``: print the swarm as the local peer's status file
tells it (:mod:`swarm.peer.status`). Reads a file only: it loads no WebRTC stack."""

from __future__ import annotations

import json
import time
from typing import Any

from swarm.errors import SwarmError
from swarm.peer.status import WATCH_EVENTS, WATCH_EVERY_S, WIDTH, read_status, render


def main_status(args: Any) -> int:
    from rich.text import Text

    from swarm.terminal import console as terminal_console

    if args.json:
        print(json.dumps(read_status(), indent=2))
        return 0
    console = terminal_console()
    if not getattr(args, "watch", False):
        console.print(render(read_status(), width=min(console.width, WIDTH)))
        return 0
    if not console.is_terminal:  # no cursor to redraw with: a plain snapshot per interval, never silence
        try:
            while True:
                console.print(_view_or_error(), Text(f"-- {time.strftime('%H:%M:%S')}"))
                console.file.flush()
                time.sleep(WATCH_EVERY_S)
        except KeyboardInterrupt:
            pass
        return 0
    from rich.live import Live

    with Live(_view_or_error(), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(WATCH_EVERY_S)
                live.update(_view_or_error(), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0


def _view_or_error() -> Any:
    """The view of the status file now, or the reason there is none (watching goes on)."""
    from rich.text import Text

    try:
        return render(read_status(), events=WATCH_EVENTS)
    except SwarmError as exc:
        return Text(f"{exc}\n(watching: Ctrl-C to stop)", style="yellow")
