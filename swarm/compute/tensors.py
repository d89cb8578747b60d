"""Memory-mapped tensor files: GGUF (through ``gguf.GGUFReader``) and safetensors.

Both readers map the file. ``matrix(name, index)`` gives a weight matrix (or one expert of a
stacked ``[E, out, in]`` tensor) as a :class:`~swarm.compute.quant.QMatrix` over the mapped
bytes, still in the file's encoding; ``load(name, index)`` decodes a tensor (or one slice of its
first axis) to a C-contiguous float32 array — for the small ones (norms, biases, routers).
Shapes are the file's numpy shape (``[out, in]`` for a weight matrix, as in ``nn.Linear``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from swarm.compute.quant import QMatrix
from swarm.errors import ModelFileError


def _as_f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


# GGUF metadata value types (gguf.GGUFValueType) → numpy scalar type, for numbers.
_GGUF_NUMBERS = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
                 VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "?", VT.UINT64: "<u8", VT.INT64: "<i8",
                 VT.FLOAT64: "<f8"}


@dataclass(frozen=True)
class _GGUFTensor:
    name: str
    tensor_type: QT
    dims: tuple[int, ...]  # numpy order: outermost first
    data: np.ndarray  # uint8 [..., rows, row_bytes] over the mapped file


class StringArray(Sequence):
    """A GGUF array of strings read on access (a vocabulary: tens of thousands of entries that
    would cost ~70 bytes each as Python strings, for as long as the metadata is kept)."""

    def __init__(self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray):
        self._buf, self._starts, self._lengths = buf, starts, lengths

    def __len__(self) -> int:
        return int(self._starts.size)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        lo = int(self._starts[i])
        return bytes(self._buf[lo:lo + int(self._lengths[i])]).decode("utf-8", errors="replace")

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))


class _Cursor:
    """Reads GGUF's little-endian header fields from a mapped file (the format: ggml's gguf.md)."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.buf.size:  # a length read from a corrupt field, or a file cut short
            raise ValueError(f"the header's field at byte {self.pos} claims {n:,} bytes, past the file's end at "
                             f"byte {self.buf.size:,} (a corrupt length, or the file cut short)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def number(self, vtype: VT):
        dt = np.dtype(_GGUF_NUMBERS[vtype])
        return self.take(dt.itemsize).view(dt)[0].item()

    def string(self) -> str:
        return bytes(self.take(self.number(VT.UINT64))).decode("utf-8", errors="replace")

    def value(self, vtype: VT):
        if vtype == VT.STRING:
            return self.string()
        if vtype == VT.ARRAY:
            etype, n = VT(self.number(VT.UINT32)), self.number(VT.UINT64)
            if etype in _GGUF_NUMBERS:  # numbers in one read
                dt = np.dtype(_GGUF_NUMBERS[etype])
                return self.take(n * dt.itemsize).view(dt).tolist()
            if etype == VT.STRING:  # offsets only; each string is decoded when read
                starts, lengths = np.empty(n, np.int64), np.empty(n, np.int64)
                for i in range(n):
                    lengths[i] = self.number(VT.UINT64)
                    starts[i] = self.pos
                    self.take(int(lengths[i]))
                return StringArray(self.buf, starts, lengths)
            return [self.value(etype) for _ in range(n)]
        return self.number(vtype)


# llama.cpp's gguf-split names: PREFIX-00001-of-00003.gguf (gguf.gguf_writer.SHARD_NAME_FORMAT).
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SPLIT_NO, _SPLIT_COUNT, _SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


@dataclass
class _Shard:
    """One GGUF file as parsed: its metadata and tensors (views of its memory map)."""

    path: Path
    kv: dict[str, Any]
    value_types: dict[str, VT]
    tensors: dict[str, _GGUFTensor]
    header_bytes: int  # where the tensor data starts: header, metadata and tensor index before it


def _read_shard(path: Path) -> _Shard:
    """Map and parse one GGUF file. Raises ModelFileError when it is missing, not GGUF,
    truncated or corrupt."""
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    try:
        # the tensors' views keep the map alive (and let release_pages find it)
        return _parse(path, _Cursor(np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))))
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None


