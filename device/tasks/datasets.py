"""Dataset artefacts read row range by row range: ``.npy`` (memory-mapped, never pickled) or ``.safetensors``.

The first axis indexes the inputs. A safetensors file may hold several tensors: the one read is the one
named (``input_name``), else its only tensor, else the one named like the model's input.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from device.tasks.worker import Failed, Rejected
from interfaces.deployments import ArtifactFormat

if TYPE_CHECKING:
    import numpy as np


class Dataset:
    """One tensor of a dataset file; :meth:`read` returns a row range as an in-memory array."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, source: Any, closer: Any = None) -> None:
        if not shape:
            raise Rejected(f"the dataset tensor {name!r} is a scalar; its first axis must index the inputs")
        self.name, self.shape, self.dtype = name, shape, dtype
        self._source, self._closer = source, closer

    @property
    def rows(self) -> int:
        return self.shape[0]

    def read(self, start: int, end: int) -> np.ndarray:
        import numpy as np

        return np.ascontiguousarray(self._source[start:end])

    def describe(self) -> str:
        return f"{self.rows} rows of shape {list(self.shape[1:])} {self.dtype}"

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self._source = None


def open_dataset(path: Path, fmt: ArtifactFormat, tensor: str | None, model_input: str) -> Dataset:
    """Open ``path`` (``fmt``: npy or safetensors); :class:`Rejected` for a tensor that is not there,
    :class:`Failed` for a file that does not load."""
    if fmt is ArtifactFormat.NPY:
        import numpy as np

        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise Failed(f"the dataset does not load as npy: {exc}") from exc
        return Dataset(tensor or "array", tuple(array.shape), str(array.dtype), array)
    if fmt is ArtifactFormat.SAFETENSORS:
        return _open_safetensors(path, tensor, model_input)
    raise Rejected(f"a dataset cannot have format {fmt.value} (npy, safetensors)")


def _open_safetensors(path: Path, tensor: str | None, model_input: str) -> Dataset:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="numpy")
        names = list(handle.keys())
    except (OSError, SafetensorError) as exc:
        raise Failed(f"the dataset does not load as safetensors: {exc}") from exc
    if tensor is not None:
        name = tensor
    elif len(names) == 1:
        name = names[0]
    elif model_input in names:
        name = model_input
    else:
        name = ""
    if name not in names:
        handle.__exit__(None, None, None)
        wanted = f"no tensor {tensor!r}" if tensor else "several tensors"
        raise Rejected(f"the dataset has {wanted} (it has {sorted(names)}); name the one to read with input_name")
    part = handle.get_slice(name)
    dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype())
    return Dataset(name, tuple(part.get_shape()), dtype, part, lambda: handle.__exit__(None, None, None))


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
