"""Random GGUF models at real shapes, written from random quant blocks in seconds per GB.

A model of Qwen3-30B-A3B's shape is 17 GB in the Q4_K_M mix; quantizing float32 weights to get
it would take hours and the float32 model would not fit in memory. So the blocks are random
bytes whose scale fields are set so the weights have a chosen standard deviation (calibrated
once per type by dequantizing a sample with ``gguf.quants``). Tensors are written one at a time
through ``gguf.GGUFWriter``'s streaming calls (tensor infos first, then each tensor's data), so
at most one tensor is ever in memory, and the writer splits the file into llama.cpp's
``NAME-00001-of-0000N.gguf`` shards when ``shard_bytes`` is given.

    python3 bench/random_gguf.py OUT.gguf --preset qwen3-30b-a3b --shard-gb 5

The tokenizer is the default model's (SmolLM2's 49,152-token BPE), so every engine can load
the file and the text is comparable; the vocabulary is therefore smaller than Qwen3's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import cache
from pathlib import Path

import gguf
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QT = gguf.GGMLQuantizationType
F32 = QT.F32

# Byte offsets of the f16 scale fields that set a block's magnitude: (d, dmin or None).
# Layouts as ggml defines them (Q6_K keeps its d after the quants and 16 int8 sub-scales).
_SCALE_FIELDS = {QT.Q8_0: (0, None), QT.Q4_0: (0, None), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, None),
                 QT.Q2_K: (80, 82), QT.Q3_K: (108, None)}
# A Q2_K/Q4_K/Q5_K weight is d·sc·q − dmin·m with q ≥ 0: dmin at this multiple of d centres it.
_DMIN_PER_D = {QT.Q4_K: 7.5, QT.Q5_K: 15.5, QT.Q2_K: 1.5}


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A Qwen3-MoE's hyperparameters (GGUF ``qwen3moe``)."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int


PRESETS = {
    # Qwen3-30B-A3B's exact shape (its config.json): 17.0 GB in the Q4_K_M mix with its vocabulary.
    "qwen3-30b-a3b": MoEShape(layers=48, hidden=2048, experts=128, top_k=8, expert_ffn=768, heads=32,
                              kv_heads=4, head_dim=128),
    # The same kind of model at ~2.3 GB: what the CI capacity test writes.
    "moe-2g": MoEShape(layers=18, hidden=1024, experts=128, top_k=8, expert_ffn=512, heads=16, kv_heads=4,
                       head_dim=64),
}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` rule for the Q4_K_M mix: the first and last eighth of the
    layers and every third one between them get the larger type (about half of them)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def q4_k_m(name: str, layer: int | None, n_layers: int) -> QT:
    """The tensor type llama.cpp's Q4_K_M gives ``name``: Q6_K for the output head, ``attn_v``
    and the ``ffn_down`` of :func:`more_bits` layers, Q4_K for the other matrices."""
    if name == "output.weight" or ".attn_v." in name:
        return QT.Q6_K
    if ".ffn_down" in name and layer is not None and more_bits(layer, n_layers):
        return QT.Q6_K
    return QT.Q4_K


@cache
def _std_per_unit_scale(qtype: QT) -> float:
    """Standard deviation of random ``qtype`` blocks whose d is 1 (dmin at its centring ratio)."""
    rng = np.random.default_rng(1234)
    raw = _raw_blocks(rng, 4096, qtype, 1.0)
    return float(gguf.quants.dequantize(raw.reshape(-1), qtype).astype(np.float64).std())


def _raw_blocks(rng: np.random.Generator, n: int, qtype: QT, d: float) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    d_at, dmin_at = _SCALE_FIELDS[qtype]
    raw[:, d_at:d_at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if dmin_at is not None:
        raw[:, dmin_at:dmin_at + 2] = np.frombuffer(np.float16(d * _DMIN_PER_D[qtype]).tobytes(), np.uint8)
    return raw


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: QT, std: float) -> np.ndarray:
    """Random ``qtype`` blocks for a [rows, cols] matrix whose weights have about ``std``:
    uint8 [rows, cols / block · block bytes]. Raises ValueError for a type without a known
    layout or a ``cols`` that is not a whole number of blocks."""
    if qtype not in _SCALE_FIELDS:
        raise ValueError(f"no random-block layout for {qtype.name}; use one of {[q.name for q in _SCALE_FIELDS]}")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{cols} columns are not whole {qtype.name} blocks of {block}")
    raw = _raw_blocks(rng, rows * cols // block, qtype, std / _std_per_unit_scale(qtype))
    return raw.reshape(rows, cols // block * size)


def _byte_shape(shape: tuple[int, ...], qtype: QT) -> tuple[int, ...]:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block * size)


def write_qwen3moe(path: Path, shape: MoEShape, *, shard_bytes: int = 0, seed: int = 0, name: str | None = None,
                   mix=q4_k_m) -> list[Path]:
    """Write a random Qwen3-MoE of ``shape`` (with ``experts`` 0: a dense Qwen3 whose MLP is
    ``expert_ffn`` wide) to ``path`` (split into shards of at most
    ``shard_bytes`` when it is > 0, named as llama.cpp names them); returns the files written,
    first shard first. ``mix(name, layer, n_layers)`` gives each matrix's type (default: Q4_K_M).
    Routers and norms are F32, routers scaled so the top-k is decisive."""
    from bench.engine import qwen3moe_writer

    path.parent.mkdir(parents=True, exist_ok=True)
    w, vocab = qwen3moe_writer(path, layers=shape.layers, hidden=shape.hidden, experts=shape.experts,
                               top_k=shape.top_k, expert_ffn=shape.expert_ffn, heads=shape.heads,
                               kv_heads=shape.kv_heads, name=name, head_dim=shape.head_dim, shard_bytes=shard_bytes)
    H, hd, F = shape.hidden, shape.head_dim, shape.expert_ffn
    s_in, s_q, s_ffn = H ** -0.5, (shape.heads * hd) ** -0.5, F ** -0.5
    # (name, logical shape [.., rows, cols], type, weight std or a float32 maker)
    specs: list[tuple[str, tuple[int, ...], QT, object]] = [
        ("token_embd.weight", (vocab, H), mix("token_embd.weight", None, shape.layers), 1.0),
        ("output_norm.weight", (H,), F32, "ones"),
        ("output.weight", (vocab, H), mix("output.weight", None, shape.layers), 1.0),
    ]
    for i in range(shape.layers):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (H,), F32, "ones"), (b + "ffn_norm.weight", (H,), F32, "ones"),
                  (b + "attn_q_norm.weight", (hd,), F32, "ones"), (b + "attn_k_norm.weight", (hd,), F32, "ones")]
        if shape.experts:
            specs.append((b + "ffn_gate_inp.weight", (shape.experts, H), F32, "router"))
        for part, rows, cols, std in (("attn_q", shape.heads * hd, H, s_in), ("attn_k", shape.kv_heads * hd, H, s_in),
                                      ("attn_v", shape.kv_heads * hd, H, s_in), ("attn_output", H, shape.heads * hd, s_q)):
            specs.append((b + part + ".weight", (rows, cols), mix(b + part + ".weight", i, shape.layers), std))
        for part, rows, cols, std in (("gate", F, H, s_in), ("up", F, H, s_in), ("down", H, F, s_ffn)):
            if shape.experts:
                nm = b + f"ffn_{part}_exps.weight"
                specs.append((nm, (shape.experts, rows, cols), mix(nm, i, shape.layers), std))
            else:  # a dense MLP of width expert_ffn
                nm = b + f"ffn_{part}.weight"
                specs.append((nm, (rows, cols), mix(nm, i, shape.layers), std))

    def nbytes(shp: tuple[int, ...], qtype: QT) -> int:
        return 4 * int(np.prod(shp)) if qtype == F32 else int(np.prod(_byte_shape(shp, qtype)))

    for nm, shp, qtype, _ in specs:
        if qtype == F32:
            w.add_tensor_info(nm, shp, np.dtype(np.float32), nbytes(shp, qtype))
        else:
            w.add_tensor_info(nm, _byte_shape(shp, qtype), np.dtype(np.uint8), nbytes(shp, qtype), raw_dtype=qtype)
    files = w.format_shard_names(path)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for nm, shp, qtype, how in specs:
        if how == "ones":
            data = np.ones(shp, np.float32)
        elif how == "router":
            data = rng.standard_normal(shp, dtype=np.float32) * np.float32(4 * s_in)
        else:
            rows = int(np.prod(shp[:-1]))
            data = random_blocks(rng, rows, shp[-1], qtype, float(how)).reshape(_byte_shape(shp, qtype))
        w.write_tensor_data(data)
    w.close()
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="output file (the first shard's name is derived from it when split)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--shard-gb", type=float, default=0.0, help="split into shards of at most this many GB (0: one file)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    files = write_qwen3moe(args.path, PRESETS[args.preset], shard_bytes=int(args.shard_gb * 1e9), seed=args.seed,
                           name=f"random {args.preset} (bench/random_gguf.py)")
    size = sum(f.stat().st_size for f in files)
    print(json.dumps({"files": [str(f) for f in files], "bytes": size, "seconds": round(time.perf_counter() - t0, 1),
                      "shape": dataclasses.asdict(PRESETS[args.preset])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
