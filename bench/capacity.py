"""Capacity at real shape: a model no peer can hold, over capped peers, against one machine.

Writes (once) a random model of a real MoE's shape from random quant blocks, split into shards
as such models ship (``bench/random_gguf.py``; default: Qwen3-30B-A3B's shape in the Q4_K_M
mix, ~17 GB), then measures in one run, each peer in its own network namespace and cgroup v1
memory group, the page cache dropped before each run:

* ``local``: one machine, no cap — the same request through the engine the API uses;
* ``local_capped``: one machine under the cap (the file streams from disk);
* ``swarm_N``: N peers, each ``join --model FILE --memory CAP`` in a group capped at CAP
  (``swarm_N_kill``: the last stage's peer killed a quarter into the measured reply),
  forming from the first ``join`` (seconds), then the request through the API;
* ``llamacpp_capped``: llama.cpp (llama-cpp-python) under the cap, on the same files.

Each run reports prefill (time to the first token) and decode tok/s, peak memory per process,
OOM kills, and whether the greedy text equals the uncapped local run's. Needs root (namespaces,
cgroups). Prints one JSON document.

    python3 bench/capacity.py --dir /var/tmp/capacity              # the 17 GB model, cap 40 %
    python3 bench/capacity.py --preset moe-2g --runs local,swarm_3  # the CI test's model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.random_gguf import PRESETS, write_qwen3moe  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
          "cheaper than ever before, and")
PEER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "COLIBRI_SWARM_THREADS": "1"}

# The request in a namespace: the API's raw completion, streamed, each piece timed.
CLIENT = """
import json, sys, time, openai
url, token, prompt, n = sys.argv[1:5]
client = openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=1800)
text, times, t0 = "", [], time.monotonic()
try:
    model = client.models.list().data[0].id
    t0 = time.monotonic()
    for chunk in client.completions.create(model=model, prompt=prompt, stream=True, max_tokens=int(n), temperature=0):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece:
            text += piece
            times.append(time.monotonic() - t0)
            print(json.dumps({"event": "piece", "chars": len(text)}), flush=True)
    print(json.dumps({"event": "done", "text": text, "times": times}), flush=True)
except Exception as exc:
    print(json.dumps({"event": "error", "error": repr(exc)[:500], "text": text, "times": times}), flush=True)
"""

# One machine: the API's own backend on the raw prompt, each piece timed (a short warm-up first).
LOCAL = """
import json, resource, sys, time
from swarm.compute.model import load_model
from swarm.compute.textgen import GenerationStats
from swarm.compute.tokenizer import tokenizer_for
from swarm.peer.coordinator.api_engine import EngineBackend
from swarm.peer.coordinator.api_request import parse_completion_request
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load_model(path)
backend = EngineBackend(model, tokenizer_for(model), model_id=model.path.name)
def run(k):
    req = parse_completion_request({"prompt": prompt, "max_tokens": k, "temperature": 0}, model_id=model.path.name,
                                   max_tokens_limit=4096)
    text, times, t0 = "", [], time.monotonic()
    for piece in backend.generate(req, GenerationStats()):
        if piece.text:
            text += piece.text
            times.append(time.monotonic() - t0)
    return text, times
