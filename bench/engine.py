"""Engine speed against llama.cpp and transformers on the same model and thread count; prints JSON.

    python3 bench/engine.py [--model PATH] [--threads 1,2,4] [--prompt-tokens 128] [--decode-tokens 64]
    python3 bench/engine.py --make-moe PATH   # write the random 64-expert Qwen3-MoE Q8_0 GGUF (~1 GB)
    python3 bench/engine.py --make-moe-2g PATH Q4_K_M   # 12 layers of 64 experts, 2.4 GB (Q8_0: 4.2 GB)
    python3 bench/engine.py --make-dense-2g PATH Q4_K_M   # Qwen3-4B's shape, dense, 2.3 GB (Q8_0: 4.1 GB)
    python3 bench/engine.py --make-tokenizer TOK.gguf   # the default model's tokenizer alone (~2 MB)
    python3 bench/engine.py --tokenizer-from TOK.gguf --make-moe-2g PATH Q8_0   # without the default model

Each thread count is measured in turn; the JSON has one entry per count in ``runs``, with the
copy bandwidth at that count beside the engines, and the machine (CPU, cores, flags) once.
llama.cpp runs through llama-cpp-python (a benchmark-only package; build it for the CPU's own
instruction set): its version and ``llama_print_system_info()`` are recorded under ``build``.
``llamabench`` runs llama.cpp's own ``llama-bench`` binary instead (``--llama-bench PATH`` or
``$LLAMA_BENCH``; built from llama.cpp's source with CMake, ``-DGGML_NATIVE=ON``): prefill is its
``pp`` test of ``--prompt-tokens``, decode its ``tg`` test of ``--decode-tokens`` after that many
tokens of context (``-d``), each the best of ``--repeats``; its build commit, CPU and backends are
recorded under ``build``, and its ratios are by wall time (it reports no CPU seconds).
transformers reads the GGUF itself.

Each engine runs in its own child process (this script with ``--worker NAME``), so the
peak RSS reported is that engine's alone, and both get the same BLAS/OpenMP thread limits
(environment variables before import, ``torch.set_num_threads``, ``threadpoolctl``).

What is measured, per engine, after one warm-up generation (weights decoded, caches hot):
- prefill tok/s: a prompt of exactly ``--prompt-tokens`` ids run as one batch into an empty
  KV cache, up to the logits of its last position;
- decode tok/s: greedy steps of one token each with the KV cache, ``--decode-tokens`` of
  them after that prefill, sampling included;
  both as the best of ``--repeats`` runs (the least disturbed by other processes on a shared
  machine) and as their median, with each run's wall and process-CPU seconds;
- peak RSS in MiB (``getrusage``), load seconds (open + decode weights).
Greedy decoding on the same prompt also gives a token-agreement figure for free.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE_NAME = "random 64-expert Qwen3-MoE (bench/engine.py --make-moe)"
PROMPT_TEXT = (
    "The history of astronomy spans thousands of years, from the first people who tracked the Moon "
    "and planets across the night sky to the space telescopes that now photograph galaxies billions "
    "of light years away. Ancient observers in Babylon, Egypt, China and Greece kept careful records "
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF directory (default: the default model, SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", default="2", help="thread counts to measure, comma-separated (e.g. 1,2,4,8,16)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--numerics", default="float32",
                    help="the engine's activation numerics to measure, comma-separated (float32, int8: "
                    "swarm/compute/numerics.py); each beyond float32 is reported as colibri_NAME")
    ap.add_argument("--engines", default="colibri,llamacpp,transformers",
                    help="comma-separated: colibri, llamacpp, llamabench, transformers")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                    help="llama.cpp's llama-bench binary, for --engines llamabench (default: $LLAMA_BENCH)")
    ap.add_argument("--make-moe", metavar="PATH", help="write the random MoE GGUF to PATH and exit")
    ap.add_argument("--make-moe-2g", nargs=2, metavar=("PATH", "TYPE"),
                    help="write a random Qwen3-MoE of 12 layers, 64 experts (top 8) of 2048x768, in TYPE "
                    "(Q8_0: 4.3 GB, Q4_K_M: llama.cpp's mix of Q4_K and Q6_K, 2.5 GB) to PATH and exit")
    ap.add_argument("--make-dense-2g", nargs=2, metavar=("PATH", "TYPE"),
                    help="write a random dense Qwen3 of Qwen3-4B's shape (36 layers, hidden 2560, MLP 9728) in TYPE "
                    "(Q8_0: 4.1 GB, Q4_K_M: 2.3 GB) to PATH and exit")
    ap.add_argument("--make-tokenizer", metavar="PATH",
                    help="write a GGUF holding only the default model's tokenizer to PATH and exit (a small file to "
                    "take to a machine that cannot fetch the default model)")
    ap.add_argument("--tokenizer-from", metavar="GGUF",
                    help="the GGUF whose tokenizer --make-moe/--make-moe-2g copy (default: the default model's; "
                    "also $BENCH_TOKENIZER_GGUF)")
    ap.add_argument("--out", metavar="PATH",
                    help="also write the JSON report to PATH, rewritten after each thread count: a run cut "
                    "short (a time limit) keeps the counts it measured")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(args)

    sys.path.insert(0, str(REPO))
    if args.tokenizer_from:
        os.environ["BENCH_TOKENIZER_GGUF"] = args.tokenizer_from
    if args.make_tokenizer:
        print(write_tokenizer_gguf(Path(args.make_tokenizer)))
        return 0
    if args.make_moe:
        print(write_random_moe(Path(args.make_moe)))
        return 0
    if args.make_moe_2g:
        print(write_moe_2g(Path(args.make_moe_2g[0]), args.make_moe_2g[1]))
        return 0
    if args.make_dense_2g:
        print(write_dense_2g(Path(args.make_dense_2g[0]), args.make_dense_2g[1]))
        return 0
    if args.model is None:
        from swarm.compute.default_model import default_model_path

        args.model = str(default_model_path())
    if "llamabench" in args.engines.split(",") and not (args.llama_bench and Path(args.llama_bench).is_file()):
        raise SystemExit("--engines llamabench needs llama.cpp's llama-bench binary: --llama-bench PATH or "
                         "$LLAMA_BENCH (cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench)")
    counts = [int(n) for n in str(args.threads).split(",")]
    # tokenized here, so no engine's peak RSS includes this project's tokenizer
    prompt = ",".join(map(str, _prompt_ids(args.model, args.prompt_tokens)))
    report: dict = {"model": _model_label(args.model), "machine": _machine(), "prompt_tokens": args.prompt_tokens,
                    "decode_tokens": args.decode_tokens, "repeats": args.repeats, "runs": []}
    for n in counts:
        report["runs"].append(_measure(args, prompt, n))
        print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)  # progress of a long run
        if args.out:
            _write_json(Path(args.out), report)
    print(json.dumps(report, indent=2))
    return 0


def _write_json(path: Path, report: dict) -> None:
    """``report`` as indented JSON at ``path``, replaced whole (a reader never sees half of it)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(part, path)


