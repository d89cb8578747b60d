"""Slices for the browser peer: tensors the page cannot read are repacked to Q8_0, once, by the coordinator.

The page's WebGPU kernels read GGUF Q4_0, Q4_1 and Q8_0 blocks as they are, and F32, F16 and
BF16 elements (see ``web_peer/kernels.py``); a page that announces the K-quant kernels (its
Hello's ``build.blas`` reads ``webgpu kernels:q4_0,...,q6_k``; :func:`page_encodings`) also reads
Q4_K, Q5_K, Q6_K and IQ4_XS blocks as they are, so it gets the file's numbers at the file's size. A
slice holding any other type — Q2_K, Q3_K, Q5_0/Q5_1, the other IQ types, and these for a page
that does not announce them — is rewritten before it is offered to a page: each such
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

PAGE_ENCODINGS = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"})  # what every page reads
K_ENCODINGS = frozenset({"Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})  # what a page announcing the super-block kernels adds
KERNELS_PREFIX = "kernels:"  # the word of a page's build.blas that lists its block kernels
TARGET = "Q8_0"
_ROWS_PER_STEP = 1024  # rows dequantized at a time (bounds the float32 working set)


def page_encodings(build: Any) -> frozenset[str]:
    """The GGUF types a page reads as they are, from its Hello's ``build`` (a NumericBuild).

    The page names its block kernels in ``build.blas``: ``"webgpu kernels:q4_0,q4_1,q8_0,q4_k,q5_k,q6_k"``
    (web_peer/main.js). A page that names none (an older page: ``"webgpu"``) reads PAGE_ENCODINGS;
    announced types outside PAGE_ENCODINGS | K_ENCODINGS are ignored.
    """
    words = str(getattr(build, "blas", "") or "").split()
    named = {k.upper() for w in words if w.startswith(KERNELS_PREFIX) for k in w[len(KERNELS_PREFIX):].split(",")}
    return PAGE_ENCODINGS | (named & K_ENCODINGS)


def page_readable(meta: Mapping[str, Any], encodings: frozenset[str] = PAGE_ENCODINGS) -> bool:
    """True when every tensor of a slice's meta is in one of ``encodings`` (what the page reads)."""
    return not roles_to_repack(meta, encodings)


def roles_to_repack(meta: Mapping[str, Any], encodings: frozenset[str]) -> set[str]:
    """``meta``: a slice's (or any ``{"tensors": [{"role", "encoding"}, ...]}``). Roles of the tensors to requantize: those the page cannot read, and gate and up both when
    they differ and either is a K-quant (one kernel reads gate and up together, and the page
    decodes to float32 only the types of PAGE_ENCODINGS)."""
    tensors = {t.get("role"): t.get("encoding") for t in meta.get("tensors", ())}
    out = {t.get("role") for t in meta.get("tensors", ()) if t.get("encoding") not in encodings}
    gate, up = tensors.get("gate"), tensors.get("up")
    if gate != up and {gate, up} & K_ENCODINGS:
        out |= {role for role in ("gate", "up") if tensors.get(role) in K_ENCODINGS}
    return out


def repack_for_page(blob: bytes | memoryview, meta: Mapping[str, Any],
                    encodings: frozenset[str] = PAGE_ENCODINGS) -> tuple[bytes, dict[str, Any]]:
    """The slice (``blob``, ``meta`` as :meth:`swarm.peer.weights.slices.ModelSlicer.extract` gives) with
    every tensor the page cannot read requantized to Q8_0; the others keep their bytes.

    ``encodings``: the types the page reads as they are (:func:`page_encodings` of its Hello).
    Returns a new blob and meta (same spec and tensor order; a repacked tensor's entry names
    ``encoding: "Q8_0"`` and, in ``repacked_from``, the file's type). A slice the page already
    reads comes back unchanged.

    Raises:
        LocalProtocolError: a tensor's bytes do not match its shape and encoding, or its rows
            are not a multiple of 32 weights (Q8_0's block).
    """
    repack = roles_to_repack(meta, encodings)
    if not repack:
        return bytes(blob), dict(meta)
    buf = np.frombuffer(blob, np.uint8)
    out = bytearray()
    tensors = []
    for t in meta["tensors"]:
        encoding, shape = t["encoding"], list(t["shape"])
        raw = buf[t["offset"] : t["offset"] + t["nbytes"]]
        entry = dict(t, offset=len(out))
        if t.get("role") in repack:
            raw = requantize_q8_0(raw, encoding, shape, t.get("role", "?"))
            entry.update(encoding=TARGET, nbytes=raw.nbytes, repacked_from=encoding)
        out += raw.tobytes()
        tensors.append(entry)
    return bytes(out), {**meta, "tensors": tensors}


def requantize_q8_0(raw: np.ndarray, encoding: str, shape: list[int], role: str) -> np.ndarray:
    """One tensor's bytes ``raw`` (GGUF type name ``encoding``, logical ``shape``) as Q8_0 blocks,
    uint8 [rows, cols / 32 * 34]; ``role`` names it in errors. Raises LocalProtocolError for an
    unknown type, bytes that do not fit the shape, or rows not a multiple of 32 weights."""
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
