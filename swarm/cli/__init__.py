"""The ``colibri-swarm`` command.

Parsing lives here; each subcommand's terminal side lives in this package (``join``,
``status``, ``chat``, ``generate``, ``key``), its work in the module that
owns it, and each is imported only when that subcommand runs, so ``colibri-swarm --help`` stays fast.
Every :class:`~swarm.errors.SwarmError` ends the command with one clear line on
stderr and a non-zero exit code, never a traceback; a reader that closes the pipe
(``colibri-swarm key | head``) ends any command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from swarm import __version__
from swarm.errors import SwarmError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the signal


def _int_at_least(low: int, what: str, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{what} must be at most {high}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    port = _int_at_least(1, "the port")(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"the port must be at most 65535, got {port}")
    return port


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a percentage from 0 to 100, got {text!r}") from None
    if not 0.0 <= value <= 100.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"a percentage from 0 to 100, got {text!r}")
    return value


def _signal_url(text: str) -> str:
    """Any documented form (HOST:PORT, https://, wss://) becomes the one WebSocket URL used downstream."""
    from swarm.signaling.address import SignalAddress

    try:
        return SignalAddress.parse(text).ws_url
    except SwarmError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _api_url(text: str) -> str:
    """An API base URL checked as the CLI parses it: http(s), a host, a valid port; a bare
    ``https://HOST:PORT`` gets the API's ``/v1`` path."""
    from urllib.parse import urlsplit

    form = "give it as https://HOST:PORT/v1 (or http:// for a coordinator run with --api-plain-http)"
    try:
        url = urlsplit(text.strip())
        port = url.port
    except ValueError as exc:  # a port that is not a number or out of 0-65535
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid URL ({exc}); {form}") from None
    if url.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL; {form}")
    if not url.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host; {form}")
    if port == 0:
        raise argparse.ArgumentTypeError(f"{text!r} names port 0; {form}")
    path = url.path.rstrip("/") or "/v1"
    return f"{url.scheme}://{url.netloc}{path}"


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a GGUF file (of a split one, NAME-00001-of-0000N.gguf, any shard) or a Hugging Face directory "
        "(config.json + *.safetensors); "
        "default: SmolLM2-135M-Instruct Q4_1, fetched once into the user cache",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens; 0 = all")
    p.add_argument("--seed", type=_int_at_least(0, "the seed"), default=None, help="random seed for sampling (≥ 0)")
    p.add_argument("--system", metavar="TEXT", help="system prompt for the chat template")


# swarm.compute.threads.MAX_THREADS (not imported here: numpy stays out of the CLI's start)
MAX_THREADS = 1024


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", metavar="N", type=_int_at_least(1, "--threads", MAX_THREADS),
                   help=f"compute on N threads, at most {MAX_THREADS} (default: $COLIBRI_SWARM_THREADS, else the "
                   "cores this process may use, CPU affinity and cgroup quota respected); results are the same "
                   "bits at any count")


_NUMERICS_HELP = ("how {whose} products treat their activations: float32 (the default; checked against the "
                  "transformers oracle) or int8, llama.cpp's numerics: activation rows quantized to 8 bits, faster "
                  "prefill and decode on Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weights where the CPU "
                  "has AVX-512 VNNI or AVX2 (elsewhere, as on ARM, faster only on K-quants, slower on blocks of 32), "
                  "its first compile taking minutes, each product "
                  "off by up to a few percent of its largest output; {where} (also $COLIBRI_SWARM_NUMERICS)")


def _add_numerics_arg(p: argparse.ArgumentParser, peer: bool = False) -> None:
    # Names as in swarm.compute.numerics.CHOICES (a light module: os only).
    where = ("a coordinator gives work only to peers of its own numerics (under int8, of its own build too: "
             "release, numpy, BLAS, numba, architecture), so give every peer the same; with --gpu auto|on a peer "
             "serves an int8 swarm's FFN ranges with the GPU's int8 GEMVs (Q4_K, Q6_K and Q8_0 models), each "
             "answer checkable by the int8 rows of its down product" if peer else
             "int8 runs on this machine alone (refused with --swarm or --api, where the swarm's coordinator "
             "computes with its own numerics)")
    p.add_argument("--numerics", choices=("float32", "int8"), default=None,
                   help=_NUMERICS_HELP.format(whose="this peer's" if peer else "this machine's", where=where))