def _measure(args: argparse.Namespace, prompt: str, threads: int) -> dict:
    """Every engine at ``threads`` threads, each in its own child process; their ratios."""
    # the repository first, then any path already set (packages installed with pip --target)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, COLIBRI_SWARM_THREADS=str(threads), NUMBA_NUM_THREADS="1")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    report: dict = {"threads": threads, "load_average_before": [round(x, 2) for x in os.getloadavg()],
                    "copy_gb_s": _copy_gb_s(threads)}
    runs = []
    for engine in args.engines.split(","):
        runs += [(engine, n) for n in args.numerics.split(",")] if engine == "colibri" else [(engine, "float32")]
    for engine, numerics in runs:
        name = engine if numerics == "float32" else f"{engine}_{numerics}"
        cmd = [sys.executable, __file__, "--worker", engine, "--model", args.model, "--threads", str(threads),
               "--prompt-ids", prompt, "--decode-tokens", str(args.decode_tokens),
               "--repeats", str(args.repeats), *(["--llama-bench", args.llama_bench] if args.llama_bench else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, COLIBRI_SWARM_NUMERICS=numerics))
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            raise SystemExit(f"the {name} worker failed (exit {done.returncode})")
        report[name] = json.loads(done.stdout.strip().splitlines()[-1])
    for name in [k for k in report if k.startswith("colibri_")]:
        if "colibri" in report:
            report[f"{name}_over_float32"] = _ratios(report[name], report["colibri"])
            same = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(
                report[name]["greedy_ids"], report["colibri"]["greedy_ids"])))
            report[f"{name}_greedy_prefix_agreement"] = f"{same}/{len(report['colibri']['greedy_ids'])}"
        if "llamabench" in report:
            report[f"{name}_ratio_vs_llamabench"] = _ratios(report[name], report["llamabench"])
    if "colibri" in report and "transformers" in report:
        ours, theirs = report["colibri"], report["transformers"]
        report["speedup_vs_transformers"] = {
            "prefill": round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 3),
            "decode": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 3),
        }
        report["speedup_by_cpu_time"] = _cpu_ratio(ours, theirs)
        same = 0
        for a, b in zip(ours["greedy_ids"], theirs["greedy_ids"]):
            if a != b:
                break
            same += 1
        report["greedy_prefix_agreement"] = f"{same}/{len(ours['greedy_ids'])}"
    if "colibri" in report and "llamacpp" in report:
        ours, theirs = report["colibri"], report["llamacpp"]
        report["ratio_vs_llamacpp"] = _ratios(ours, theirs)  # targets: decode >= 0.9, prefill >= 1.0
        # on a shared machine wall time measures the neighbours too; with one thread (no
        # spin-waiting), CPU seconds are the steadier figure
        report["ratio_vs_llamacpp_by_cpu_time"] = _cpu_ratio(ours, theirs)
    if "colibri" in report and "llamabench" in report:
        ours, theirs = report["colibri"], report["llamabench"]
        report["ratio_vs_llamabench"] = _ratios(ours, theirs)  # by wall time: llama-bench reports no CPU seconds
    for engine in ("colibri", "llamacpp", "transformers", *(k for k in report if k.startswith("colibri_"))):
        if isinstance(report.get(engine), dict):
            report[engine].pop("greedy_ids", None)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def _ratios(ours: dict, theirs: dict) -> dict:
    """Our decode and prefill tok/s and peak RSS over theirs."""
    return {"decode": round(ours["decode_tok_s"] / theirs["decode_tok_s"], 3),
            "prefill": round(ours["prefill_tok_s"] / theirs["prefill_tok_s"], 3),
            "peak_rss": round(ours["peak_rss_mib"] / theirs["peak_rss_mib"], 3)}


