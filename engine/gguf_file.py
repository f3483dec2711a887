"""A GGUF file's metadata and tensor table, read in one pass over its header.

The ``gguf`` package's reader builds a numpy view for every value it parses: a tokenizer's 49,152 tokens and
48,900 merges (SmolLM2-135M) take it ~5.5 s on a 2-core machine, every time a process loads the model (each
study worker's first quality measurement, ``kvtune quality``, a preflight of a ``.gguf`` model). Here the
same values come from ``struct`` over a memory map of the file in ~0.1 s. The tensors stay views of the map,
shaped as ``gguf``'s reader shapes them (quantized ones as rows of bytes), so ``gguf.quants.dequantize``
takes them unchanged; the metadata values are what its ``ReaderField.contents()`` returns (Python scalars,
strings and lists).

The format (little-endian, versions 2 and 3): ``GGUF``, the version (u32), the tensor and key-value counts
(u64 each); each key-value a string key, a value type (u32) and the value (a string is its byte length, u64,
then UTF-8 bytes; an array its element type, u32, its length, u64, and the elements); each tensor its name,
its dimension count (u32), the dimensions (u64 each, fastest first), its ggml type (u32) and its data's offset
(u64) from the data section, which starts at the first multiple of ``general.alignment`` (32 when absent)
after the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml types whose data is an array of plain numbers (the others are blocks of bytes)
PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
Info = tuple[str, tuple[int, ...], int, int]  # a tensor's name, dimensions (fastest first), ggml type, offset


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its name, ggml type and data (a view of the file's map, numpy-ordered)."""

    name: str
    tensor_type: int
    data: np.ndarray


class _Cursor:
    """Reads the header's values in order from ``buf`` (a memory map of the file)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str, count: int = 1) -> tuple[Any, ...]:
        fmt = f"<{count}{fmt}"
        values = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.take("Q")
        end = self.at + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.at} runs past the end of the file")
        text = bytes(self.buf[self.at : end]).decode("utf-8")
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, n = self.take("I")[0], self.take("Q")[0]
            if inner == STRING:
                return [self.string() for _ in range(n)]
            if inner not in SCALARS:
                raise ValueError(f"an array of value type {inner} at byte {self.at}: not supported")
            return list(self.take(SCALARS[inner], n))
        if kind not in SCALARS:
            raise ValueError(f"value type {kind} at byte {self.at}: not a GGUF value type")
        return self.take(SCALARS[kind])[0]


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[GgufTensor]]:
    """The metadata (key → value) and the tensors of the GGUF file at ``path``. ValueError (one line, no
    path: the caller names the file) for a file that is not GGUF, a version other than 2 or 3, a header cut
    short or a tensor whose data runs past the end; OSError where it cannot be read."""
    raw = np.memmap(path, mode="r")
    cursor = _Cursor(raw.data)
    try:
        if bytes(raw[:4]) != MAGIC:
            raise ValueError(f"it does not start with {MAGIC!r}")
        cursor.at = len(MAGIC)
        (version,) = cursor.take("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}: only versions {VERSIONS} are read")
        tensor_count, kv_count = cursor.take("Q", 2)
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            meta[key] = cursor.value(cursor.take("I")[0])
        infos: list[Info] = []
        for _ in range(tensor_count):
            name = cursor.string()
            (n_dims,) = cursor.take("I")
            dims = cursor.take("Q", n_dims)
            kind, offset = cursor.take("I")[0], cursor.take("Q")[0]
            infos.append((name, dims, kind, offset))
    except struct.error:
        raise ValueError(f"the header is cut short at byte {cursor.at}") from None
    align = int(meta.get("general.alignment", ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment={align}: not a power of two")
    start = -(-cursor.at // align) * align
    return meta, [_tensor(raw, start, *info) for info in _unique(infos)]


def _unique(infos: list[Info]) -> list[Info]:
    names = [info[0] for info in infos]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tensor {twice[0]!r} is listed twice")
    return infos


def _tensor(
    raw: np.memmap, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int
) -> GgufTensor:
    """A tensor's data as ``gguf``'s reader gives it: plain numbers in the reversed dimensions, other types
    as rows of bytes (``quant_shape_to_byte_shape``)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    shape = tuple(reversed(dims))
    elements = int(np.prod(dims, dtype=np.int64))
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name!r}: ggml type {kind} is unknown") from None
    block, size = GGML_QUANT_SIZES[qtype]
    first = start + offset
    if kind in PLAIN:
        dtype = np.dtype(PLAIN[kind])
        count = elements
    else:
        dtype, count = np.dtype(np.uint8), elements * size // block
        shape = quant_shape_to_byte_shape(shape, qtype)
    nbytes = count * dtype.itemsize
    if first + nbytes > raw.shape[0]:
        raise ValueError(f"tensor {name!r}: its {nbytes} bytes at byte {first} run past the end of the file")
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=first).reshape(shape)
    return GgufTensor(name, kind, data)
