"""A peer's share of the weights: cut from the model file, shipped, decoded on the worker.

A *slice* is the FFN weights of one layer that one peer needs for its part of the plan:

- ``dense``: rows ``[start, stop)`` of the dense MLP's intermediate dimension —
  ``gate`` and ``up`` ``[r, H]`` (rows of ``W_gate``/``W_up``) and ``down`` ``[H, r]``
  (columns of ``W_down``), so the slice computes
  ``W_down[:, r] @ (silu(W_gate[r] x) * W_up[r] x)``;
- ``experts``: experts ``[start, stop)`` of an MoE layer — ``gate``/``up``
  ``[n, F, H]`` and ``down`` ``[n, H, F]`` (the checkpoint's ``(out, in)`` layout,
  stacked by expert as in gpt-fast's ``ConditionalFeedForward``).

:func:`ModelSlicer.extract` copies those bytes out of the file **in the file's own
encoding** (GGUF: the raw quantized blocks with their ggml type; safetensors: the raw
F32/F16/BF16 elements) into one blob plus a JSON ``meta`` describing each tensor, so a
Q4_1 slice ships at ~0.19 bytes per weight. A ``down`` column range of a block-quantized
tensor keeps its encoding when ``start`` and ``stop`` fall on block boundaries (32 for
Q4_0/Q4_1/Q8_0, 256 for K-quants — see :func:`ModelSlicer.dense_alignment`); otherwise
those rows are dequantized and shipped as F32 (the rule of the engine's
``QMatrix.columns``, which cuts them). :func:`decode_slice` keeps a blob's tensors in their
encoding as the engine's compact ``QMatrix``, so a worker holds the same bytes and runs the
same kernels as the engine on the same slice (bit for bit).

A worker that holds its own copy of the model (same content hash) calls
:meth:`ModelSlicer.load` and reads only its slices (the file is memory-mapped).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarm.compute.quant import QMatrix
from swarm.compute.tensors import GGUFFile
from swarm.errors import LocalProtocolError, ModelFileError, RemoteProtocolError
from swarm.peer.memory import release_pages

META_VERSION = 1
KINDS = ("dense", "experts")
ROLES = ("gate", "up", "down")
# safetensors dtype → (block size, bytes per block); the names double as ggml type names.
_SAFETENSORS_ENCODINGS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2)}
_MAX_SAFETENSORS_HEADER = 100 << 20
COPY_PIECE_BYTES = 8 << 20  # extract copies the model file's bytes in pieces of about this size


@dataclass(frozen=True)
class SliceSpan:
    """Which weights: ``kind`` ``"dense"`` (intermediate rows) or ``"experts"`` (expert ids),
    half-open range ``[start, stop)`` of layer ``layer``."""

    layer: int
    kind: str
    start: int
    stop: int

    def validate(self) -> None:
        """Raises RemoteProtocolError when a field is malformed (bounds against the model are checked on use)."""
        ok = (
            all(isinstance(v, int) and not isinstance(v, bool) for v in (self.layer, self.start, self.stop))
            and self.kind in KINDS
            and self.layer >= 0
            and 0 <= self.start < self.stop
        )
        if not ok:
            raise RemoteProtocolError(f"bad slice spec {self!r}: need layer ≥ 0, kind in {KINDS}, 0 ≤ start < stop")

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "kind": self.kind, "start": self.start, "stop": self.stop}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SliceSpan:
        try:
            spec = cls(obj["layer"], obj["kind"], obj["start"], obj["stop"])
        except (KeyError, TypeError):
            raise RemoteProtocolError(f"bad slice spec {obj!r}") from None
        spec.validate()
        return spec


@dataclass(frozen=True)
class SliceWeights:
    """One slice's weights, compact: ``matrices[role]`` is a list of
    :class:`~swarm.compute.quant.QMatrix` (one per expert, or one for a dense range) in the
    encoding it was shipped in. ``gate``, ``up``, ``down`` decode them to float32 (shapes in
    the module docstring) for checks; the engine uses :meth:`mlp_weights`."""

    spec: SliceSpan
    matrices: Mapping[str, list[QMatrix]]

    def _decoded(self, role: str) -> np.ndarray:
        mats = [m.dequantize() for m in self.matrices[role]]
        return mats[0] if self.spec.kind == "dense" else np.stack(mats)

    @property
    def gate(self) -> np.ndarray:
        return self._decoded("gate")

    @property
    def up(self) -> np.ndarray:
        return self._decoded("up")

    @property
    def down(self) -> np.ndarray:
        return self._decoded("down")

    def mlp_weights(self) -> dict[int, Any]:
        """The engine's :class:`~swarm.compute.kernels.MLPWeights`, keyed by expert id for an
        ``experts`` slice, or by ``spec.start`` (one entry) for a ``dense`` range."""
        from swarm.compute.kernels import MLPWeights

        g, u, d = (self.matrices[role] for role in ROLES)
        return {self.spec.start + i: MLPWeights(g[i], u[i], d[i]) for i in range(len(g))}


@dataclass(frozen=True)
class _Raw:
    """One tensor as raw bytes: ``data`` uint8 ``[..., rows, row_bytes]``; ``cols`` logical columns."""

    data: np.ndarray
    encoding: str  # a ggml type name (Q4_1, F32, BF16, ...)
    cols: int

    @property
    def block(self) -> tuple[int, int]:
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.encoding]]


class ModelSlicer:
    """Reads slices out of a GGUF model or HF safetensors directory (memory-mapped, lazily).

    A split GGUF is named by any of its shards; its tensors are mapped across them (one map
    per shard, each tensor whole in one), so a slice's tensors may come from different files.

    Raises:
        ModelFileError: the path is not a model we can read, or a tensor it needs is missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_file() and self.path.suffix == ".gguf":
            self.format = "gguf"
            # The engine's header reader: gguf's GGUFReader keeps a view per vocabulary entry
            # (~160 MiB for a 49k-token vocabulary) for as long as this slicer lives.
            self._gguf = GGUFFile(self.path)
        elif self.path.is_dir() and any(self.path.glob("*.safetensors")):
            self.format = "safetensors"
            self._st: dict[str, tuple[np.ndarray, dict]] = {}
            for file in sorted(self.path.glob("*.safetensors")):
                data, header = _read_safetensors_header(file)
                for name, info in header.items():
                    if name != "__metadata__":
                        self._st[name] = (data, info)
            # a multimodal checkpoint (Qwen3.5-MoE's) keeps its text model under model.language_model
            self._layers = ("model.language_model.layers" if "model.language_model.embed_tokens.weight" in self._st
                            else "model.layers")
        else:
            raise ModelFileError(f"{self.path}: not a .gguf file or a directory with *.safetensors")

    # ------------------------------------------------------------- public

    def dense_alignment(self, layer: int) -> int:
        """Multiple that dense range bounds should be for ``down`` to ship in its own encoding."""
        return self._raw_down_dense(layer).block[0]

    def extract(self, spec: SliceSpan) -> tuple[bytearray, dict[str, Any]]:
        """The slice's tensors in the file's encoding: one blob (bytes) and its JSON meta.

        Memory: the blob is allocated once at its final size and the tensors are copied into
        it piece by piece (``COPY_PIECE_BYTES``), each piece's pages of the model file dropped
        from this process's resident set after it is copied: the peak is about the slice
        plus one piece, not several copies of the slice.

        Raises:
            ModelFileError: the layer has no such MLP/experts, or the range exceeds it.
        """
        spec.validate()
        if spec.kind == "dense":
            gate, up, down = (self._raw_dense(spec.layer, role) for role in ROLES)
            rows = gate.data.shape[-2]
            self._check_range(spec, rows, "intermediate rows")
            parts = {
                "gate": (gate.data[spec.start : spec.stop], gate.encoding, (spec.stop - spec.start, gate.cols)),
                "up": (up.data[spec.start : spec.stop], up.encoding, (spec.stop - spec.start, up.cols)),
                "down": _column_range(down, spec.start, spec.stop),
            }
        else:
            gate, up, down = self._raw_experts(spec.layer)
            self._check_range(spec, gate.data.shape[0], "experts")
            sel = slice(spec.start, spec.stop)
            n = spec.stop - spec.start
            parts = {
                "gate": (gate.data[sel], gate.encoding, (n, gate.data.shape[1], gate.cols)),
                "up": (up.data[sel], up.encoding, (n, up.data.shape[1], up.cols)),
                "down": (down.data[sel], down.encoding, (n, down.data.shape[1], down.cols)),
            }
        blob = bytearray(sum(data.nbytes for data, _, _ in parts.values()))
        out = np.frombuffer(blob, dtype=np.uint8)
        tensors = []
        offset = 0
        for role in ROLES:
            data, encoding, shape = parts[role]
            first = offset
            for piece in _pieces(data):
                out[offset : offset + piece.nbytes].reshape(piece.shape)[...] = piece
                release_pages(piece)  # copied out for a worker: not this process's to keep resident
                offset += piece.nbytes
            tensors.append({"role": role, "encoding": encoding, "shape": list(shape), "offset": first,
                            "nbytes": offset - first})
        meta = {"version": META_VERSION, "format": self.format, "spec": spec.to_json(), "tensors": tensors}
        return blob, meta

    def load(self, spec: SliceSpan) -> SliceWeights:
        """Decode a slice straight from the local file (a worker with its own copy)."""
        blob, meta = self.extract(spec)
        return decode_slice(blob, meta)

    # ------------------------------------------------------------- tensor lookup

    def _raw_dense(self, layer: int, role: str) -> _Raw:
        if self.format == "gguf":
            return self._gguf_raw(f"blk.{layer}.ffn_{role}.weight")
        return self._st_raw(f"{self._layers}.{layer}.mlp.{role}_proj.weight")

    def _raw_down_dense(self, layer: int) -> _Raw:
        return self._raw_dense(layer, "down")

    def _raw_experts(self, layer: int) -> tuple[_Raw, _Raw, _Raw]:
        self._refuse_biased_experts(layer)
        if self.format == "gguf":
            return tuple(self._gguf_raw(f"blk.{layer}.ffn_{role}_exps.weight") for role in ROLES)
        prefix = f"{self._layers}.{layer}"
        stacked = f"{prefix}.mlp.experts.gate_up_proj"
        if stacked in self._st or stacked + ".weight" in self._st:
            gate_up = self._st_raw(stacked if stacked in self._st else stacked + ".weight")
            down_name = f"{prefix}.mlp.experts.down_proj"
            down = self._st_raw(down_name if down_name in self._st else down_name + ".weight")
            f = gate_up.data.shape[1] // 2  # [E, 2F, H]: gate rows first, then up
            return (_Raw(gate_up.data[:, :f], gate_up.encoding, gate_up.cols),
                    _Raw(gate_up.data[:, f:], gate_up.encoding, gate_up.cols), down)
        for pattern, names in (
            (f"{prefix}.mlp.experts.{{e}}.{{r}}_proj.weight", {"gate": "gate", "up": "up", "down": "down"}),
            (f"{prefix}.block_sparse_moe.experts.{{e}}.{{r}}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
        ):
            if pattern.format(e=0, r=names["gate"]) in self._st:
                n_experts = 0
                while pattern.format(e=n_experts, r=names["gate"]) in self._st:
                    n_experts += 1
                out = []
                for role in ROLES:
                    per = [self._st_raw(pattern.format(e=e, r=names[role])) for e in range(n_experts)]
                    out.append(_Raw(_LazyStack([p.data for p in per]), per[0].encoding, per[0].cols))
                return tuple(out)
        raise ModelFileError(f"{self.path}: layer {layer} has no MoE expert tensors (per-expert, stacked or Mixtral)")

    def _refuse_biased_experts(self, layer: int) -> None:
        """A slice carries the three expert matrices only: experts with biases (gpt-oss) would
        compute wrong numbers on a peer without the file, so they are not cut."""
        names = ([f"blk.{layer}.ffn_gate_exps.bias"] if self.format == "gguf" else
                 [f"{self._layers}.{layer}.mlp.experts.gate_up_proj_bias"])
        biased = [n for n in names if (n in self._gguf if self.format == "gguf" else n in self._st)]
        if biased:
            raise ModelFileError(
                f"{self.path}: the experts of layer {layer} have biases ({biased[0]}; gpt-oss), which expert "
                "slices do not carry yet: they cannot be shipped to a peer or a browser page without the "
                "model file; give every worker a copy of the model file")

    def _gguf_raw(self, name: str) -> _Raw:
        if name not in self._gguf:
            raise ModelFileError(f"{self.path}: tensor {name} not found")
        data, qtype, cols = self._gguf.blocks(name)
        return _Raw(data, qtype.name, cols)

    def _st_raw(self, name: str) -> _Raw:
        if name not in self._st:
            raise ModelFileError(f"{self.path}: tensor {name} not found")
        data, info = self._st[name]
        dtype = info.get("dtype")
        if dtype not in _SAFETENSORS_ENCODINGS:
            raise ModelFileError(f"{self.path}: tensor {name} has dtype {dtype}; slices support {sorted(_SAFETENSORS_ENCODINGS)}")
        shape = [int(s) for s in info["shape"]]
        start, stop = info["data_offsets"]
        itemsize = _SAFETENSORS_ENCODINGS[dtype][1]
        if len(shape) < 2 or stop - start != int(np.prod(shape)) * itemsize:
            raise ModelFileError(f"{self.path}: tensor {name} has shape {shape} that does not match its {stop - start} bytes")
        raw = data[start:stop].reshape(*shape[:-1], shape[-1] * itemsize)
        return _Raw(raw, dtype, shape[-1])

    def _check_range(self, spec: SliceSpan, limit: int, what: str) -> None:
        if spec.stop > limit:
            raise ModelFileError(f"{self.path}: slice {spec.start}..{spec.stop} of layer {spec.layer} exceeds its {limit} {what}")


class _LazyStack:
    """Per-expert tensors indexed like one stacked ``[E, ...]`` array (slicing copies nothing)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)
        self.nbytes = sum(p.nbytes for p in parts)

    def __getitem__(self, key: slice) -> _LazyStack:
        return _LazyStack(self.parts[key])


def _pieces(data: np.ndarray | _LazyStack) -> Iterator[np.ndarray]:
    """``data`` in order as sub-arrays of whole leading-axis entries, ~``COPY_PIECE_BYTES`` each."""
    if isinstance(data, _LazyStack):
        for part in data.parts:
            yield from _pieces(part[None])
        return
    step = max(1, COPY_PIECE_BYTES * len(data) // max(data.nbytes, 1))
    for at in range(0, len(data), step):
        yield data[at : at + step]


def _column_range(raw: _Raw, start: int, stop: int) -> tuple[np.ndarray, str, tuple[int, int]]:
    """Columns ``[start, stop)`` of a 2-D tensor, raw when they fall on block boundaries."""
    rows = raw.data.shape[0]
    if stop > raw.cols:
        raise ModelFileError(f"dense range {start}..{stop} exceeds the {raw.cols} columns of down")
    cut = QMatrix(raw.data, GGMLQuantizationType[raw.encoding], raw.cols).columns(start, stop)
    return cut.data, cut.qtype.name, (rows, stop - start)


def _read_safetensors_header(file: Path) -> tuple[np.ndarray, dict]:
    """Memory-map a .safetensors file; returns (the data section as uint8, the JSON header).

    Format (safetensors docs): u64 little-endian header length, JSON header, data.
    """
    try:
        with open(file, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{file}: cannot map ({exc})") from None
    if len(mm) < 8:
        raise ModelFileError(f"{file}: truncated safetensors file (no header length)")
    (n,) = struct.unpack("<Q", mm[:8])
    if n > min(_MAX_SAFETENSORS_HEADER, len(mm) - 8):
        raise ModelFileError(f"{file}: safetensors header length {n} is impossible for a {len(mm)}-byte file")
    try:
        header = json.loads(mm[8 : 8 + n])
    except ValueError:
        raise ModelFileError(f"{file}: safetensors header is not JSON") from None
    return np.frombuffer(mm, dtype=np.uint8, offset=8 + n), header


def decode_slice(blob: bytes | memoryview, meta: Mapping[str, Any]) -> SliceWeights:
    """Compact weights from a shipped (or extracted) slice; every meta field is validated.

    Raises:
        RemoteProtocolError: the meta is malformed, a tensor lies outside the blob, its byte
            count does not match its shape and encoding, or the shapes disagree with each other.
    """
    if not isinstance(meta, Mapping) or meta.get("version") != META_VERSION:
        raise RemoteProtocolError(f"slice meta: version must be {META_VERSION}")
    spec = SliceSpan.from_json(meta.get("spec", {}))
    tensors = meta.get("tensors")
    if not isinstance(tensors, list) or [t.get("role") if isinstance(t, Mapping) else None for t in tensors] != list(ROLES):
        raise RemoteProtocolError(f"slice meta: tensors must be {list(ROLES)} in that order")
    buf = np.frombuffer(blob, dtype=np.uint8)
    out = {}
    for t in tensors:
        role, encoding, shape = t["role"], t.get("encoding"), t.get("shape")
        offset, nbytes = t.get("offset"), t.get("nbytes")
        try:
            qtype = GGMLQuantizationType[encoding]
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (KeyError, TypeError):
            raise RemoteProtocolError(f"slice meta: {role} has unknown encoding {encoding!r}") from None
        if (not isinstance(shape, list) or len(shape) not in (2, 3)
                or not all(isinstance(s, int) and s > 0 for s in shape)):
            raise RemoteProtocolError(f"slice meta: {role} shape {shape!r} must be 2 or 3 positive ints")
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and offset + nbytes <= len(buf)):
            raise RemoteProtocolError(f"slice meta: {role} bytes {offset}+{nbytes} outside the {len(buf)}-byte blob")
        cols = shape[-1]
        row_bytes = -(-cols // block) * type_size
        if cols % block or nbytes != int(np.prod(shape[:-1])) * row_bytes:
            raise RemoteProtocolError(f"slice meta: {role} {encoding}{shape} cannot be {nbytes} bytes")
        # A view, still encoded: a cache mapping stays file-backed (pages the kernel can drop and
        # read again), not a copy in the worker's own memory; the view keeps the blob alive.
        raw = buf[offset : offset + nbytes].reshape(-1, shape[-2], row_bytes)
        out[role] = (tuple(shape), [QMatrix(r, qtype, cols) for r in raw])
    (gate, g), (up, u), (down, d) = out["gate"], out["up"], out["down"]
    n = spec.stop - spec.start
    if spec.kind == "dense":
        ok = len(gate) == len(up) == len(down) == 2 and gate == up and gate[0] == n and down == (gate[1], n)
    else:
        ok = len(gate) == len(up) == len(down) == 3 and gate == up and gate[0] == n \
            and down == (n, gate[2], gate[1])
    if not ok:
        raise RemoteProtocolError(
            f"slice meta: shapes gate {gate}, up {up}, down {down} do not fit {spec.kind} {spec.start}..{spec.stop}"
        )
    return SliceWeights(spec, {"gate": g, "up": u, "down": d})


def specs_for(plan: Any, peer_id: str) -> list[SliceSpan]:
    """The slices ``peer_id`` needs under ``plan`` (a :class:`swarm.peer.plan.Plan`), layer order."""
    specs = [SliceSpan(layer, "experts", s.start, s.stop)
             for layer, spans in plan.experts.items() for s in spans if s.peer == peer_id]
    specs += [SliceSpan(layer, "dense", s.start, s.stop)
              for layer, spans in plan.dense.items() for s in spans if s.peer == peer_id]
    return sorted(specs, key=lambda s: (s.layer, s.kind, s.start))


class ShippedWeights:
    """A worker's weights built from slices it received (a :class:`swarm.peer.worker.ffn.SliceSource`).

    ``add`` each decoded slice; ``expert_weights`` / ``dense_weights`` then serve what the
    worker's plan asks for, and raise :class:`~swarm.errors.LocalProtocolError` for weights
    that were never shipped here (a plan accepted before its slices arrived).
    """

    def __init__(self) -> None:
        self._experts: dict[tuple[int, int], Any] = {}
        self._dense: dict[int, list[tuple[int, int, Any]]] = {}

    def add(self, weights: SliceWeights) -> None:
        spec = weights.spec
        if spec.kind == "experts":
            for e, w in weights.mlp_weights().items():
                self._experts[(spec.layer, e)] = w
        else:
            (w,) = weights.mlp_weights().values()
            self._dense.setdefault(spec.layer, []).append((spec.start, spec.stop, w))

    def expert_weights(self, layer: int, e: int) -> Any:
        try:
            return self._experts[(layer, e)]
        except KeyError:
            raise LocalProtocolError(f"expert {e} of layer {layer} was not shipped to this worker") from None

    def dense_weights(self, layer: int, lo: int | None = None, hi: int | None = None) -> Any:
        for start, stop, w in self._dense.get(layer, ()):
            if lo is None and hi is None and (start, stop) == (0, w.intermediate_size):
                return w
            if lo is not None and hi is not None and start <= lo < hi <= stop:
                return w if (lo, hi) == (start, stop) else w.range(lo - start, hi - start)
        raise LocalProtocolError(f"dense units {lo}..{hi} of layer {layer} were not shipped to this worker")
