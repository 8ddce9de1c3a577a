"""Safetensors files read and written one tensor at a time, so that a whole model never has to be in memory.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian unsigned header length
N, N bytes of UTF-8 JSON, then the data region::

    {"__metadata__": {"key": "value"}, "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, ...}

Each tensor's bytes lie at ``data_offsets`` (relative to the data region), little-endian, in C order. The tensors
cover the data region exactly: no gaps, no overlaps, nothing after the last one.

:class:`TensorFile` parses and checks the header when it opens the file and reads a tensor on demand with
``os.preadv`` into a fresh array: deliberately not a memory map, whose pages would stay resident as a whole model
is walked, so what a reader holds is the tensor it is working on. :class:`TensorWriter` takes tensors in the order
of its layout, one at a time, and :func:`write_tensors` pulls them from a function; both write a temporary file in
the target's directory, fsync it and move it into place, so a reader never sees half a file.

numpy has no bfloat16 or 8-bit floats: files with them are refused (:class:`TensorFileError`, a ``ValueError``),
as are malformed headers. numpy and the standard library only.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest header read (safetensors' own limit)."""

DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool",
}
"""Safetensors dtype code -> numpy dtype name, for the dtypes numpy has."""

CODES = {name: code for code, name in DTYPES.items()}

_WITHOUT_NUMPY = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "E8M0"}
_READ_CHUNK = 16 * 1024 * 1024  # bytes per pread where os.preadv is missing


class TensorFileError(ValueError):
    """A malformed safetensors file, a dtype numpy lacks, or a tensor that does not match its layout."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's dtype (a numpy name: ``float32``, ``int64``, ``bool``, ...) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in CODES:
            raise TensorFileError(f"unsupported tensor dtype {self.dtype!r}; supported: {', '.join(CODES)}")
        if isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__iter__"):
            raise TensorFileError(f"a tensor shape is a tuple of ints >= 0, got {self.shape!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise TensorFileError(f"a tensor shape is a tuple of ints >= 0, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @classmethod
    def of(cls, array: np.ndarray) -> TensorInfo:
        """The info of ``array``."""
        array = np.asarray(array)
        return cls(array.dtype.name, array.shape)

    @property
    def nbytes(self) -> int:
        """The size of the tensor's data."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


# ------------------------------------------------------------------------------------------------------- reading


class TensorFile:
    """A safetensors file, its header checked on opening, its tensors read one at a time with :meth:`read`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(self._fd).st_size
            self._infos, self._offsets, self._metadata, self._data_start = _parse(self._fd, size, self.path)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def names(self) -> list[str]:
        """The tensors' names, in the order of their data."""
        return list(self._infos)

    @property
    def metadata(self) -> dict[str, str]:
        """The header's ``__metadata__`` (empty when it has none)."""
        return dict(self._metadata)

    @property
    def nbytes(self) -> int:
        """The size of the data region: every tensor's bytes."""
        return sum(info.nbytes for info in self._infos.values())

    def info(self, name: str) -> TensorInfo:
        """The dtype and shape of tensor ``name``."""
        return self._infos[self._known(name)]

    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor's info, in the order of their data."""
        return dict(self._infos)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh, writable array in native byte order."""
        info = self._infos[self._known(name)]
        if self._fd < 0:
            raise TensorFileError(f"{self.path}: the file is closed")
        array = np.empty(info.shape, dtype=np.dtype(info.dtype).newbyteorder("<"))
        _read_into(self._fd, array.reshape(-1).view(np.uint8), self._data_start + self._offsets[name], self.path)
        return array.astype(array.dtype.newbyteorder("="), copy=False)

    def close(self) -> None:
        """Release the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorFile({self.path!r}, {len(self._infos)} tensors, {self.nbytes} bytes)"

    def _known(self, name: str) -> str:
        if name not in self._infos:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return name


