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

``--pipeline`` (no namespace, no root): stages pipelined across the sequences of a batch against
one peer alone, each peer a process pinned to its own cores (``taskset``; ``--cores``, one list
per peer, the coordinator's first; ``COLIBRI_BENCH_THREADS`` compute threads each). The
coordinator process runs the embeddings, the first stage, the head and sampling; one stage
worker process per further peer (:class:`~swarm.peer.worker.stages.StageRunner`) the others,
each linked by a pipe that carries the product's encoded ``StageRequest``/``StageAnswer`` frames
(the stage protocol without WebRTC: no data channel cost). The layers are cut as the planner
cuts them for throughput (``costmodel.throughput_split`` over equal peers: the coordinator,
which also runs the head, takes fewer), or at ``--split``. Each ``--rounds`` round runs, for one
stream and for every ``--streams`` level, in turn: one peer alone (``LocalFFN``) and the stages
with one batch scheduler per stage (raw schedulers, no API), then the product's path — the
OpenAI API (``ApiServer`` and ``EngineBackend``, streaming ``/v1/completions``) over one peer and
over the stages, where the backend places sequences over its schedulers by the planner's price
(``costmodel.GroupPricer`` over the stages, every peer at the speed ``join`` measures here:
one scheduler per stage, or more where groups of fewer rows cost less a round; with
``--unpriced`` also one scheduler per stage, as before that price). Interleaving puts
other work on a shared machine into both sides of each ratio. Per run: aggregate tok/s, p50/p95
time per output token (between a stream's tokens; the p95 also of the gaps after every stream
has its first token, ``p95_token_ms_all_started``: a burst of prompts prefilled at the start
sets the whole run's p95, not what a stream meets once all run), CPU ms per token of the coordinator process
and of the stage workers together, and whether each stream's tokens (API: text) equal its solo
run on one peer; per level the ratios per round and their median. Writes the JSON to ``--out``.

    python3 bench/serve.py --pipeline [--model smollm2|PATH] [--streams 8,16] [--tokens 64] [--rounds 2] [--cores 0,1]
    COLIBRI_BENCH_THREADS=8 python3 bench/serve.py --pipeline --cores 0-7,8-15   # 16 cores, 8 a peer

``--profile`` (``--pipeline`` only) adds ``profile`` to the record of each run over the stages
(the raw schedulers' and the API's): where a group's hand-off goes against its compute — each
hop's median and p90 (encode, pipe, decode, compute, the answer's way back, the waiting lane's
wake), each stage peer's busy fraction, the stages' idle gaps between groups, the groups in
flight, a step's critical path as compute / hand-off / waiting / the coordinator's own, and
each stage's compute by the rows of a group (bench/pipeline_profile.py; each stage worker
writes its stamps to a file read at the end). The wrappers cost time of their own: compare
profiled runs with profiled runs.

    COLIBRI_BENCH_THREADS=8 python3 bench/serve.py --pipeline --profile --cores 0-7,8-15 --streams 8 --rounds 1

``--lengths mixed`` (``--pipeline`` only) gives the streams different lengths: stream i asks for
a quarter, half, three quarters or all of ``--tokens`` (a fixed shuffle, the same every run and
in the solo runs), so streams finish at different steps and leave the groups uneven.
``--evening-off`` also serves the API over the stages with the pool's evening of groups turned
off (``SchedulerPool.rebalance`` a no-op in this process), beside the product's run:
``api_stages_vs_api_stages_no_evening`` is what the evening gains; each API run over the stages
counts its moves (``evening_moves``).

    python3 bench/serve.py --pipeline --lengths mixed --evening-off --streams 8,16

``--trace`` (swarm only, one process pair) adds ``trace``: per step size, the median step and
where one layer's round trip goes (token loop → event loop → encode → data channel → worker →
compute → back), the coordinator's own share, and SCTP packets counted in the measured rounds
(bench/ffn_trace.py). The wrappers cost time of their own: compare traced runs with traced runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
_spec = importlib.util.spec_from_file_location("pipeline_profile", Path(__file__).with_name("pipeline_profile.py"))
pipeline_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pipeline_profile)

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
    first, tokens, text, times = None, 0, "", []
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
            elif obj["choices"] and obj["choices"][0].get("text"):
                times.append(time.perf_counter())
                text += obj["choices"][0]["text"]
                if first is None:
                    first = times[-1] - t0
    end = time.perf_counter()
    return {"ttft_s": first, "tokens": tokens, "start": start, "first": None if first is None else start + first,
            "end": end, "text": text, "times": times}


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