def _parse(path: Path, cur: _Cursor) -> _Shard:
    if bytes(cur.take(4)) != b"GGUF":
        raise ValueError("no GGUF magic")
    version = cur.number(VT.UINT32)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or unsupported; expected 2 or 3)")
    n_tensors, n_kv = cur.number(VT.UINT64), cur.number(VT.UINT64)
    kv: dict[str, Any] = {}
    value_types: dict[str, VT] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = VT(cur.number(VT.UINT32))
        kv[key], value_types[key] = cur.value(vtype), vtype
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.number(VT.UINT64) for _ in range(cur.number(VT.UINT32))]
        infos.append((name, ne, QT(cur.number(VT.UINT32)), cur.number(VT.UINT64)))
    align = int(kv.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    size = cur.buf.size
    tensors: dict[str, _GGUFTensor] = {}
    for name, ne, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise ValueError(f"tensor {name!r}: {ne[0]} columns is not a multiple of {qtype.name}'s block {block}")
        if name in tensors:
            raise ValueError(f"tensor {name!r} is listed twice")
        dims = tuple(int(d) for d in reversed(ne))
        row_bytes = ne[0] // block * type_size
        lo = start + offset
        n = row_bytes * int(np.prod(dims[:-1], dtype=np.int64))
        if lo + n > size:
            raise ModelFileError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = _GGUFTensor(name, qtype, dims, cur.buf[lo:lo + n].reshape(*dims[:-1], row_bytes))
    return _Shard(path, kv, value_types, tensors, min(start, size))


def _split_count(shard: _Shard) -> int:
    return int(shard.kv.get(_SPLIT_COUNT, 1) or 1)


def _gather_shards(given: _Shard) -> list[_Shard]:
    """Every shard of the split model ``given`` belongs to, in order (``given`` among them).

    Raises ModelFileError naming the file when a shard is missing, misnamed, from another
    split or another model.
    """
    count, no = _split_count(given), int(given.kv.get(_SPLIT_NO, 0))
    m = _SHARD_NAME.match(given.path.name)
    pattern = f"PREFIX-{no + 1:05d}-of-{count:05d}.gguf"
    if m is None or int(m["no"]) != no + 1 or int(m["count"]) != count:
        raise ModelFileError(
            f"{given.path}: shard {no + 1} of a model split in {count} files, but its name is not llama.cpp's "
            f"{pattern}, so its other shards cannot be found: give the shards their gguf-split names")
    shards = []
    for i in range(count):
        path = given.path.with_name(f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
        if i == no:
            shards.append(given)
            continue
        if not path.is_file():
            raise ModelFileError(
                f"{path}: shard {i + 1} of {count} of this model is missing: download every shard of the "
                f"model into {path.parent}")
        shard = _read_shard(path)
        if _split_count(shard) != count or int(shard.kv.get(_SPLIT_NO, -1)) != i:
            raise ModelFileError(
                f"{path}: says it is shard {int(shard.kv.get(_SPLIT_NO, -1)) + 1} of {_split_count(shard)}, "
                f"its name shard {i + 1} of {count}: shards of different splits are mixed; download all "
                f"shards of one model again into {path.parent}")
        shards.append(shard)
    first = shards[0]
    for shard in shards[1:]:
        # gguf-split writes the model's metadata into the first shard only; any key a later shard
        # repeats (split.tensors.count, general.*) must agree with it.
        for key, value in shard.kv.items():
            if key not in (_SPLIT_NO, "general.alignment") and key in first.kv and first.kv[key] != value:
                raise ModelFileError(
                    f"{shard.path}: a shard of a different model ({key} = {value!r}, {first.path.name} has "
                    f"{first.kv[key]!r}): download all shards of one model again into {shard.path.parent}")
    return shards


class GGUFFile:
    """One GGUF model, memory-mapped (one map per file); only the headers are parsed here.

    ``path`` names a single GGUF file or any shard of a split one (llama.cpp's gguf-split:
    ``PREFIX-00001-of-00003.gguf`` …, each a whole GGUF whose ``split.no`` / ``split.count`` /
    ``split.tensors.count`` keys tie them together); the shards are found beside it and their
    tensors form one index. A tensor lies whole in one shard.
    ``path``: the first (or only) file; ``paths``: every file, shard order; ``header_bytes[i]``:
    where the tensor data of ``paths[i]`` starts (header, metadata and tensor index before it).
    ``kv``: the model's metadata (the first shard's): key → python value (str, int, float, bool,
    list; an array of strings is a :class:`StringArray`, a read-only sequence of str);
    ``value_types``: key → its ``gguf.GGUFValueType``. ``shapes``: tensor name → numpy shape
    (outermost first; GGUF lists dims innermost first). Dequantisation uses
    ``gguf.quants.dequantize``, so every type the ``gguf`` package implements is supported. The
    header is read here rather than with ``gguf.GGUFReader``, which keeps a numpy view per
    vocabulary entry (~150 MiB for a 49k-token vocabulary).
    Raises ModelFileError when a file is missing, not GGUF, truncated or corrupt, or the shards
    of a split model do not make one model (missing, mixed, duplicated tensors, wrong count).
    """

    def __init__(self, path: str | os.PathLike):
        given = _read_shard(Path(path))
        shards = [given] if _split_count(given) <= 1 else _gather_shards(given)
        first = shards[0]
        self.path, self.kv, self.value_types = first.path, first.kv, first.value_types
        self.paths = [s.path for s in shards]
        self.header_bytes = [s.header_bytes for s in shards]
        self._tensors: dict[str, _GGUFTensor] = {}
        where: dict[str, Path] = {}
        for shard in shards:
            for name, t in shard.tensors.items():
                if name in where:
                    raise ModelFileError(
                        f"{shard.path}: tensor {name!r} is also in {where[name].name}: a shard of another model "
                        f"or a copy of one; download all shards of one model again into {shard.path.parent}")
                where[name] = shard.path
                self._tensors[name] = t
        want = first.kv.get(_SPLIT_TENSORS)
        if len(shards) > 1 and want is not None and int(want) != len(self._tensors):
            raise ModelFileError(
                f"{self.path}: the {len(shards)} shards hold {len(self._tensors)} tensors, split.tensors.count "
                f"says {want}: a shard is from another model or damaged; download all shards again")
        self.shapes = {name: t.dims for name, t in self._tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> QT:
        return self._tensor(name).tensor_type

    def _tensor(self, name: str) -> _GGUFTensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        return t

    def blocks(self, name: str) -> tuple[np.ndarray, QT, int]:
        """Tensor ``name`` as stored: its bytes over the mapped file (uint8 ``[..., rows,
        row_bytes]``, no copy), its type and its logical column count. ModelFileError if missing."""
        t = self._tensor(name)
        return t.data, t.tensor_type, t.dims[-1]

    def matrix(self, name: str, index: int | None = None) -> QMatrix:
        """Tensor ``name`` (2-D, or ``[index]`` of a 3-D stack) as a QMatrix over the mapped
        file: no bytes are copied or decoded. Raises ModelFileError if missing or not a matrix."""
        t = self._tensor(name)
        data = t.data if index is None else t.data[index]
        if data.ndim != 2:
            raise ModelFileError(f"{self.path}: tensor {name!r} of shape {t.dims} is not a matrix")
        return QMatrix(data, t.tensor_type, t.dims[-1])

    def load(self, name: str, index: int | slice | None = None) -> np.ndarray:
        """Dequantise tensor ``name`` (or ``[index]`` of its first axis) to float32.

        Raises ModelFileError if the tensor is missing or its type cannot be decoded.
        """
        t = self._tensor(name)
        data = t.data if index is None else t.data[index]
        try:
            out = gguf.quants.dequantize(np.asarray(data), t.tensor_type)
        except NotImplementedError:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantise") from None
        return _as_f32(out)


# safetensors dtype code → numpy dtype (BF16 is decoded by hand: numpy has no bfloat16).
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped.

    The format is an 8-byte little-endian header length, a JSON header (name → dtype, shape,
    data_offsets) and the raw tensor bytes (https://github.com/huggingface/safetensors).
    We read it with ``numpy.memmap`` rather than ``safetensors.safe_open`` because the
    latter's numpy API cannot return bfloat16 tensors, the dtype most checkpoints ship in.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 8:
                    raise ModelFileError(f"{self.path}: too short for a safetensors file (truncated?)")
                n = int.from_bytes(fh.read(8), "little")
                if n > size - 8 or n > 100 << 20:
                    raise ModelFileError(f"{self.path}: header length {n} exceeds the file (truncated?)")
                header = json.loads(fh.read(n))
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read: {e.strerror}") from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelFileError(f"{self.path}: safetensors header is not valid JSON") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.header_bytes = self._base  # where the tensor data starts
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, bool]] = {}  # dtype, shape, offset, is_bf16
        for name, e in header.items():
            dtype = _ST_DTYPES.get(e.get("dtype"))
            if dtype is None:
                raise ModelFileError(f"{self.path}: tensor {name!r} has dtype {e.get('dtype')!r}, "
                                     f"supported: {', '.join(_ST_DTYPES)}")
            shape = tuple(int(d) for d in e["shape"])
            lo, hi = (int(v) for v in e["data_offsets"])
            if hi - lo != int(np.prod(shape)) * np.dtype(dtype).itemsize or self._base + hi > size:
                raise ModelFileError(f"{self.path}: tensor {name!r} lies outside the file (truncated?)")
            self._entries[name] = (np.dtype(dtype), shape, lo, e["dtype"] == "BF16")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v[1] for k, v in self._entries.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (a read-only memmap view; BF16 as uint16)."""
        dtype, shape, lo, _ = self._entries[name]
        count = int(np.prod(shape))
        start = self._base + lo
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(shape)

    def matrix(self, name: str, index: int | None = None) -> QMatrix:
        """Tensor ``name`` (2-D, or ``[index]`` of a 3-D stack) as a QMatrix over the mapped file
        (F32/F16/BF16 as stored; F64 is converted to an F32 copy)."""
        if name not in self._entries:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        dtype, _, _, bf16 = self._entries[name]
        a = self.raw(name)
        if index is not None:
            a = a[index]
        if a.ndim != 2:
            raise ModelFileError(f"{self.path}: tensor {name!r} of shape {a.shape} is not a matrix")
        if dtype == np.float64:
            return QMatrix.from_float(a.astype(np.float32))
        qtype = QT.BF16 if bf16 else QT.F16 if dtype == np.float16 else QT.F32
        return QMatrix(a.view(np.uint8), qtype, a.shape[1])

    def load(self, name: str, index: int | slice | None = None) -> np.ndarray:
        """Tensor ``name`` (or ``[index]`` of its first axis) as float32."""
        if name not in self._entries:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        a = self.raw(name)
        if index is not None:
            a = a[index]
        if self._entries[name][3]:  # bfloat16: the high half of a float32
            return (a.astype(np.uint32) << 16).view(np.float32)
        return _as_f32(a)


class SafetensorsDir:
    """A HF checkpoint directory: ``config.json`` plus one or more ``*.safetensors`` shards.

    Sharded checkpoints are found through ``model.safetensors.index.json`` when present,
    else every ``*.safetensors`` file in the directory is read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ModelFileError(f"{index}: not a valid safetensors index (no 'weight_map')") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{self.path}: no *.safetensors files in the model directory")
        self.files: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        for fname in files:
            p = self.path / fname
            if not p.is_file():
                raise ModelFileError(f"{p}: shard named in the index is missing")
            f = SafetensorsFile(p)
            self.files.append(f)
            for name in f.shapes:
                self._where[name] = f

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: f.shapes[name] for name, f in self._where.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile:
        f = self._where.get(name)
        if f is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing from every shard")
        return f

    def load(self, name: str, index: int | slice | None = None) -> np.ndarray:
        return self._file(name).load(name, index)

    def matrix(self, name: str, index: int | None = None) -> QMatrix:
        return self._file(name).matrix(name, index)