def _parse(fd: int, size: int, path: str) -> tuple[dict[str, TensorInfo], dict[str, int], dict[str, str], int]:
    """``(infos, begin offsets, metadata, data start)`` from the header, every rule of the format checked."""
    if size < 8:
        raise TensorFileError(f"{path}: truncated ({size} bytes; the header length alone takes 8)")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > MAX_HEADER_BYTES:
        raise TensorFileError(f"{path}: header of {length} bytes, more than the {MAX_HEADER_BYTES} allowed")
    if 8 + length > size:
        raise TensorFileError(f"{path}: truncated: the header says {length} bytes, the file has {size - 8} after it")
    raw = os.pread(fd, length, 8)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, TensorFileError) as exc:
        raise TensorFileError(f"{path}: the header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    metadata = _metadata(header.pop("__metadata__", None), path)
    entries = []
    for name, entry in header.items():
        info, begin, end = _entry(name, entry, path)
        entries.append((begin, end, name, info))
    entries.sort(key=lambda e: (e[0], e[1]))  # stable: empty tensors sharing an offset keep the header's order
    data_size = size - 8 - length
    position = 0
    for begin, end, name, _ in entries:
        if begin < position:
            raise TensorFileError(f"{path}: tensor {name!r} at [{begin}, {end}) overlaps the data before {position}")
        if begin > position:
            raise TensorFileError(f"{path}: a gap of {begin - position} bytes before tensor {name!r} at {begin}")
        position = end
    if position != data_size:
        what = "truncated: the tensors need" if position > data_size else "the tensors cover"
        raise TensorFileError(f"{path}: {what} {position} data bytes, the file has {data_size}")
    infos = {name: info for _, _, name, info in entries}
    offsets = {name: begin for begin, _, name, _ in entries}
    return infos, offsets, metadata, 8 + length


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TensorFileError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _metadata(value: Any, path: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TensorFileError(f"{path}: __metadata__ must be an object of strings to strings, got {value!r}")
    return value


def _entry(name: str, entry: Any, path: str) -> tuple[TensorInfo, int, int]:
    if not name:
        raise TensorFileError(f"{path}: a tensor with an empty name")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise TensorFileError(f"{path}: tensor {name!r} must have exactly dtype, shape and data_offsets, got {entry!r}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code in _WITHOUT_NUMPY:
        raise TensorFileError(f"{path}: tensor {name!r} has dtype {code}, and numpy has no such dtype")
    if code not in DTYPES:
        raise TensorFileError(f"{path}: tensor {name!r} has unknown dtype {code!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise TensorFileError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of ints >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets):
        raise TensorFileError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end] ints >= 0")
    begin, end = offsets
    info = TensorInfo(DTYPES[code], tuple(shape))
    if end < begin or end - begin != info.nbytes:
        raise TensorFileError(
            f"{path}: tensor {name!r} ({code} {shape}) needs {info.nbytes} bytes, its data_offsets [{begin}, {end}] "
            f"give {end - begin}"
        )
    return info, begin, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_into(fd: int, buffer: np.ndarray, offset: int, path: str) -> None:
    """Fill the uint8 array ``buffer`` from ``offset``, looping over short reads."""
    view = buffer.data
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(fd, [view[done:]], offset + done)
        else:
            chunk = os.pread(fd, min(_READ_CHUNK, len(view) - done), offset + done)
            got = len(chunk)
            view[done : done + got] = chunk
        if got == 0:
            raise TensorFileError(f"{path}: the file ended while reading (was it changed since it was opened?)")
        done += got


# ------------------------------------------------------------------------------------------------------- writing


class TensorWriter:
    """Writes a safetensors file whose layout is ``infos``, taking the tensors one at a time in that order.

    ``write(name, array)`` for each tensor, then :meth:`close` (or leave the ``with`` block) moves the finished file
    into place. An exception inside the block, or :meth:`abort`, deletes the temporary file instead; so does closing
    before every tensor was written (a :class:`TensorFileError`).
    """

    def __init__(self, path: str | os.PathLike[str], infos: Mapping[str, TensorInfo],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = os.fspath(path)
        self._infos = dict(infos)
        header = _header(self._infos, metadata)
        self._pending = iter(self._infos)
        self._next: str | None = next(self._pending, None)
        directory, base = os.path.split(os.path.abspath(self.path))
        fd, self._temp = tempfile.mkstemp(prefix=f".{base}.", suffix=".part", dir=directory)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        try:
            self._file.write(struct.pack("<Q", len(header)) + header)
        except BaseException:
            self.abort()
            raise
        self.written = 8 + len(header)
        """Bytes written so far."""

    def write(self, name: str, array: np.ndarray) -> None:
        """Write tensor ``name``: the next of the layout, with its dtype and shape."""
        if self._file is None:
            raise TensorFileError(f"{self.path}: the writer is closed")
        if name != self._next:
            expected = "no more tensors" if self._next is None else f"tensor {self._next!r}"
            raise TensorFileError(f"{self.path}: got tensor {name!r}, the layout expects {expected} next")
        info = self._infos[name]
        array = np.asarray(array)
        if array.dtype.name != info.dtype or array.shape != info.shape:
            raise TensorFileError(
                f"{self.path}: tensor {name!r} is {array.dtype.name} {array.shape}, the layout says "
                f"{info.dtype} {info.shape}"
            )
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
        self._file.write(data.data)
        self.written += data.size
        self._next = next(self._pending, None)

    def close(self) -> int:
        """Finish the file (flushed, fsynced, moved into place) and return its size in bytes."""
        if self._file is None:
            raise TensorFileError(f"{self.path}: the writer is closed")
        if self._next is not None:
            missing = self._next
            self.abort()
            raise TensorFileError(f"{self.path}: closed before tensor {missing!r} was written; nothing was kept")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._temp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.written

    def abort(self) -> None:
        """Drop the temporary file; the target is left as it was (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if os.path.exists(self._temp):
            os.unlink(self._temp)

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abort()
        elif self._file is not None:
            self.close()


def write_tensors(path: str | os.PathLike[str], infos: Mapping[str, TensorInfo],
                  produce: Callable[[str], np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write a safetensors file laid out as ``infos``, asking ``produce(name)`` for each tensor in that order.

    One tensor is held at a time. Returns the file's size in bytes.
    """
    with TensorWriter(path, infos, metadata) as writer:
        for name in infos:
            writer.write(name, produce(name))
        return writer.close()


def _header(infos: dict[str, TensorInfo], metadata: Mapping[str, str] | None) -> bytes:
    """The JSON header, padded with spaces to a multiple of 8 bytes as the safetensors library does."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TensorFileError(f"metadata must map strings to strings, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    position = 0
    for name, info in infos.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise TensorFileError(f"bad tensor name {name!r}")
        if not isinstance(info, TensorInfo):
            raise TensorFileError(f"tensor {name!r}: expected a TensorInfo, got {type(info).__name__}")
        end = position + info.nbytes
        header[name] = {"dtype": CODES[info.dtype], "shape": list(info.shape), "data_offsets": [position, end]}
        position = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)