def _machine() -> dict:
    """The CPU this ran on: model name, logical CPUs, the cores this process may use, and the
    instruction-set flags that matter to the kernels."""
    from swarm.compute.threads import available_cores

    name, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {"cpu": name, "cpus": os.cpu_count(), "available_cores": available_cores(),
            "flags": [f for f in wanted if f in flags]}


def _copy_gb_s(threads: int, nbytes: int = 1 << 30) -> float:
    """What the machine streams: GB/s of a 1 GiB copy (bytes read + bytes written), cut into
    ``threads`` parts on the engine's own compute threads; the best of 3."""
    import numpy as np

    from swarm.compute import threads as pool

    src, dst = np.ones(nbytes // 8), np.empty(nbytes // 8)
    pool.set_threads(threads)
    parts = pool.split(src.size, threads, 1 << 16)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        pool.run_chunks(lambda lo, hi: np.copyto(dst[lo:hi], src[lo:hi]), parts)
        best = min(best, time.perf_counter() - t0)
    return round(2 * nbytes / best / 1e9, 1)


def _cpu_ratio(ours: dict, theirs: dict) -> dict:
    """Their median process-CPU seconds over ours, for prefill and decode (> 1: we use less)."""
    def cpu(engine: dict, phase: int) -> float:
        return statistics.median(run[phase] for run in engine["cpu_s_runs"])

    return {"prefill": round(cpu(theirs, 0) / cpu(ours, 0), 3), "decode": round(cpu(theirs, 1) / cpu(ours, 1), 3)}


def _model_label(path: str) -> str:
    """How a result names its model, never by a path of the machine that measured it: the file
    name, plus for a GGUF its architecture, expert count and size; the random MoE says how it
    is built."""
    p = Path(path)
    if not p.is_file():
        return p.name
    from swarm.compute.tensors import GGUFFile

    kv = GGUFFile(p).kv
    arch = kv.get("general.architecture", "?")
    if kv.get("general.name") == MOE_NAME:
        return (f"random Qwen3-MoE Q8_0 built by `python3 bench/engine.py --make-moe PATH` (write_random_moe "
                f"defaults: 9 layers, 64 experts, top 8, hidden 1024, expert FFN 512), {p.stat().st_size / 1e9:.2f} GB")
    experts = kv.get(f"{arch}.expert_count")
    return f"{p.name} ({arch}{f', {experts} experts' if experts else ''}, {p.stat().st_size / 1e6:.0f} MB)"


def _prompt_ids(model_path: str, n: int) -> list[int]:
    from swarm.compute.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT_TEXT, add_special_tokens=False)
    return ids[:n]


