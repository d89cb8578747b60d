"""Serving many users at once (continuous batching): aggregate tok/s and time to first token at
1, 2, 4 and 8 concurrent streams, locally and through a 2-peer swarm, in one run. Prints one
JSON object.

Each level sends N streaming ``/v1/completions`` requests at once (greedy, ``--tokens`` tokens
each, a different prompt of ~``--prompt-tokens`` tokens per stream) to the OpenAI API, served by
the product's own ``ApiServer`` and ``EngineBackend`` (its batch scheduler), ``--rounds`` times.
Per level: aggregate tok/s (every completion token of the round over the round's wall time,
median of the rounds); decode aggregate tok/s (the tokens after each stream's first, from when
every stream had its first token until the last ended: the batch decoding, without the
prefills); p50/p95 time to first token over every request of every round, and the
CPU seconds the serving process used per wall second (on a shared machine wall time is
distorted; this says how much of it the server had). ``speedup`` is each level's aggregate over
the single stream's.

* **local**: the API over ``LocalFFN`` on this machine.
* **swarm**: the coordinator (this process) and one worker process (``bench/swarm.py``'s), linked
  by the real stack (aiohttp signaling, authenticated aiortc data channels, election, plan) in a
  network namespace whose loopback carries an extra /32 (aioice skips 127.0.0.1); the API uses
  the coordinator's ``RemoteFFN``: one request per peer per layer for all streams of a step.
  Needs root (the namespace).

    sudo python3 bench/serve.py [--model smollm2] [--levels 1,2,4,8] [--tokens 64] [--prompt-tokens 16]

``BENCH_LOG=FILE`` writes the coordinator's log there.

``COLIBRI_BENCH_THREADS`` (default 1) sets the BLAS threads of every process.

``--trace`` (swarm only, one process pair) adds ``trace``: per step size, the median step and
where one layer's round trip goes (token loop → event loop → encode → data channel → worker →
compute → back), the coordinator's own share, and SCTP packets counted in the measured rounds
(bench/ffn_trace.py). The wrappers cost time of their own: compare traced runs with traced runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import importlib.util

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load_swarm_bench():
    """bench/swarm.py (BLAS threads, the namespace, worker processes), under another name than
    the ``swarm`` package."""
    spec = importlib.util.spec_from_file_location("swarm_bench", Path(__file__).with_name("swarm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


swarm_bench = _load_swarm_bench()
_spec = importlib.util.spec_from_file_location("ffn_trace", Path(__file__).with_name("ffn_trace.py"))
ffn_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ffn_trace)

import numpy as np  # noqa: E402

ADDRESS = swarm_bench.ADDRESS
WORDS = ("river stone lamp orchard window copper violin harbor meadow lantern thunder basket mirror "
         "compass garden falcon candle marble ribbon glacier").split()


def prompts(n: int, n_tokens: int, words: tuple[str, ...] = WORDS) -> list[str]:
    """``n`` different prompts of roughly ``n_tokens`` tokens (one word ~ one token)."""
    rng = np.random.default_rng(0)
    return [f"{words[i % len(words)]} " + " ".join(rng.choice(words, n_tokens)) for i in range(n)]


async def _stream(session, url: str, token: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    t0 = time.perf_counter()
    first, tokens = None, 0
    start = time.perf_counter()
    async with session.post(f"{url}/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            elif first is None and obj["choices"] and obj["choices"][0].get("text"):
                first = time.perf_counter() - t0
    end = time.perf_counter()
    return {"ttft_s": first, "tokens": tokens, "start": start, "first": None if first is None else start + first,
            "end": end}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q * (len(xs) - 1))), len(xs) - 1)]


async def measure(url: str, token: str | None, levels: list[int], rounds: int, n_tokens: int,
                  n_prompt: int, state=lambda: {}, ready=None, words: tuple[str, ...] = WORDS, trace=None) -> dict:
    """Each level's figures (module docstring); ``state()``: what to add to each level's (the
    swarm's plan); ``ready``: awaited after the warm-up (the swarm: until the worker serves);
    ``trace``: bench/ffn_trace.py when tracing (its window is the measured rounds)."""
    import aiohttp

    texts = prompts(max(levels), n_prompt, words)
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        for text in texts[:2]:  # warm-up: kernels, slices, the plan in place, the worker's first answers timed
            await _stream(s, url, token, text, 4)
        if ready is not None:
            await ready()
        for n in levels:
            aggregates, decode, ttfts, cpu = [], [], [], []
            for _ in range(rounds):
                if trace is not None:
                    trace.window(True)
                c0, t0 = time.process_time(), time.perf_counter()
                got = await asyncio.gather(*[_stream(s, url, token, texts[i], n_tokens) for i in range(n)])
                wall = time.perf_counter() - t0
                if trace is not None:
                    trace.window(False)
                aggregates.append(sum(g["tokens"] for g in got) / wall)
                # Decode alone: the tokens after each stream's first, from when every stream had its
                # first token until the last ended (prefill of the others no longer in the way).
                all_in = max(g["first"] for g in got if g["first"] is not None)
                late = [g for g in got if g["end"] > all_in]
                decode.append(sum((g["tokens"] - 1) * (g["end"] - all_in) / (g["end"] - g["first"]) for g in late)
                              / (max(g["end"] for g in got) - all_in))
                ttfts += [g["ttft_s"] for g in got if g["ttft_s"] is not None]
                cpu.append((time.process_time() - c0) / wall)
            out[str(n)] = {"aggregate_tok_s": round(statistics.median(aggregates), 2),
                           "decode_aggregate_tok_s": round(statistics.median(decode), 2),
                           "ttft_p50_s": round(_pct(ttfts, 0.5), 3), "ttft_p95_s": round(_pct(ttfts, 0.95), 3),
                           "server_cpu_s_per_wall_s": round(statistics.median(cpu), 2),
                           "load_avg_1m": round(os.getloadavg()[0], 2), **state()}
            swarm_bench._progress(f"{n} streams: {out[str(n)]}")
    base = out[str(levels[0])]["aggregate_tok_s"]
    base_decode = out[str(levels[0])]["decode_aggregate_tok_s"]
    for v in out.values():
        v["speedup"] = round(v["aggregate_tok_s"] / base, 2)
        v["decode_speedup"] = round(v["decode_aggregate_tok_s"] / base_decode, 2)
    return out


async def _serve_local(model, tokenizer, args) -> dict:
    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.coordinator.api_engine import EngineBackend

    backend = EngineBackend(model, tokenizer, model_id="bench", max_batch=max(args.levels))
    api = ApiServer(backend, ["bench-token"])
    port = await api.start("127.0.0.1", 0)
    try:
        return await measure(f"http://127.0.0.1:{port}/v1", "bench-token", args.levels, args.rounds,
                             args.tokens, args.prompt_tokens, words=args.words)
    finally:
        await api.close()


async def _serve_swarm(path: Path, model, tokenizer, args) -> dict:
    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.coordinator.api_engine import EngineBackend
    from swarm.peer.node import Node
    from swarm.peer.roles import SwarmRoles
    from swarm.signaling.server import SignalingServer

    tmp = Path(tempfile.mkdtemp(prefix="csd-serve-"))
    key = SwarmKey(os.urandom(32))
    ident = Identity.generate()
    server = SignalingServer(key.secret, ident.peer_id, config_dir=tmp)
    await server.start(ADDRESS, 0)
    node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name="coordinator",
                signal_url=server.url(ADDRESS), ffn_gflops=1.01, memory_budget=4 << 30,
                model_hash=model.content_hash(), status_path=tmp / "status.json",
                link_options=swarm_bench.LINK_OPTIONS)
    await node.start(timeout=30)
    roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0)
    await roles.start()
    if args.trace:  # this script's own worker entry installs the worker's half of the trace
        worker = subprocess.Popen(
            [sys.executable, __file__, "--_worker", str(path), "--signal", server.url(ADDRESS), "--key", key.code],
            env={**os.environ, "COLIBRI_SWARM_CONFIG_DIR": str(tmp / "w1"), "COLIBRI_FFN_TRACE": str(tmp / "w1.trace")},
            stdout=subprocess.DEVNULL, stderr=open(tmp / "w1.log", "w"))
    else:
        worker = swarm_bench._spawn_worker(path, server.url(ADDRESS), key.code, "w1", tmp)

    class SwarmBackend(EngineBackend):
        ffn = property(lambda self: roles.coordinator.engine_ffn, lambda self, value: None)

    api = None
    try:
        def planned():
            ffn = roles.coordinator.ffn
            return ffn is not None and not ffn.failed and len((ffn.pending_plan or ffn.plan).workers()) == 1

        await swarm_bench._until(planned, swarm_bench.PLAN_WAIT_S, "a plan over the worker")

        async def serving():  # the worker has a share and has answered under it
            await swarm_bench._until(lambda: planned() and roles.coordinator.ffn.remote_rows > 0
                                     and swarm_bench._coordinator_share(roles.coordinator.ffn.plan) < 1.0,
                                     swarm_bench.PLAN_WAIT_S, "the worker serving its share")

        def state():  # whether the worker took part throughout (a busy machine may cost it its share)
            ffn = roles.coordinator.ffn
            return {"coordinator_share": swarm_bench._coordinator_share(ffn.plan), "plan_version": ffn.plan.version,
                    "remote_rows": ffn.remote_rows, "local_fallbacks": ffn.local_fallbacks}

        api = ApiServer(SwarmBackend(model, tokenizer, model_id="bench", max_batch=max(args.levels)), ["bench-token"])
        port = await api.start("127.0.0.1", 0)
        out = await measure(f"http://127.0.0.1:{port}/v1", "bench-token", args.levels, args.rounds,
                            args.tokens, args.prompt_tokens, state, serving, args.words, ffn_trace if args.trace else None)
    finally:
        if api is not None:
            await api.close()
        worker.terminate()
        worker.wait(30)
        await roles.stop()
        await node.stop()
        await server.stop()
    if args.trace:
        ffn_trace.dump(tmp / "c.trace")
        out["trace"] = ffn_trace.breakdown(tmp / "c.trace", tmp / "w1.trace")
    return out


def _word_tokenizer(model_dir: Path) -> None:
    """Give bench/swarm.py's random OLMoE-shaped checkpoint a tokenizer (once): token i is the
    word ``w<i>``, so prompts of such words encode to one token each and every id decodes."""
    if (model_dir / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))


async def _main_in_netns(args) -> dict:
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import tokenizer_for

    path = swarm_bench.model_path(args.model)
    args.words = WORDS
    if path.is_dir():
        _word_tokenizer(path)
        args.words = tuple(f"w{i}" for i in range(10, 210))
    model = load_model(path)
    model.materialize()
    tokenizer = tokenizer_for(model)
    local = {}
    if not args.trace:
        swarm_bench._progress("local")
        local = await _serve_local(model, tokenizer, args)
    swarm_bench._progress("swarm of 2 peers")
    swarm = await _serve_swarm(path, model, tokenizer, args)
    return {"local": local, "swarm_2_peers": swarm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 or olmoe (bench/swarm.py's models)")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrent streams per level")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per stream")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="words per prompt (about as many tokens)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per level")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--trace", action="store_true",
                        help="swarm only: where each layer's round trip goes (bench/ffn_trace.py)")
    parser.add_argument("--loop", choices=swarm_bench.EVENT_LOOPS, default="auto",
                        help="every peer process's event loop, as join --loop (default auto: uvloop where installed)")
    parser.add_argument("--_inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_worker", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--signal", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ[swarm_bench.LOOP_ENV] = os.environ.get(swarm_bench.LOOP_ENV, args.loop)  # the driver's, inherited
    asyncio.run = functools.partial(swarm_bench.run_on_loop, asked=os.environ[swarm_bench.LOOP_ENV])
    if args._worker:  # the traced worker (--trace)
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s w1 %(name)s: %(message)s")
        swarm_bench._bench_timeouts()  # the same election timeouts as the coordinator's
        ffn_trace.install("worker")
        try:
            asyncio.run(swarm_bench._worker_main(args._worker, args.signal, args.key, "w1"))
        finally:
            ffn_trace.dump(os.environ["COLIBRI_FFN_TRACE"])
        return
    args.levels = [int(n) for n in args.levels.split(",")]
    if args._inside:
        if os.environ.get("BENCH_LOG"):  # the coordinator's log, to a file (stderr is only shown on failure)
            import logging

            logging.basicConfig(filename=os.environ["BENCH_LOG"], level=logging.INFO,
                                format="%(asctime)s %(name)s: %(message)s")
        swarm_bench.PRODUCT_DEADLINE_MIN_S.append(swarm_bench._bench_timeouts())
        if args.trace:
            ffn_trace.install("coordinator")
        print(json.dumps(asyncio.run(_main_in_netns(args))))
        return
    argv = ["--model", args.model, "--levels", ",".join(map(str, args.levels)), "--tokens", str(args.tokens),
            "--prompt-tokens", str(args.prompt_tokens), "--rounds", str(args.rounds), "--_inside"]
    if args.trace:
        argv.append("--trace")
    swarm_bench.__file__ = __file__  # the namespace runs this script, not bench/swarm.py
    t0 = time.monotonic()
    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "arch": platform.machine(), "blas_threads_per_process": int(swarm_bench.BLAS_THREADS),
                    "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                    "event_loop": swarm_bench.pick_loop(args.loop)},
        "model": args.model, "tokens_per_stream": args.tokens, "prompt_words": args.prompt_tokens,
        "rounds": args.rounds, **swarm_bench._in_netns(argv, args.timeout),
    }
    results["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
