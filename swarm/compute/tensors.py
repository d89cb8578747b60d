"""Memory-mapped tensor files: GGUF (through ``gguf.GGUFReader``) and safetensors.

Both readers map the file and decode a tensor only when asked, and can decode one slice
of the first axis alone (one expert of a stacked ``[E, out, in]`` tensor, or rows
``lo:hi`` of a matrix) so a peer materialises only what it is assigned.
Every tensor comes back as a C-contiguous float32 array in the file's numpy shape
(``[out, in]`` for a weight matrix, as in PyTorch's ``nn.Linear``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from swarm.errors import ModelFileError


def _as_f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class GGUFFile:
    """One GGUF file, memory-mapped.

    ``kv``: metadata key → python value (str, int, float, bool, list).
    ``shapes``: tensor name → numpy shape (outermost first; GGUF lists dims innermost first).
    Dequantisation uses ``gguf.quants.dequantize``, so every type the ``gguf`` package
    implements is supported.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such model file")
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
            raise ModelFileError(
                f"{self.path}: not a readable GGUF file (truncated or corrupt?): {e}") from None
        self.kv: dict[str, Any] = {}
        for key, f in self.reader.fields.items():
            try:
                self.kv[key] = f.contents()
            except Exception:  # a field type this gguf version cannot decode: leave it out
                continue
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist()))
                       for name, t in self._tensors.items()}
        # GGUFReader maps the file lazily; check that every tensor lies inside it.
        size = self.path.stat().st_size
        for name, t in self._tensors.items():
            if t.data_offset + t.n_bytes > size:
                raise ModelFileError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> QT:
        return self._tensor(name).tensor_type

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        return t

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

    def load(self, name: str, index: int | slice | None = None) -> np.ndarray:
        f = self._where.get(name)
        if f is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing from every shard")
        return f.load(name, index)