run(2)
text, times = run(n)
print(json.dumps({"event": "done", "text": text, "times": times}), flush=True)
"""


def rates(times: list[float], prompt_tokens: int) -> dict:
    """Prefill and decode speed from the arrival times of the pieces (s since the request)."""
    if len(times) < 2:
        return {"ttft_s": times[0] if times else None}
    return {"ttft_s": round(times[0], 3), "prefill_tok_s": round(prompt_tokens / times[0], 2),
            "decode_tok_s": round((len(times) - 1) / (times[-1] - times[0]), 3), "pieces": len(times)}


def model_files(args) -> list[Path]:
    first = args.dir / f"{args.preset}.gguf"
    shards = sorted(args.dir.glob(f"{args.preset}-0*-of-*.gguf"))
    if shards or first.exists():
        return shards or [first]
    t0 = time.monotonic()
    files = write_qwen3moe(first, PRESETS[args.preset], shard_bytes=int(args.shard_gb * 1e9),
                           name=f"random {args.preset} (bench/random_gguf.py)")
    print(json.dumps({"event": "written", "files": [str(f) for f in files], "s": round(time.monotonic() - t0, 1)}),
          file=sys.stderr)
    return files


async def _finish(proc, timeout_s: float) -> dict:
    return await proc.wait_for(lambda e: e.get("event") in ("done", "error"), timeout_s)


async def run_local(lab, files, cap: int | None, args, prompt_tokens: int) -> dict:
    from tests.multihost.netns import MemoryCgroup
    from tests.multihost.test_capacity import Peaks, drop_page_cache

    for f in files:
        drop_page_cache(f)
    group = MemoryCgroup(f"local{cap or 0}", cap) if cap else None
    proc = lab.spawn(0, ["-c", LOCAL, str(files[0]), PROMPT, str(args.tokens)], env=PEER_ENV, cgroup=group)
    peaks = Peaks([proc], [group]) if group else None
    sampler = asyncio.create_task(peaks.run()) if peaks else None
    try:
        done = await _finish(proc, args.timeout)
    finally:
        if sampler:
            sampler.cancel()
        proc.kill()
    out = {"text": done.get("text"), **rates(done.get("times", []), prompt_tokens)}
    if group:
        out.update(peak=peaks.peak[0], oom_kills=group.stats()["oom_kill"], cap=cap)
        group.close()
    return out


async def run_swarm(lab, files, n: int, cap: int, args, prompt_tokens: int, expected: str | None,
                    kill: bool = False) -> dict:
    from swarm.keys.swarmkey import SwarmKey
    from tests.multihost.netns import MemoryCgroup
    from tests.multihost.test_capacity import Peaks, drop_page_cache
    from tests.multihost.test_mesh_multihost import read_status, until
    from tests.multihost.test_stages_multihost import staged_coordinator
    from tests.multihost.test_swarm_multihost import coordinator_of

    def formed(docs):  # a coordinator whose plan, or stage layout, places work on every other peer
        return coordinator_of(docs) or staged_coordinator(docs)

    for f in files:
        drop_page_cache(f)
    key = SwarmKey(os.urandom(32))
    groups = [MemoryCgroup(f"swarm{n}-{i}", cap) for i in range(n)]
    procs: list = []
    peaks = Peaks(procs, groups)
    sampler = asyncio.create_task(peaks.run())
    out: dict = {"peers": n, "cap": cap}
    try:
        t0 = time.monotonic()
        for i in range(n):
            procs.append(lab.spawn(i, ["-m", "swarm", "-v", "join", "--model", str(files[0]), "--key", key.code,
                                       "--name", f"host{i}", "--memory", str(cap >> 20), "--layout", args.layout],
                                   env=PEER_ENV, cgroup=groups[i]))
        docs = lambda: {i: read_status(lab, i) for i in range(n)}  # noqa: E731
        await until(lambda: all(docs().values()) and formed(docs()) is not None, args.timeout,
                    "one swarm over every peer", procs)
        out["form_s"] = round(time.monotonic() - t0, 1)
        c, doc = formed(docs())
        placement = doc["placement"]
        out["placement"] = {k: placement.get(k) for k in ("layout", "stages", "streamed_bytes", "version")}
        out["budgets"] = [d["memory_budget"] for d in docs().values()]
        from swarm.peer.coordinator.api_tls import write_ca

        ca = write_ca(key, lab.workdir)
        url = f"https://{lab.addresses[c]}:{placement['api_port']}/v1"
        for k in (2, args.tokens):  # a short warm-up request, then the measured one
            client = lab.spawn(n, ["-c", CLIENT, url, key.api_token, PROMPT, str(k)], env={"SSL_CERT_FILE": str(ca)})
            if kill and k == args.tokens:  # a stage peer (the last) killed after a quarter of the reply
                victim = next(i for i in range(n) if docs()[i] and docs()[i]["peer_id"] == placement["stages"][-1][0])
                await client.wait_for(lambda e: e.get("event") == "piece", args.timeout,
                                      since=max(args.tokens // 4 - 1, 0))
                procs[victim].kill()
                out["killed"] = {"host": victim, "stage": placement["stages"][-1]}
            done = await _finish(client, args.timeout)
        out.update(text=done.get("text"), error=done.get("error"), **rates(done.get("times", []), prompt_tokens))
        out["text_equal"] = expected is not None and done.get("text") == expected
    finally:
        sampler.cancel()
        out["peaks"] = peaks.peak
        out["oom_kills"] = [g.stats()["oom_kill"] for g in groups]
        for p in procs:
            p.kill()
        for g in groups:
            g.close()
    return out


async def run_llamacpp(lab, files, cap: int, args, prompt_ids: list[int]) -> dict:
    from tests.multihost.netns import MemoryCgroup
    from tests.multihost.test_capacity import drop_page_cache

    for f in files:
        drop_page_cache(f)
    group = MemoryCgroup("llamacpp", cap)
    proc = lab.spawn(0, [str(REPO / "bench" / "engine.py"), "--worker", "llamacpp", "--model", str(files[0]),
                         "--threads", "1", "--prompt-ids", ",".join(map(str, prompt_ids)),
                         "--decode-tokens", str(args.tokens - 1), "--repeats", "1"], env=PEER_ENV, cgroup=group)
    try:
        got = await proc.wait_for(lambda e: "decode_tok_s" in e or e.get("event") == "non-json", args.timeout)
    except AssertionError as exc:
        got = {"error": str(exc)[-800:]}
    finally:
        proc.kill()
    got.update(oom_kills=group.stats()["oom_kill"], cap=cap)
    group.close()
    return got


async def main_async(args) -> dict:
    from swarm.compute.model import load_model
    from swarm.compute.tokenizer import tokenizer_for
    from tests.multihost.netns import NetnsLab, remove_stale_cgroups

    files = model_files(args)
    size = sum(f.stat().st_size for f in files)
    model = load_model(files[0])
    prompt_ids = tokenizer_for(model).encode(PROMPT)
    del model
    cap = int(size * args.cap_fraction) if args.cap_mib is None else args.cap_mib << 20
    report: dict = {"model": {"preset": args.preset, "files": [f.name for f in files], "bytes": size},
                    "cap_bytes": cap, "tokens": args.tokens, "prompt_tokens": len(prompt_ids), "cpus": os.cpu_count(),
                    "load_average_before": [round(x, 2) for x in os.getloadavg()], "runs": {}}
    remove_stale_cgroups()
    runs = args.runs.split(",")
    n_max = max([int(r.split("_")[1]) for r in runs if r.startswith("swarm_")] + [1])
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        lab = NetnsLab(n_max + 1, Path(tmp)).setup()
        try:
            expected = None
            for run in runs:
                print(json.dumps({"event": "run", "run": run}), file=sys.stderr, flush=True)
                if run == "local":
                    got = await run_local(lab, files, None, args, len(prompt_ids))
                    expected = got["text"]
                elif run == "local_capped":
                    got = await run_local(lab, files, cap, args, len(prompt_ids))
                elif run.startswith("swarm_"):  # swarm_N, or swarm_N_kill: a stage peer killed mid-reply
                    got = await run_swarm(lab, files, int(run.split("_")[1]), cap, args, len(prompt_ids), expected,
                                          kill=run.endswith("_kill"))
                elif run == "llamacpp_capped":
                    got = await run_llamacpp(lab, files, cap, args, prompt_ids)
                else:
                    raise SystemExit(f"unknown run {run!r}: use local, local_capped, swarm_N, swarm_N_kill, llamacpp_capped")
                if expected is not None and "text" in got and run != "local":
                    got["text_equal"] = got["text"] == expected
                report["runs"][run] = got
                print(json.dumps({"event": "result", "run": run, **got}), file=sys.stderr, flush=True)
        finally:
            lab.close()
    base = report["runs"].get("local", {}).get("decode_tok_s")
    capped = report["runs"].get("local_capped", {}).get("decode_tok_s")
    report["ratios"] = {run: {"vs_local": round(r["decode_tok_s"] / base, 3) if base else None,
                              "vs_local_capped": round(r["decode_tok_s"] / capped, 2) if capped else None}
                        for run, r in report["runs"].items() if r.get("decode_tok_s")}
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/colibri-capacity"), help="where the model is kept")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard size when writing the model")
    ap.add_argument("--cap-fraction", type=float, default=0.4, help="each peer's memory cap, as a fraction of the model")
    ap.add_argument("--cap-mib", type=int, help="each peer's memory cap in MiB (instead of --cap-fraction)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated by the measured request")
    ap.add_argument("--layout", default="auto", choices=("auto", "ranges", "stages", "mix"))
    ap.add_argument("--runs", default="local,local_capped,swarm_2,swarm_3,llamacpp_capped")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds any one step may take")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: peers run in network namespaces and memory cgroups")
    print(json.dumps(asyncio.run(main_async(args)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
