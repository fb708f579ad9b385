"""The one reader of GGUF files: the header's key/values and the tensors' places.

``read_metadata`` parses the key/value section alone (the tokenizer needs nothing else);
``open_gguf`` goes on to the tensor table and maps every tensor's bytes zero-copy from the
file. Both read with ``struct`` over an ``mmap``: ``gguf.GGUFReader`` builds several numpy
views per string (about 2.5 s for a 49k-token vocabulary), this reads the same header in a
tenth of that. The ``gguf`` package stays the authority on quantization types and their
block sizes (``gguf.GGML_QUANT_SIZES``) and on dequantizing them.

Values: scalars are Python ``int``/``bool``/``str``, ``float32`` scalars ``np.float32`` (so a
reader can recover the converter's decimal), ``float64`` ones ``float``; string arrays are
``list[str]``, numeric arrays numpy arrays. Every failure is a ``ModelLoadError`` (a big-endian
file or another version is an ``UnsupportedModelError``) that names the file.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format (without byte order); 8 is string, 9 is array
_SCALARS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_FLOAT32 = 6
_STRING = 8
_ARRAY = 9
# Tensor types whose elements are plain numbers; any other is rows of quantized blocks.
_PLAIN_TYPES: dict[GGMLQuantizationType, npt.DTypeLike] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. ``shape``: ggml's order, innermost dimension first. ``data``:
    a read-only view of the file: numpy's order (``shape`` reversed) for plain types, and for
    quantized ones rows of packed blocks (the innermost dimension in bytes, uint8)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: npt.NDArray[Any]


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file's header, without touching tensor data."""
    p = Path(path)
    with _mapped(p) as mapping:
        return _Cursor(mapping, p).metadata()


def open_gguf(path: str | Path) -> GGUFFile:
    """The header and every tensor, whose ``data`` views the file (kept mapped while any view
    is alive)."""
    p = Path(path)
    with _mapped(p) as mapping:
        cursor = _Cursor(mapping, p)
        metadata = cursor.metadata()
        tensors = cursor.tensors(np.frombuffer(mapping, dtype=np.uint8), metadata)
        return GGUFFile(metadata, tensors)


@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    """A read-only mmap of a GGUF file for the body to parse. Failing to open it, and the
    body's errors on malformed content, are ``ModelLoadError``s that name the file."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise ModelLoadError(
                    f"{path}: not a GGUF file (starts with {magic!r}, not {GGUF_MAGIC!r})"
                )
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: no such file or directory") from e
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    size = len(mapping)
    try:
        yield mapping
    except (ModelLoadError, UnsupportedModelError):
        raise
    except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError) as e:
        raise ModelLoadError(
            f"{path}: GGUF file is truncated or corrupt ({size} bytes): {e}"
        ) from e
    finally:
        try:
            mapping.close()
        except BufferError:
            pass  # tensor views still use it: it closes when the last one goes


class _Cursor:
    """Reads the header front to back."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.path = path
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # a big-endian file reads as a version with its low half zero
            raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self.n_tensors, self.n_kv = struct.unpack_from("<QQ", buf, 8)
        self.pos = 24

    def _unpack(self, fmt: str) -> Any:
        s = struct.Struct("<" + fmt)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value

    def _string(self) -> str:
        n = self._unpack("Q")
        start = self.pos
        if start + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {start} runs past the end")
        self.pos = start + n
        return self.buf[start : self.pos].decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            value = self._unpack(_SCALARS[vtype])
            return np.float32(value) if vtype == _FLOAT32 else value
        if vtype == _ARRAY:
            item_type = self._unpack("I")
            count = self._unpack("Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[item_type])
                end = self.pos + dtype.itemsize * count
                if end > len(self.buf):
                    raise ValueError(f"an array of {count} values runs past the end")
                # bytes slice copies, so nothing keeps the mmap exported after we return
                array = np.frombuffer(self.buf[self.pos : end], dtype=dtype)
                self.pos = end
                return array.astype(dtype.newbyteorder("="))
            return [self._value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for _ in range(self.n_kv):
            key = self._string()
            meta[key] = self._value(self._unpack("I"))
        return meta

    def tensors(self, buf: npt.NDArray[np.uint8], metadata: dict[str, Any]) -> list[GGUFTensor]:
        """The tensor table, after ``metadata``; each tensor's bytes viewed from ``buf``."""
        table = []
        for _ in range(self.n_tensors):
            name = self._string()
            n_dims = self._unpack("I")
            shape = tuple(int(self._unpack("Q")) for _ in range(n_dims))
            table.append((name, shape, GGMLQuantizationType(self._unpack("I")), self._unpack("Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self.pos // alignment) * alignment
        names = [name for name, *_ in table]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name appears twice")
        return [_tensor(buf, start + off, name, shape, qtype) for name, shape, qtype, off in table]


def _tensor(
    buf: npt.NDArray[np.uint8],
    offset: int,
    name: str,
    shape: tuple[int, ...],
    qtype: GGMLQuantizationType,
) -> GGUFTensor:
    n_elements = int(np.prod(shape))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n_elements % block_size or (shape and shape[0] % block_size):
        raise ValueError(f"tensor {name!r} ({qtype.name}) is not whole blocks of {block_size}")
    n_bytes = n_elements // block_size * type_size
    if offset + n_bytes > len(buf):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    raw = buf[offset : offset + n_bytes]
    np_shape = tuple(reversed(shape))
    plain = _PLAIN_TYPES.get(qtype)
    if plain is not None:
        data = raw.view(plain).reshape(np_shape)
    else:  # rows of packed blocks: the innermost dimension counted in bytes
        data = raw.reshape(*np_shape[:-1], np_shape[-1] // block_size * type_size)
    return GGUFTensor(name, qtype, shape, data)