# ---------------------------------------------------------------- --pipeline: stages pipelined

def _peer_id(name: str) -> str:
    import base64
    import hashlib

    return base64.b32encode(hashlib.sha256(name.encode()).digest()[:16]).decode().lower().rstrip("=")


PIPE_COORD = _peer_id("bench-coordinator")
STAGE_PEER_ENV = "COLIBRI_BENCH_STAGE_PEER"  # a stage worker process's peer id


def _stage_peer(i: int) -> str:
    return _peer_id("bench-stage-worker" if i == 0 else f"bench-stage-worker-{i}")


def _write_frame(f, lock, msg) -> None:
    from swarm.peer.net import messages

    data = messages.encode(msg)
    with lock:
        f.write(len(data).to_bytes(4, "little") + data)
        f.flush()


def _read_frame(f):
    from swarm.peer.net import messages

    head = f.read(4)
    if len(head) < 4:
        return None
    return messages.decode(f.read(int.from_bytes(head, "little")))


def _stage_worker_main(path: str) -> None:
    """The stage worker process: StagePlan and StageRequest frames on stdin, answers on stdout."""
    import threading

    from swarm.compute import threads
    from swarm.compute.model import load_model
    from swarm.peer.net.messages import StagePlan
    from swarm.peer.plan import StageLayout
    from swarm.peer.worker.stages import StageRunner

    threads.set_threads(int(swarm_bench.BLAS_THREADS))
    model = load_model(path)
    model.materialize()
    runner = StageRunner(os.environ[STAGE_PEER_ENV], model)
    profile = os.environ.get(pipeline_profile.PROFILE_ENV)  # --profile: this process's stamps, written at the end
    if profile:
        pipeline_profile.install("worker", sys.modules[__name__])
    inp, out, lock = sys.stdin.buffer, sys.stdout.buffer, threading.Lock()
    while (msg := _read_frame(inp)) is not None:
        if isinstance(msg, StagePlan):
            runner.accept(StageLayout.from_message(msg, PIPE_COORD, model.config.n_layers))
        else:
            _write_frame(out, lock, runner.handle(msg))
    if profile:
        pipeline_profile.dump(profile)


class _PipeLink:
    """The dispatcher StagedFFN sees: frames to each stage worker process's stdin (``procs``:
    peer id → process), answers read from its stdout on a thread of its own (the event loop's
    part) and delivered."""

    def __init__(self, procs):
        import threading

        self.procs, self.ffn, self.failures = procs, None, []
        self.locks = {peer: threading.Lock() for peer in procs}
        for peer, proc in procs.items():
            threading.Thread(target=self._read, args=(peer, proc), name="pipe-answers", daemon=True).start()

    def _read(self, peer, proc):
        while (msg := _read_frame(proc.stdout)) is not None:
            self.ffn.deliver(peer, msg)

    def send(self, peer, msg):
        _write_frame(self.procs[peer].stdin, self.locks[peer], msg)

    def last_heard(self, peer):
        return None

    def peer_failed(self, peer, reason):
        self.failures.append(reason)

    def peer_not_ready(self, peer, reason):
        pass

    def lead_state(self, term):
        return True  # no election: this process coordinates