def _worker(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO))
    args.threads = int(args.threads)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
    except ImportError:  # the thread variables the parent set do the same for BLAS and OpenMP
        pass
    prompt = [int(i) for i in args.prompt_ids.split(",")]
    run = {"colibri": _run_colibri, "llamacpp": _run_llamacpp, "llamabench": _run_llama_bench,
           "transformers": _run_transformers}[args.worker]
    result = run(args, prompt)
    # llama-bench runs as this worker's child: its peak is the children's
    who = resource.RUSAGE_CHILDREN if args.worker == "llamabench" else resource.RUSAGE_SELF
    result["peak_rss_mib"] = round(resource.getrusage(who).ru_maxrss / 1024, 1)
    print(json.dumps(result))
    return 0


def _summary(load_s: float, prefills: list[float], decodes: list[float], n_prompt: int, n_decode: int,
             greedy: list[int], cpu: list[tuple[float, float]]) -> dict:
    return {
        "load_s": round(load_s, 2),
        **_speeds(prefills, decodes, n_prompt, n_decode),
        # process CPU seconds (all threads) per run: (prefill, decode); compare these when the
        # machine is shared, since wall time then measures the neighbours too
        "cpu_s_runs": [(round(p, 3), round(d, 3)) for p, d in cpu],
        "greedy_ids": greedy,
    }


def _speeds(prefills: list[float], decodes: list[float], n_prompt: int, n_decode: int) -> dict:
    """tok/s from the best and the median run, and each run's seconds."""
    return {
        "prefill_tok_s": round(n_prompt / min(prefills), 1),
        "decode_tok_s": round(n_decode / min(decodes), 1),
        "prefill_tok_s_median": round(n_prompt / statistics.median(prefills), 1),
        "decode_tok_s_median": round(n_decode / statistics.median(decodes), 1),
        "prefill_s_runs": [round(t, 3) for t in prefills],
        "decode_s_runs": [round(t, 3) for t in decodes],
    }


def _repeated(greedy_run, args: argparse.Namespace, prompt: list[int], load_s: float) -> dict:
    """A warm-up, then ``--repeats`` runs of ``greedy_run(ids, n) -> (prefill_s, decode_s, ids, cpu_s)``."""
    greedy_run(prompt[:8], 3)
    prefills, decodes, cpu, greedy = [], [], [], []
    for _ in range(args.repeats):
        p, d, greedy, c = greedy_run(prompt, args.decode_tokens)
        prefills.append(p)
        decodes.append(d)
        cpu.append(c)
    return _summary(load_s, prefills, decodes, len(prompt), args.decode_tokens, greedy, cpu)


