"""A GPU peer's stage (``join --gpu``: swarm/peer/worker/gpu.py, GpuStage) against the engine's CPU
layers on the same rows; prints one JSON document.

    python3 bench/gpu_stages.py [--model PATH] [--layers LO:HI] [--steps N] [--products]

Runs a prompt's prefill, then greedy decode steps, through layers LO..HI-1 twice — the engine's
own ``Model.layers`` (the reference, what a CPU stage peer answers) and the GPU stage, each with
its own KV cache — feeding both the rows the reference computes. The GPU stage runs whole layers
on the GPU (its KV cache in GPU buffers) where it can, or with ``--products`` (or where it
cannot) only the weight products, on a model view around the engine's layer code. Reports per
step: milliseconds of each, and the GPU's largest difference from the reference as a share of
the bound ``--verify`` holds a stage answer of another build to (bounds.stage_rtol: 1.0 would be at the bound) and in units of u = 2^-24 of
the row's largest magnitude; and whether the greedy tokens from the GPU rows equal the
reference's; ``encode_ms``: the step's time outside the GPU submissions and read-backs (the host
encoding buffers, bind groups and dispatches). Default: the default model (SmolLM2-135M Q4_1), all 30 layers, its stage test
prompt. The adapter (lavapipe is a CPU in software) and the machine's load average go with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.compute.kernels import rms_norm  # noqa: E402
from swarm.compute.model import load_model  # noqa: E402
from swarm.peer.coordinator.bounds import UNIT_ROUNDOFF, stage_rtol  # noqa: E402
from swarm.peer.worker.gpu import GpuFfn, GpuStage  # noqa: E402
from swarm.peer.worker.stages import StageCache  # noqa: E402

PROMPT = [1, 504, 3458, 314, 253, 1345, 30]  # the default model's stage test prompt


def _time_submissions(host) -> list[float]:
    """Wrap ``host.submit_read`` to add the seconds spent in it (submission, the GPU's work and
    the read-back) to the returned one-element list: a step's time less that is the host's
    encoding (buffers, bind groups, dispatches) — what bounds a GPU stage whose kernels are fast."""
    spent = [0.0]
    submit_read = host.submit_read

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return submit_read(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    host.submit_read = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF or HF directory (default: the default model)")
    ap.add_argument("--layers", default=None, help="LO:HI (default: every layer)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--products", action="store_true", help="only the weight products on the GPU")
    args = ap.parse_args()
    if args.model is None:
        from swarm.compute.default_model import default_model_path

        args.model = str(default_model_path())
    model = load_model(args.model)
    c = model.config
    lo, hi = map(int, args.layers.split(":")) if args.layers else (0, c.n_layers)
    gpu = GpuFfn.open("on")
    try:
        stage = GpuStage(gpu, model, whole_layers=not args.products)
        t0 = time.perf_counter()
        uploaded = sum(stage.load_layer(layer) for layer in range(lo, hi))
        upload_s = time.perf_counter() - t0
        view = model.with_products(stage)
        in_submit = _time_submissions(gpu.host)
        ref_cache, gpu_cache = model.new_cache(), StageCache(c, lo, hi)
        resident = stage.resident(lo, hi)
        width = max(c.intermediate_size or 0, c.top_k * c.moe_intermediate_size)
        steps, tokens_ref, tokens_gpu, feed, start = [], [], [], list(PROMPT), 0
        for step in range(args.steps + 1):
            x = model.embed.take(np.array(feed))
            if lo > 0:  # the rows entering the stage: the earlier layers on the CPU
                x = model.layers(x, ref_cache, start, 0, lo)
            t0 = time.perf_counter()
            want = model.layers(x, ref_cache, start, lo, hi)
            cpu_s = time.perf_counter() - t0
            in_submit[0] = 0.0
            t0 = time.perf_counter()
            got = (stage.run_layers(x, gpu_cache, start, lo, hi) if resident
                   else view.layers(x, gpu_cache, start, lo, hi, stage))
            gpu_s = time.perf_counter() - t0
            start += len(feed)
            ref_cache.length = gpu_cache.length = start
            scale = np.abs(want).max(axis=1)
            rel = float((np.abs(got.astype(np.float64) - want).max(axis=1) / scale).max())
            bound = stage_rtol(hi - lo, c.hidden_size, width, start)
            if hi == c.n_layers:  # greedy tokens from each side's last row
                for rows, tokens in ((want, tokens_ref), (got, tokens_gpu)):
                    last = rms_norm(rows[-1:], model.final_norm, c.rms_norm_eps)
                    tokens.append(int(np.argmax(model.head.matmul(last))))
            steps.append({"rows": len(feed), "cpu_ms": round(cpu_s * 1e3, 2), "gpu_ms": round(gpu_s * 1e3, 2),
                          "encode_ms": round((gpu_s - in_submit[0]) * 1e3, 2),
                          "share_of_bound": round(rel / bound, 5), "u_of_row_max": round(rel / UNIT_ROUNDOFF, 1)})
            feed = [tokens_ref[-1]] if tokens_ref else [int(np.argmax(want[-1]) % c.vocab_size)]
        info = gpu.host.adapter.info
        print(json.dumps({
            "bench": "gpu_stages", "model": Path(args.model).name, "layers": [lo, hi],
            "path": "whole layers, KV cache on the GPU" if resident else "products on the GPU",
            "adapter": f"{info.get('device')} ({info.get('adapter_type')}, {info.get('backend_type')})",
            "held": {k: sorted(v) if isinstance(v, set) else v for k, v in stage.held().items()},
            "uploaded_bytes": uploaded, "upload_s": round(upload_s, 3), "steps": steps,
            "greedy_tokens_equal": tokens_ref == tokens_gpu if tokens_ref else None, "tokens": tokens_ref,
            "loadavg": os.getloadavg(), "command": "python3 " + " ".join(sys.argv),
        }, indent=1))
    finally:
        gpu.close()


if __name__ == "__main__":
    main()