def _use_compute_options(args: argparse.Namespace, peer: bool = False) -> None:
    """``--threads`` and ``--numerics`` for this process and the peers it starts, and a line on
    stderr while the kernels compile (an installation's first run: minutes, not in silence).
    ``peer``: this process joins a swarm (under int8 with ``--gpu auto|on``: the GPU's int8 GEMVs,
    swarm/peer/worker/gpu.py)."""
    if getattr(args, "threads", None):
        os.environ["COLIBRI_SWARM_THREADS"] = str(args.threads)  # swarm.compute.threads.THREADS_ENV
    if getattr(args, "numerics", None):
        os.environ["COLIBRI_SWARM_NUMERICS"] = args.numerics  # swarm.compute.numerics.NUMERICS_ENV
    from swarm.compute import numerics, quant, threads

    try:
        threads.set_threads(getattr(args, "threads", None) or threads.threads_from_env())
    except ValueError as e:  # $COLIBRI_SWARM_THREADS set to something else
        raise SwarmError(str(e)) from None
    try:
        numerics.set_numerics(getattr(args, "numerics", None))
    except ValueError as e:  # $COLIBRI_SWARM_NUMERICS set to something else
        raise SwarmError(str(e)) from None
    quant.on_compiling(lambda line: print(line, file=sys.stderr, flush=True))


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling options of ``generate`` and ``chat``, checked before any work (one line each)."""
    from swarm.cli.generate import sampling_kwargs

    sampling_kwargs(args)


def _check_generate(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        raise SwarmError("the prompt is empty: give the text to answer, e.g. colibri-swarm generate \"Why is the "
                         "sky blue?\"")
    if args.local and (args.swarm or args.api):
        raise SwarmError(f"--local runs on this machine alone; {'--swarm' if args.swarm else '--api'} asks the "
                         "swarm: drop one of them")
    if args.model and (args.swarm or args.api):
        raise SwarmError(f"--model picks a model file for this machine, but {'--swarm' if args.swarm else '--api'} "
                         "runs the swarm's own model: drop --model, or use --local --model PATH")
    if args.raw and args.system is not None:
        raise SwarmError("--system has no effect with --raw (no chat template is applied); drop one of them")
    _check_sampling(args)


def _generate(args: argparse.Namespace) -> int:
    _check_generate(args)
    _use_compute_options(args)
    from swarm.compute import numerics

    int8 = numerics.int8()  # from --numerics or $COLIBRI_SWARM_NUMERICS
    # The flags ask for this machine's compute; the environment's int8 may be there for `join`
    # (a client of the swarm computes nothing, so --swarm and --api go on).
    if args.numerics == "int8" and (args.swarm or args.api):
        raise SwarmError(f"--numerics int8 sets this machine's own compute, but {'--swarm' if args.swarm else '--api'} "
                         "runs on the swarm, whose coordinator computes with the numerics it joined with "
                         "(join --numerics): drop one of them")
    if args.threads and (args.swarm or args.api):
        raise SwarmError(f"--threads sets this machine's own compute, but {'--swarm' if args.swarm else '--api'} "
                         "runs on the swarm, whose peers compute on the threads they joined with (join --threads): "
                         "drop one of them")
    # Through the swarm with --swarm or --api, or by default when a peer runs here and no
    # --model is given; swarm.compute never imports swarm.peer, so the choice is made here.
    # int8 numerics and --threads are this machine's own compute: the reply is made here, as with --local.
    if args.swarm or args.api or not (args.local or args.model or int8 or args.threads):
        from swarm.cli.generate import main_generate_swarm

        code = main_generate_swarm(args)
        if code is not None:
            return code
    from swarm.cli.generate import main_generate

    return main_generate(args)


def _key(args: argparse.Namespace) -> int:
    from swarm.cli.key import main_key

    return main_key(args)


def _join(args: argparse.Namespace) -> int:
    from swarm.cli.join import check_options

    check_options(args)
    if args.signal and not args.key:
        from swarm.keys import swarmkey

        if swarmkey.load() is None:  # a new key here could never join the swarm at --signal
            raise SwarmError("--signal joins an existing swarm, whose key this machine does not have: add "
                             "--key CODE (`colibri-swarm key` on a peer of that swarm shows it)")
    _use_compute_options(args, peer=True)
    from swarm.cli.join import main_join

    return main_join(args)


def _status(args: argparse.Namespace) -> int:
    from swarm.cli.status import main_status

    return main_status(args)


def _chat(args: argparse.Namespace) -> int:
    _check_sampling(args)
    from swarm.cli.chat import main_chat

    return main_chat(args)


def _command(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line ``text`` shows both in the command list and atop its ``--help``."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error on one line, as the commands' own errors are."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="colibri-swarm",
        description="Run LLMs across the devices of one LAN.",
    )
    parser.add_argument("--version", action="version", version=f"colibri-swarm {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "generate", "generate a reply to one prompt and stream it (through the swarm when a peer "
                 "runs here)")
    p.add_argument("prompt", help="the user message")
    _add_model_arg(p)
    _add_sampling_args(p)
    p.add_argument("--local", action="store_true", help="run on this machine only, even when a swarm is found")
    p.add_argument("--swarm", action="store_true", help="require a swarm coordinator; fail if none is found")
    p.add_argument("--api", metavar="URL", type=_api_url, help="the coordinator's API base URL, e.g. "
                   "https://HOST:PORT/v1 (default: the local peer's, or found by mDNS)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template (through the swarm: its "
                   "/v1/completions)")
    _add_threads_arg(p)
    _add_numerics_arg(p)
    p.set_defaults(func=_generate)

    p = _command(sub, "chat", "chat with the swarm's coordinator (a REPL with history)")
    _add_sampling_args(p)
    p.add_argument("--api", metavar="URL", type=_api_url,
                   help="the coordinator's API base URL, e.g. https://HOST:PORT/v1 (default: found by mDNS)")
    p.set_defaults(func=_chat)

    p = sub.add_parser("join", help="make this machine a peer of the swarm on this LAN",
                       description="Make this machine a peer: find the swarm by mDNS (or host its signaling "
                       "server), link to the other peers, elect a coordinator, and compute its share.")
    _add_model_arg(p)
    p.add_argument("--key", metavar="CODE", help="the swarm key code (stored for next time)")
    p.add_argument("--signal", metavar="HOST:PORT", type=_signal_url,
                   help="the signaling server as HOST:PORT (or https://HOST:PORT, wss://HOST:PORT), as the "
                   "host's join prints it; skips mDNS discovery")
    p.add_argument("--port", metavar="N", type=_port,
                   help="host the signaling server on this TCP port, so a --signal HOST:PORT handed out stays "
                   "valid across restarts (default: a free port, chosen anew at each start)")
    p.add_argument("--name", metavar="NAME", help="a name for this peer, shown in status")
    p.add_argument("--verify", type=_percent, default=0.0, metavar="PERCENT",
                   help="recompute this share of remote answers locally: a wrong FFN range answer stops "
                   "generation, a wrong stage answer is recomputed and its peer dropped (docs/security.md)")
    p.add_argument("--layout", choices=("ranges", "stages", "mix", "auto"), default="auto",
                   help="as coordinator: let the cost model choose from measured speed, memory and round trips "
                   "(auto, the default), cut every layer's experts/MLP over the peers (ranges), give peers "
                   "whole layer ranges (stages: one network crossing per stage, not per layer), or keep the "
                   "first layers here with their experts/MLP cut over the peers and give the rest as stages "
                   "(mix); see docs/planner.md")
    p.add_argument("--no-model", action="store_true", help="join as a worker without the model (weights are shipped)")
    # Names as in swarm.peer.worker.gpu.GPU_MODES (not imported here: numpy stays out of the CLI's start).
    p.add_argument("--gpu", choices=("off", "auto", "on"), default="off",
                   help="compute this peer's expert and MLP ranges and its stages on the GPU with WGSL "
                   "kernels through wgpu (pip install 'colibri-swarm[gpu]'): on (any adapter, failing "
                   "without one), auto (a GPU adapter if one is found, never a software one), or off (the "
                   "default: the engine's CPU kernels, whose bits every CPU peer shares); docs/weights.md")
    # At most 2**30 MiB: a Hello announces at most 2**50 bytes (swarm.peer.net.messages.MAX_GPU_MEMORY).
    p.add_argument("--gpu-memory", metavar="MIB", type=_int_at_least(1, "--gpu-memory (MiB)", 2**30),
                   help="with --gpu auto|on: the GPU holds at most MIB MiB of this peer's planned GPU work "
                   "(weights, and a stage's KV cache for the plan's context); work past it computes on this "
                   "peer's CPU from host memory, as a CPU peer's (default: none given, the GPU shares this "
                   "peer's --memory, as an integrated GPU does; give a discrete card's memory less a margin "
                   "for the display); docs/planner.md")
    p.add_argument("--api-port", metavar="PORT", type=_int_at_least(1, "--api-port", 65535),
                   help="as coordinator: serve the OpenAI API on this TCP port (default: the port this config "
                   "directory served on before, else a free one, then kept, so the URL survives elections; a "
                   "taken port gives way to a free one with a warning)")
    p.add_argument("--api-plain-http", action="store_true",
                   help="serve the OpenAI API as plain HTTP instead of HTTPS: anyone on the network can read "
                   "prompts, replies and the API token")
    p.add_argument("--memory", metavar="MIB", type=_int_at_least(1, "the memory budget (MiB)"),
                   help="this process uses at most MIB MiB in all, like a memory cgroup limit: its baseline, "
                   "a page-cache headroom (5 %%, at least 64 MiB), the KV cache, activations and the weights "
                   "come out of it (default: what the OS and this process's memory cgroup leave; "
                   "docs/capacity.md)")
    p.add_argument("--context", metavar="TOKENS", type=_int_at_least(1, "--context"),
                   help="as coordinator: reserve KV cache for this many tokens per layer, all sequences in "
                   "flight together, on every peer that holds those layers (default: the model's context, "
                   "at most 4096)")
    # Defaults and the cap: swarm.compute.serving's MAX_BATCH, MAX_BATCH_LIMIT and MAX_QUEUE (not imported
    # here: numpy stays out of the CLI's start).
    p.add_argument("--max-batch", metavar="N", type=_int_at_least(1, "--max-batch", 64),
                   help="as coordinator: generate for at most N API requests at once, batched into shared "
                   "steps (default 8, at most 64); docs/serving.md")
    p.add_argument("--max-queue", metavar="N", type=_int_at_least(0, "--max-queue"),
                   help="as coordinator: at most N more requests wait for a slot; beyond, HTTP 429 with "
                   "Retry-After (default 32)")
    p.add_argument("--mtu-packets", action="store_true",
                   help="send data-channel packets that fit a 1500-byte MTU to every peer, without probing "
                   "(default: up to 16 KiB to other Python peers where a probe of that size comes back, far "
                   "fewer packets a step; a link whose network drops IP fragments keeps MTU-sized ones)")
    # Names as in swarm.cli.join.EVENT_LOOPS (not imported here: the CLI starts without asyncio's peers).
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the event loop the peer runs on: uvloop (about half the round trip of a data-channel "
                   "message), asyncio's own, or auto (the default): uvloop where installed, asyncio while "
                   "$COLIBRI_SWARM_SLOW_CALLBACK_S is set")
    _add_threads_arg(p)
    _add_numerics_arg(p, peer=True)
    p.set_defaults(func=_join)

    p = _command(sub, "key", "show the swarm key as a code and a QR code (creates one if none), the API token "
                 "and certificate")
    p.add_argument("--new", action="store_true", help="create a new swarm key, replacing the stored one")
    p.set_defaults(func=_key)

    p = _command(sub, "status", "print the swarm: peers, roles, placement, timings")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--watch", action="store_true", help="a live view, redrawn every second, with the swarm's events")
    p.set_defaults(func=_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # --help, --version, a usage error: their output may meet a closed pipe too
            sys.stdout.flush()
            raise
        _setup_logging(args.verbose)
        func: Callable[[argparse.Namespace], int] = args.func
        code = int(func(args) or 0)
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (`… | head`): point stdout at /dev/null so the interpreter's final
        # flush does not raise again (Python docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except SwarmError as exc:
        print(f"colibri-swarm: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return EXIT_INTERRUPTED


def _setup_logging(verbosity: int) -> None:
    import logging

    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