def _run_colibri(args: argparse.Namespace, prompt: list[int]) -> dict:
    from swarm.compute import SamplingParams, generate, load_model

    t0 = time.perf_counter()
    model = load_model(args.model)
    if hasattr(model, "materialize"):
        model.materialize()  # decode every weight now, not inside the first timed step
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.decode_tokens + 1)  # greedy, no stop tokens
    list(generate(model, prompt[:8], SamplingParams(max_tokens=4)))  # warm-up
    prefills, decodes, cpu, greedy = [], [], [], []
    for _ in range(args.repeats):
        steps = generate(model, prompt, params, cache=model.new_cache(len(prompt) + args.decode_tokens + 1))
        t0, c0 = time.perf_counter(), time.process_time()
        first = next(steps)  # prefill + sampling the first token
        t1, c1 = time.perf_counter(), time.process_time()
        rest = list(steps)
        t2, c2 = time.perf_counter(), time.process_time()
        prefills.append(t1 - t0)
        decodes.append(t2 - t1)
        cpu.append((c1 - c0, c2 - c1))
        greedy = [first, *rest]
    return _summary(load_s, prefills, decodes, len(prompt), args.decode_tokens, greedy, cpu)


def _run_llamacpp(args: argparse.Namespace, prompt: list[int]) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=len(prompt) + args.decode_tokens + 8, n_batch=len(prompt),
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    load_s = time.perf_counter() - t0
    build = {"llama_cpp_python": llama_cpp.__version__,
             "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def argmax_last() -> int:  # the last evaluated position's logits, read in place
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

    def greedy_run(ids: list[int], n: int) -> tuple[float, float, list[int], tuple[float, float]]:
        llm.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        llm.eval(ids)
        token = argmax_last()
        t1, c1 = time.perf_counter(), time.process_time()
        tokens = [token]
        for _ in range(n):
            llm.eval([token])
            token = argmax_last()
            tokens.append(token)
        t2, c2 = time.perf_counter(), time.process_time()
        return t1 - t0, t2 - t1, tokens, (c1 - c0, c2 - c1)

    return {**_repeated(greedy_run, args, prompt, load_s), "build": build}


def _run_llama_bench(args: argparse.Namespace, prompt: list[int]) -> dict:
    """llama.cpp's ``llama-bench``: its pp test of len(prompt) tokens and its tg test of
    ``--decode-tokens`` after as many tokens of context, ``--repeats`` samples each (after its
    own warm-up); tok/s from the best and the median sample."""
    n_prompt, n_gen = len(prompt), args.decode_tokens
    cmd = [args.llama_bench, "-m", args.model, "-t", str(args.threads), "-r", str(args.repeats), "-o", "json",
           "-p", str(n_prompt), "-n", str(n_gen), "-d", f"0,{n_prompt}", "-ngl", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed (exit {done.returncode}): {done.stderr[-2000:]}")
    tests = json.loads(done.stdout)
    pp = next(t for t in tests if t["n_prompt"] == n_prompt and t["n_gen"] == 0 and t.get("n_depth", 0) == 0)
    tg = next(t for t in tests if t["n_gen"] == n_gen and t["n_prompt"] == 0 and t.get("n_depth", 0) == n_prompt)
    prefills = [ns / 1e9 for ns in pp["samples_ns"]]
    decodes = [ns / 1e9 for ns in tg["samples_ns"]]
    return {
        **_speeds(prefills, decodes, n_prompt, n_gen),
        "build": {k: pp.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "n_threads",
                                         "type_k", "flash_attn", "model_type", "model_size")},
    }


def qwen3moe_writer(path: Path, *, layers: int, hidden: int, experts: int, top_k: int, expert_ffn: int,
                    heads: int, kv_heads: int, name: str | None = None, head_dim: int | None = None,
                    shard_bytes: int = 0):
    """A ``gguf.GGUFWriter`` for a Qwen3-MoE at ``path`` with its hyperparameters written and the
    default model's tokenizer copied in (so every engine can load the file); returns
    ``(writer, vocab size)``. ``head_dim`` defaults to ``hidden // heads``; ``shard_bytes`` > 0
    splits the file into shards of at most that many bytes of tensors. The caller adds the
    tensors and writes the file. The tokenizer comes from ``$BENCH_TOKENIZER_GGUF`` when set."""
    import gguf

    from swarm.compute.default_model import default_model_path
    from swarm.compute.tensors import GGUFFile

    # $BENCH_TOKENIZER_GGUF: a GGUF holding the same tokenizer, for a machine without the default model
    source = GGUFFile(os.environ.get("BENCH_TOKENIZER_GGUF") or default_model_path())
    # no experts: a dense Qwen3 (GGUF "qwen3"), expert_ffn its MLP width
    w = gguf.GGUFWriter(str(path), "qwen3moe" if experts else "qwen3", split_max_size=shard_bytes)
    if name:
        w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(expert_ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim or hidden // heads)
    w.add_value_length(head_dim or hidden // heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(top_k)
        w.add_expert_feed_forward_length(expert_ffn)
    _copy_tokenizer(source, w)
    return w, len(source.kv["tokenizer.ggml.tokens"])


def _copy_tokenizer(source, w) -> None:
    """Every ``tokenizer.*`` key of ``source`` (a ``GGUFFile``) into the writer ``w``."""
    import gguf

    for key, value in source.kv.items():
        if key.startswith("tokenizer."):
            vtype = source.value_types[key]
            value = list(value) if vtype == gguf.GGUFValueType.ARRAY else value
            sub = gguf.GGUFValueType.get_type(value[0]) if vtype == gguf.GGUFValueType.ARRAY and value else None
            w.add_key_value(key, value, vtype, sub_type=sub)


def write_tokenizer_gguf(path: Path) -> Path:
    """A GGUF of no tensors holding the default model's tokenizer keys (~2 MB): what
    ``--tokenizer-from`` / ``$BENCH_TOKENIZER_GGUF`` take on a machine without the default model."""
    import gguf

    from swarm.compute.default_model import default_model_path
    from swarm.compute.tensors import GGUFFile

    source = GGUFFile(default_model_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), source.kv.get("general.architecture", "llama"))
    w.add_name("tokenizer of the default model (bench/engine.py --make-tokenizer)")
    _copy_tokenizer(source, w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_random_moe(path: Path, *, layers: int = 9, hidden: int = 1024, experts: int = 64, top_k: int = 8,
                     expert_ffn: int = 512, heads: int = 16, kv_heads: int = 4, seed: int = 0) -> Path:
    """A random Qwen3-MoE GGUF, weights Q8_0 (norms F32), with the default model's tokenizer so
    every engine can load it: 9 layers of 64 experts of 1024x512 give ~1.0 GB. Written one
    tensor at a time with ``gguf``'s writer and quantizer (never the float32 model in memory)."""
    import gguf
    import numpy as np

    Q8 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w, vocab = qwen3moe_writer(path, layers=layers, hidden=hidden, experts=experts, top_k=top_k,
                               expert_ffn=expert_ffn, heads=heads, kv_heads=kv_heads, name=MOE_NAME)
    hd = hidden // heads

    def q8(*shape: int, scale: float) -> np.ndarray:
        return gguf.quants.quantize((rng.standard_normal(shape, dtype=np.float32) * scale), Q8)

    def add(name: str, data: np.ndarray, qtype=Q8) -> None:
        w.add_tensor(name, data, raw_dtype=qtype)

    F32 = gguf.GGMLQuantizationType.F32
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    add("token_embd.weight", q8(vocab, hidden, scale=1.0))
    add("output_norm.weight", ones(hidden), F32)
    s_in, s_ffn = hidden ** -0.5, expert_ffn ** -0.5
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", ones(hidden), F32)
        add(b + "ffn_norm.weight", ones(hidden), F32)
        add(b + "attn_q.weight", q8(heads * hd, hidden, scale=s_in))
        add(b + "attn_k.weight", q8(kv_heads * hd, hidden, scale=s_in))
        add(b + "attn_v.weight", q8(kv_heads * hd, hidden, scale=s_in))
        add(b + "attn_output.weight", q8(hidden, heads * hd, scale=s_in))
        add(b + "attn_q_norm.weight", ones(hd), F32)
        add(b + "attn_k_norm.weight", ones(hd), F32)
        add(b + "ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32) * 4 * s_in, F32)
        add(b + "ffn_gate_exps.weight", q8(experts, expert_ffn, hidden, scale=s_in))
        add(b + "ffn_up_exps.weight", q8(experts, expert_ffn, hidden, scale=s_in))
        add(b + "ffn_down_exps.weight", q8(experts, hidden, expert_ffn, scale=s_ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The many-core benchmark's shape (bench/results/engine.md): a Qwen3-MoE at 2-4 GB.
MOE_2G = dict(layers=12, hidden=2048, experts=64, top_k=8, expert_ffn=768, heads=16, kv_heads=4, head_dim=128)
# Qwen3-4B's shape (its config.json) with the default model's 49,152-token vocabulary: 3.9 B weights.
DENSE_2G = dict(layers=36, hidden=2560, experts=0, top_k=0, expert_ffn=9728, heads=32, kv_heads=8, head_dim=128)


def write_moe_2g(path: Path, qtype: str) -> Path:
    """:data:`MOE_2G` of random blocks (bench/random_gguf.py) in ``qtype``: "Q8_0", "Q4_K" (every
    matrix) or "Q4_K_M" (llama.cpp's mix: Q6_K for the head, attn_v and some ffn_down)."""
    import gguf

    from bench.random_gguf import MoEShape, q4_k_m, write_qwen3moe

    mix = q4_k_m if qtype == "Q4_K_M" else (lambda *_: gguf.GGMLQuantizationType[qtype])
    return write_qwen3moe(path, MoEShape(**MOE_2G), mix=mix, name=f"random Qwen3-MoE {qtype} (bench/engine.py)")[0]


def write_dense_2g(path: Path, qtype: str) -> Path:
    """:data:`DENSE_2G` (a dense Qwen3) of random blocks in ``qtype``: "Q8_0" (4.1 GB) or
    "Q4_K_M" (llama.cpp's mix, 2.3 GB)."""
    import gguf

    from bench.random_gguf import MoEShape, q4_k_m, write_qwen3moe

    mix = q4_k_m if qtype == "Q4_K_M" else (lambda *_: gguf.GGMLQuantizationType[qtype])
    return write_qwen3moe(path, MoEShape(**DENSE_2G), mix=mix, name=f"random Qwen3 {qtype} (bench/engine.py)")[0]


def _run_transformers(args: argparse.Namespace, prompt: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    t0 = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0

    def greedy_run(ids: list[int], n: int) -> tuple[float, float, list[int], tuple[float, float]]:
        with torch.inference_mode():
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(torch.tensor([ids]), use_cache=True)
            token = int(out.logits[0, -1].argmax())
            t1, c1 = time.perf_counter(), time.process_time()
            past, tokens = out.past_key_values, [token]
            for _ in range(n):
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past, token = out.past_key_values, int(out.logits[0, -1].argmax())
                tokens.append(token)
            t2, c2 = time.perf_counter(), time.process_time()
        return t1 - t0, t2 - t1, tokens, (c1 - c0, c2 - c1)

    return _repeated(greedy_run, args, prompt, load_s)


if __name__ == "__main__":
    sys.exit(main())
