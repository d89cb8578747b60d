"""Slices for the browser peer: tensors the page cannot read are repacked to Q8_0, once, by the coordinator.

The page's WebGPU kernels read GGUF Q4_0, Q4_1 and Q8_0 blocks as they are, and F32, F16 and
BF16 elements (see ``web_peer/kernels.py``). A slice holding any other type — the K-quants
(Q2_K … Q6_K), Q5_0/Q5_1, the IQ types — is rewritten before it is offered to a page: each such
tensor is dequantized by gguf-py (the engine's own dequantization) and quantized to Q8_0 by
gguf-py's port of llama.cpp's reference quantizer, a block of rows at a time, so no whole
tensor is ever expanded to float32. The repacked slice has its own SHA-256, so the coordinator
computes it once per slice and the page caches it like any other.

Cost, per weight w of a 32-weight block with largest magnitude a: Q8_0 stores
``f16(a / 127) * round(w * 127 / a)``, an error of at most about ``0.57 * a / 127`` (half a
step, plus the f16 rounding of the scale): ~0.45 % of the block's largest weight, about a
ninth of Q4_K's own step. Size: 8.5 bits per weight, so a Q4_K slice (4.5 bits) grows 1.9x,
Q5_K (5.5) 1.5x and Q6_K (6.56) 1.3x — still 3.8x smaller than float32. The page's answers
on repacked slices are not bit-identical to the file's numbers; the coordinator verifies
browser peers within a tolerance anyway (another numeric build).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from swarm.errors import LocalProtocolError

PAGE_ENCODINGS = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"})  # what the page reads
TARGET = "Q8_0"
_ROWS_PER_STEP = 1024  # rows dequantized at a time (bounds the float32 working set)


def page_readable(meta: Mapping[str, Any]) -> bool:
    """True when every tensor of a slice's meta is in an encoding the page reads."""
    return all(t.get("encoding") in PAGE_ENCODINGS for t in meta.get("tensors", ()))


def repack_for_page(blob: bytes | memoryview, meta: Mapping[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The slice (``blob``, ``meta`` as :meth:`swarm.peer.weights.slices.ModelSlicer.extract` gives) with
    every tensor the page cannot read requantized to Q8_0; the others keep their bytes.

    Returns a new blob and meta (same spec and tensor order; a repacked tensor's entry names
    ``encoding: "Q8_0"`` and, in ``repacked_from``, the file's type). A slice the page already
    reads comes back unchanged.

    Raises:
        LocalProtocolError: a tensor's bytes do not match its shape and encoding, or its rows
            are not a multiple of 32 weights (Q8_0's block).
    """
    if page_readable(meta):
        return bytes(blob), dict(meta)
    buf = np.frombuffer(blob, np.uint8)
    out = bytearray()
    tensors = []
    for t in meta["tensors"]:
        encoding, shape = t["encoding"], list(t["shape"])
        raw = buf[t["offset"] : t["offset"] + t["nbytes"]]
        entry = dict(t, offset=len(out))
        if encoding not in PAGE_ENCODINGS:
            raw = _to_q8_0(raw, encoding, shape, t.get("role", "?"))
            entry.update(encoding=TARGET, nbytes=raw.nbytes, repacked_from=encoding)
        out += raw.tobytes()
        tensors.append(entry)
    return bytes(out), {**meta, "tensors": tensors}


def _to_q8_0(raw: np.ndarray, encoding: str, shape: list[int], role: str) -> np.ndarray:
    try:
        qtype = GGMLQuantizationType[encoding]
        block, type_size = GGML_QUANT_SIZES[qtype]
    except KeyError:
        raise LocalProtocolError(f"slice tensor {role}: unknown encoding {encoding!r}") from None
    cols = shape[-1]
    rows = int(np.prod(shape[:-1]))
    row_bytes = cols // block * type_size
    if cols % block or raw.size != rows * row_bytes:
        raise LocalProtocolError(f"slice tensor {role}: {encoding}{shape} cannot be {raw.size} bytes")
    if cols % GGML_QUANT_SIZES[GGMLQuantizationType[TARGET]][0]:
        raise LocalProtocolError(f"slice tensor {role}: rows of {cols} weights cannot be {TARGET} blocks of 32")
    raw = raw.reshape(rows, row_bytes)
    steps = [quantize(np.asarray(dequantize(raw[r : r + _ROWS_PER_STEP], qtype), np.float32),
                      GGMLQuantizationType[TARGET])
             for r in range(0, rows, _ROWS_PER_STEP)]
    return np.concatenate(steps)