def _serve_streams(model, ffn, prompt_ids, n_tokens, schedulers=1):
    """The prompts as concurrent greedy streams through the batch scheduler (``schedulers`` of
    them sharing ``ffn``, stream i on scheduler i mod k: each steps its own sequences, so one's
    step need not wait for the other's), ``n_tokens`` each (an int, or one a stream); (tokens per
    stream, aggregate tok/s, seconds between a stream's tokens)."""
    import threading

    from swarm.compute.sampling import SamplingParams
    from swarm.compute.serving import BatchScheduler

    n = len(prompt_ids)
    scheds = [BatchScheduler(model, lambda: ffn, max_batch=n, max_queue=n) for _ in range(schedulers)]
    lengths = _per_stream(n_tokens, n)
    times, tokens = [[] for _ in range(n)], [[] for _ in range(n)]

    def consume(i, stream):
        for tok in stream:
            times[i].append(time.perf_counter())
            tokens[i].append(tok)

    t0 = time.perf_counter()
    streams = [scheds[i % schedulers].submit(p, SamplingParams(max_tokens=lengths[i], temperature=0.0, stop_tokens=()))
               for i, p in enumerate(prompt_ids)]
    workers = [threading.Thread(target=consume, args=(i, st)) for i, st in enumerate(streams)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = max(t[-1] for t in times) - t0
    return tokens, sum(map(len, tokens)) / wall, _gaps(times)


class Gaps(list):
    """Seconds between consecutive tokens of a stream, over every stream; ``steady``: those that
    start once every stream has its first token (no prompt is then being prefilled beside them)."""

    steady: list


def _gaps(times: list[list[float]]) -> Gaps:
    """:class:`Gaps` of each stream's token times (``time.perf_counter`` seconds)."""
    gaps = Gaps(b - a for t in times for a, b in zip(t, t[1:]))
    started = max((t[0] for t in times if t), default=0.0)
    gaps.steady = [b - a for t in times for a, b in zip(t, t[1:]) if a >= started]
    return gaps


def _per_stream(n_tokens, n: int) -> list[int]:
    """Tokens for each of ``n`` streams: ``n_tokens`` an int (every stream) or a list (its first ``n``)."""
    return [n_tokens] * n if isinstance(n_tokens, int) else list(n_tokens[:n])


def _mixed_lengths(tokens: int, n: int) -> list[int]:
    """``--lengths mixed``: a quarter, half, three quarters or all of ``tokens`` per stream, in a
    fixed shuffle of ``n`` (each length as often as the others over all ``n``, within one; the
    first streams of a lower level may hold them unevenly: of 16, the first 8 take 32, 64, 96 and
    128 tokens 2, 1, 3 and 2 times)."""
    quarters = np.random.default_rng(7).permutation(np.arange(n) % 4 + 1)
    return [max(1, int(tokens * int(q) // 4)) for q in quarters]


async def _api_streams(model, tokenizer, ffn, texts, n_tokens):
    """The prompts as concurrent streaming ``/v1/completions`` requests to the product's API over
    ``ffn`` (None: this peer alone), ``n_tokens`` each (an int, or one a stream); (texts,
    aggregate tok/s, seconds between a stream's chunks, the backend's schedulers that stepped,
    tokens in all)."""
    import aiohttp

    from swarm.peer.coordinator.api import ApiServer
    from swarm.peer.coordinator.api_engine import EngineBackend

    backend = EngineBackend(model, tokenizer, model_id="bench", ffn=ffn, max_batch=len(texts), max_queue=len(texts))
    api = ApiServer(backend, ["bench-token"])
    port = await api.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
            t0 = time.perf_counter()
            got = await asyncio.gather(*[_stream(s, f"http://127.0.0.1:{port}/v1", "bench-token", t, k)
                                         for t, k in zip(texts, _per_stream(n_tokens, len(texts)))])
            wall = time.perf_counter() - t0
    finally:
        await api.close()
    gaps = _gaps([g["times"] for g in got])
    stepped = sum(sched.steps > 0 for sched in backend.scheduler.schedulers)
    n_tok = sum(g["tokens"] for g in got)
    return [g["text"] for g in got], n_tok / wall, gaps, stepped, n_tok


@contextlib.contextmanager
def _evening(on: bool):
    """The pool's evening of groups (``SchedulerPool.rebalance``) on or off in this process while
    the block runs; yields a one-item list that counts the sequences' moves."""
    from swarm.compute.serving import SchedulerPool

    keep, moves = SchedulerPool.rebalance, [0]

    def counted(member, target, seqs):
        moves[0] += len(seqs)
        move(member, target, seqs)

    move = SchedulerPool._move
    SchedulerPool._move = staticmethod(counted)  # type: ignore[method-assign]
    if not on:
        SchedulerPool.rebalance = lambda self, member: None  # type: ignore[method-assign]
    try:
        yield moves
    finally:
        SchedulerPool.rebalance, SchedulerPool._move = keep, staticmethod(move)  # type: ignore[method-assign]


def _cpu_list(spec: str) -> set[int]:
    """``"0-7"`` or ``"3"`` (taskset's list syntax, one range) as a set of core numbers."""
    lo, _, hi = spec.partition("-")
    return set(range(int(lo), int(hi or lo) + 1))


def _pipeline_main(args) -> dict:
    """The --pipeline run; with --profile, the stage workers' stamp files lie in a temporary
    directory removed when the run ends, as it ends or fails."""
    if not args.profile:
        return _pipeline_run(args, None)
    with tempfile.TemporaryDirectory(prefix="csd-profile-") as stamps:
        return _pipeline_run(args, Path(stamps))


def _pipeline_run(args, stamps: Path | None) -> dict:
    """The --pipeline run (module docstring); ``stamps``: the directory of the stage workers'
    --profile stamp files (None: no --profile)."""
    from swarm.compute import threads
    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import tokenizer_for
    from swarm.peer.coordinator.costmodel import GroupPricer, LayerCosts, PeerCost, throughput_split
    from swarm.peer.node import measure_ffn_gflops
    from swarm.peer.coordinator.stages import StagedFFN
    from swarm.peer.plan import Stage, StageLayout

    cores = [_cpu_list(c) for c in args.cores.split(",")]  # each peer's cores
    os.sched_setaffinity(0, cores[0])  # this process: the coordinator, or the one peer alone
    threads.set_threads(int(swarm_bench.BLAS_THREADS))
    path = swarm_bench.model_path(args.model)
    model = load_model(path)
    model.materialize()
    n_layers = model.config.n_layers
    peers = [PIPE_COORD, *(_stage_peer(i) for i in range(len(cores) - 1))]
    if args.split is None:  # the planner's split for throughput over equal peers (the head on ours)
        equal = [PeerCost(p, 10**12, 1.0) for p in peers]
        stages = throughput_split(LayerCosts.from_model(model), equal[0], equal[1:])
    else:
        bounds = [0, *(int(b) for b in str(args.split).split(",")), n_layers]
        stages = tuple((p, lo, hi) for p, lo, hi in zip(peers, bounds[:-1], bounds[1:], strict=True))
    levels = [int(n) for n in str(args.streams).split(",")]
    tok = tokenizer_for(model)
    texts = prompts(max(levels), args.prompt_tokens)
    prompt_ids = [tok.encode(t) for t in texts]
    lengths = _mixed_lengths(args.tokens, len(texts)) if args.lengths == "mixed" else [args.tokens] * len(texts)
    out = {"command": "python3 bench/serve.py " + " ".join(sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                       "arch": platform.machine(), "threads_per_peer": int(swarm_bench.BLAS_THREADS),
                       "cores": [sorted(c) for c in cores], "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
           "model": args.model, "layers": n_layers,
           "stages": [["coordinator" if p == PIPE_COORD else f"worker {peers.index(p)}", lo, hi] for p, lo, hi in stages],
           "streams": levels, "rounds": args.rounds,
           "tokens_per_stream": args.tokens if args.lengths == "equal" else lengths,
           "link": "pipe (stage frames, no WebRTC)", "runs": {}}
    runs = out["runs"]

    def cpu_s():  # CPU seconds so far of this process and of the stage workers' (Linux /proc)
        theirs = 0.0
        for proc in workers.values():
            with open(f"/proc/{proc.pid}/stat") as f:
                utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
            theirs += (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        return sum(os.times()[:2]), theirs

    def spin_counts():  # this process's spinning workers: groups run, groups declined to a second caller
        from swarm.compute import spin

        p = spin._pool
        return (p.groups, p.declined) if p is not None else (0, 0)

    def record(name, toks, tps, gaps, solo, cpu0, n_tok=None, **extra):
        cpu1, n_tok = cpu_s(), n_tok or sum(map(len, toks))
        (g0, d0), (g1, d1) = spin0[0], spin_counts()
        spin0[0] = (g1, d1)
        extra = {"coordinator_cpu_ms_per_token": round(1000 * (cpu1[0] - cpu0[0]) / n_tok, 3),
                 "workers_cpu_ms_per_token": round(1000 * (cpu1[1] - cpu0[1]) / n_tok, 3), **extra}
        if g1 + d1 > g0 + d0:  # spinning workers ran: how often a second caller found them taken
            extra["coordinator_spin_groups"], extra["coordinator_spin_declined"] = g1 - g0, d1 - d0
        runs.setdefault(name, []).append({
            "aggregate_tok_s": round(tps, 2), "p50_token_ms": round(1000 * _pct(gaps, 0.5), 2) if gaps else None,
            "p95_token_ms": round(1000 * _pct(gaps, 0.95), 2) if gaps else None,
            # once every stream has its first token: the p95 a burst of new prompts does not set
            "p95_token_ms_all_started": round(1000 * _pct(gaps.steady, 0.95), 2) if gaps.steady else None,
            "equal_to_solo": all(a == b for a, b in zip(toks, solo[:len(toks)], strict=True)), **extra})
        swarm_bench._progress(f"{name}: {tps:.1f} tok/s")

    local, workers = LocalFFN(model), {}
    profiles: dict[str, Path] = {}  # --profile: stage worker → the file of its stamps
    if stamps is not None:
        pipeline_profile.install("coordinator", sys.modules[__name__])
        profiles = {p: stamps / f"worker{i}.json" for i, p in enumerate(peers[1:], 1)}

    def profiled(name, rnd, run):  # run() inside a measured window of the profile (--profile)
        t0 = time.perf_counter_ns()
        got = run()
        if args.profile:
            pipeline_profile.window(name, rnd, t0)
        return got

    spin0 = [(0, 0)]  # spin_counts() at the last record
    swarm_bench._progress("solo runs")
    solo = [_serve_streams(model, local, [p], k)[0][0] for p, k in zip(prompt_ids, lengths)]
    api_solo = [asyncio.run(_api_streams(model, tok, None, [t], k))[0][0] for t, k in zip(texts, lengths)]
    workers = {p: subprocess.Popen(["taskset", "-c", ",".join(map(str, sorted(c))), sys.executable, __file__,
                                    "--_stage_worker", str(path)],
                                   env={**os.environ, STAGE_PEER_ENV: p,
                                        **({pipeline_profile.PROFILE_ENV: str(profiles[p])} if profiles else {})},
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
               for p, c in zip(peers[1:], cores[1:])}
    try:
        link = _PipeLink(workers)
        layout = StageLayout(1, 1, PIPE_COORD, tuple(Stage(*st) for st in stages))
        for p in workers:
            link.send(p, layout.to_message())
        ffn = link.ffn = StagedFFN(model, layout, link)
        # The product's price of a round of groups: every peer at the speed join measures (hello's
        # ffn_gflops; equal cores a peer), a pipe's round trip taken as none.
        gflops = measure_ffn_gflops()
        priced = [PeerCost(p, 10**12, gflops) for p in peers]
        pricer = GroupPricer(LayerCosts.from_model(model), priced[0], priced[1:], stages)
        out["pricer"] = {"gflops": round(gflops, 2), "groups": {n: pricer.best_groups(n) for n in [1, *levels]}}
        width = len(stages)  # the API's pool: at least one scheduler per stage (api_engine.schedulers_for)
        extra_widths = [int(k) for k in str(args.schedulers).split(",") if k and int(k) != width]
        _serve_streams(model, ffn, prompt_ids[:1], 4)  # the worker loads its layers
        # Interleaved rounds: each round runs every configuration once, one peer beside the
        # stages, so load from other work on the machine hits both sides of a ratio alike.
        for r in range(args.rounds):
            for n in [1, *levels]:
                ids, tx, ks = prompt_ids[:n], texts[:n], lengths[:n]
                spin0[0] = spin_counts()
                cpu0 = cpu_s()
                toks, tps, gaps = _serve_streams(model, local, ids, ks)
                record(f"one_peer_{n}", toks, tps, gaps, solo, cpu0)
                ffn.set_schedulers(width)  # as the API's pool tells it: no groups within a step
                cpu0 = cpu_s()
                toks, tps, gaps = profiled(f"stages_schedulers_{n}", r, lambda: _serve_streams(
                    model, ffn, ids, ks, schedulers=min(width, n)))
                record(f"stages_schedulers_{n}", toks, tps, gaps, solo, cpu0)
                for k in extra_widths:  # --schedulers: more batch schedulers than stages, raw
                    ffn.set_schedulers(k)
                    cpu0 = cpu_s()
                    toks, tps, gaps = profiled(f"stages_{k}_schedulers_{n}", r, lambda: _serve_streams(
                        model, ffn, ids, ks, schedulers=min(k, n)))
                    record(f"stages_{k}_schedulers_{n}", toks, tps, gaps, solo, cpu0)
                ffn.set_schedulers(width)
                cpu0 = cpu_s()
                got, tps, gaps, _, n_tok = asyncio.run(_api_streams(model, tok, None, tx, ks))
                record(f"api_one_peer_{n}", got, tps, gaps, api_solo, cpu0, n_tok)
                if args.unpriced:  # the API as before the price: one scheduler per stage
                    ffn.set_pricer(None)
                    cpu0 = cpu_s()
                    got, tps, gaps, stepped, n_tok = profiled(f"api_stages_unpriced_{n}", r, lambda: asyncio.run(
                        _api_streams(model, tok, ffn, tx, ks)))
                    record(f"api_stages_unpriced_{n}", got, tps, gaps, api_solo, cpu0, n_tok,
                           schedulers_stepped=stepped)
                ffn.set_pricer(pricer)
                if args.evening_off:  # the same, the pool's evening of groups turned off
                    with _evening(False) as moves:
                        cpu0 = cpu_s()
                        got, tps, gaps, stepped, n_tok = profiled(f"api_stages_no_evening_{n}", r, lambda: asyncio.run(
                            _api_streams(model, tok, ffn, tx, ks)))
                    record(f"api_stages_no_evening_{n}", got, tps, gaps, api_solo, cpu0, n_tok,
                           schedulers_stepped=stepped, evening_moves=moves[0])
                with _evening(True) as moves:
                    cpu0 = cpu_s()
                    got, tps, gaps, stepped, n_tok = profiled(f"api_stages_{n}", r, lambda: asyncio.run(
                        _api_streams(model, tok, ffn, tx, ks)))
                record(f"api_stages_{n}", got, tps, gaps, api_solo, cpu0, n_tok, schedulers_stepped=stepped,
                       evening_moves=moves[0])
            out["load_avg_1m_after_round"] = [*out.get("load_avg_1m_after_round", []), round(os.getloadavg()[0], 2)]
        out["pipelined_steps"], out["stage_failures"] = ffn.pipelined_steps, link.failures
    finally:
        for proc in workers.values():
            proc.stdin.close()
        for proc in workers.values():
            proc.wait(30)
    if args.profile:  # each stage worker wrote its stamps as it ended
        for (name, rnd), prof in pipeline_profile.summarize(list(profiles.values())).items():
            runs[name][rnd]["profile"] = prof

    def ratios(a, b):  # per round, and their median
        per = [round(x["aggregate_tok_s"] / y["aggregate_tok_s"], 3) for x, y in zip(runs[a], runs[b])]
        return {"per_round": per, "median": statistics.median(per)}

    out["ratios"] = {}
    for n in [1, *levels]:
        out["ratios"][f"{n}_streams"] = {"api_stages_vs_api_one_peer": ratios(f"api_stages_{n}", f"api_one_peer_{n}"),
                                         "raw_stages_vs_raw_one_peer": ratios(f"stages_schedulers_{n}",
                                                                              f"one_peer_{n}")}
        if args.unpriced:
            out["ratios"][f"{n}_streams"]["api_stages_vs_api_stages_unpriced"] = ratios(
                f"api_stages_{n}", f"api_stages_unpriced_{n}")
            out["ratios"][f"{n}_streams"]["api_stages_unpriced_vs_api_one_peer"] = ratios(
                f"api_stages_unpriced_{n}", f"api_one_peer_{n}")
        if args.evening_off:
            out["ratios"][f"{n}_streams"]["api_stages_vs_api_stages_no_evening"] = ratios(
                f"api_stages_{n}", f"api_stages_no_evening_{n}")
        for k in extra_widths:
            out["ratios"][f"{n}_streams"][f"raw_{k}_schedulers_vs_raw_one_peer"] = ratios(
                f"stages_{k}_schedulers_{n}", f"one_peer_{n}")
    keys = ("aggregate_tok_s", "p50_token_ms", "p95_token_ms", "p95_token_ms_all_started",
            "coordinator_cpu_ms_per_token", "workers_cpu_ms_per_token")
    out["medians"] = {name: {k: statistics.median(x[k] for x in rs) for k in keys if all(x[k] is not None for x in rs)}
                      for name, rs in runs.items()}
    out["all_equal_to_solo"] = all(x["equal_to_solo"] for rs in runs.values() for x in rs)
    out["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return out


# The options of --pipeline alone (none has an effect without it), with their defaults there.
PIPELINE_DEFAULTS = {"streams": "8,16", "cores": "0,1", "schedulers": "", "split": None, "profile": False,
                     "unpriced": False, "lengths": "equal", "evening_off": False, "out": None}


def _check_pipeline_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (``parser.error``) a --pipeline option given without --pipeline, which would be
    ignored; fills in the defaults of those left out."""
    given = [f"--{name.replace('_', '-')}" for name in PIPELINE_DEFAULTS if getattr(args, name) not in (None, False)]
    if given and not args.pipeline:
        parser.error(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to --pipeline runs: "
                     f"add --pipeline, or drop {' and '.join(given)}")
    for name, default in PIPELINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


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
    parser.add_argument("--pipeline", action="store_true",
                        help="stages pipelined over two pinned peer processes vs one peer (no root)")
    # The --pipeline options default to None (False: --profile) so that one given without
    # --pipeline is told from one left out; PIPELINE_DEFAULTS fills them in.
    parser.add_argument("--streams", help="--pipeline: concurrent streams, comma-separated levels (default 8,16)")
    parser.add_argument("--cores",
                        help="--pipeline: each peer's cores, the coordinator's first (e.g. 0-7,8-15; three peers: 0,1,2; "
                        "default 0,1)")
    parser.add_argument("--schedulers",
                        help="--pipeline: also run the raw stages with these numbers of batch schedulers "
                        "(comma-separated; the product runs one per stage)")
    parser.add_argument("--split", help="--pipeline: where each stage after the coordinator's starts, e.g. 11 "
                        "(default: the planner's throughput split)")
    parser.add_argument("--profile", action="store_true",
                        help="--pipeline: profile each run over the stages: a group's hand-off against its compute "
                        "(bench/pipeline_profile.py)")
    parser.add_argument("--unpriced", action="store_true",
                        help="--pipeline: also serve the API over the stages with one scheduler per stage, "
                        "not placed by the planner's price")
    parser.add_argument("--lengths", choices=("equal", "mixed"),
                        help="--pipeline: every stream --tokens long (equal, the default), or a quarter to all of it "
                        "(mixed: streams finish at different steps)")
    parser.add_argument("--evening-off", action="store_true",
                        help="--pipeline: also serve the API over the stages with the pool's evening of groups off")
    parser.add_argument("--out", help="--pipeline: also write the JSON here")
    parser.add_argument("--_inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_stage_worker", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--_worker", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--signal", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _check_pipeline_options(parser, args)
    if args._stage_worker:
        _stage_worker_main(args._stage_worker)
        return
    if args.pipeline:
        result = json.dumps(_pipeline_main(args), indent=2)
        print(result)
        if args.out:
            Path(args.out).write_text(result + "\n")
        return
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
