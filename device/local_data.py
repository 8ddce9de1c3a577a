"""Datasets kept on the device (DESIGN §5): ``<data dir>/datasets/<name>.npz`` holding inputs ``x`` and labels ``y``.

Their rows never leave the device. Only their description (``LocalDataset``: rows, the shape and dtype of one
input row) is reported upstream, under ``datasets`` in the reported document
(:data:`interfaces.privacy.DATASETS_KEY`), so that the hub can account the privacy of training on them
(``incremental_training``). ``aisynergy device run --dataset NAME=PATH.npz`` (repeatable) copies a file in at
start; an application calls :meth:`LocalDatasets.add` (a file) or :meth:`LocalDatasets.put` (arrays).

A dataset is valid when ``x`` is a numeric array with a first axis, ``y`` a 1-D integer array of the same
length, and nothing in the file needs pickle. Descriptions are read from the ``.npy`` headers inside the
``.npz`` (nothing is loaded); :meth:`LocalDatasets.load` loads the arrays for a worker.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from interfaces.privacy import LocalDataset

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("aisynergy.device.datasets")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SUFFIX = ".npz"


class DatasetError(ValueError):
    """A dataset name, file or array that cannot be used (the message says why)."""


class LocalDatasets:
    """The device's datasets under ``root``; ``on_change()`` is called after one is added or removed."""

    def __init__(self, root: Path, on_change: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.on_change = on_change
        self._lock = threading.Lock()
        self._described: dict[str, tuple[tuple[int, int], LocalDataset]] = {}  # name -> ((mtime_ns, size), description)

    # ---- reading ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[: -len(SUFFIX)] for p in self.root.iterdir() if p.is_file() and p.name.endswith(SUFFIX) and _NAME.match(p.name[: -len(SUFFIX)]))

    def describe(self) -> dict[str, dict[str, Any]]:
        """``{name: LocalDataset as JSON}`` of every readable dataset (a damaged file is logged and left out)."""
        out = {}
        for name in self.names():
            try:
                out[name] = self.info(name).model_dump(mode="json")
            except DatasetError as exc:
                log.warning("dataset %s is not usable: %s", name, exc)
        return out

    def info(self, name: str) -> LocalDataset:
        path = self.path(name)
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise DatasetError(f"no dataset {name!r} on this device (it has {self.names() or 'none'})") from None
        key = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            cached = self._described.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        described = describe_npz(path)
        with self._lock:
            self._described[name] = (key, described)
        return described

    def load(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of dataset ``name``; :class:`DatasetError` when it is missing or invalid."""
        path = self.path(name)
        if not path.is_file():
            raise DatasetError(f"no dataset {name!r} on this device (it has {self.names() or 'none'})")
        return _load(path)

    def path(self, name: str) -> Path:
        if not _NAME.match(name):
            raise DatasetError(f"invalid dataset name {name!r} (letters, digits, '_', '.', '-'; at most 128)")
        return self.root / f"{name}{SUFFIX}"

    def paths(self) -> Mapping[str, Path]:
        """The datasets as ``{name: path}``, read when asked (a ``training`` worker's site datasets on a device)."""
        return _DatasetPaths(self)

    # ---- writing ------------------------------------------------------------------------------------
    def add(self, name: str, source: Path) -> LocalDataset:
        """Copy the ``.npz`` file ``source`` in as ``name`` (checked first; an identical file is left alone)."""
        target = self.path(name)
        x, y = _load(Path(source))
        if target.is_file() and _same_file(target, Path(source)):
            return self.info(name)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        log.info("dataset %s: %d rows of %s %s", name, len(y), list(x.shape[1:]), x.dtype)
        self._changed()
        return self.info(name)

    def put(self, name: str, x: Any, y: Any) -> LocalDataset:
        """Store arrays ``x`` (inputs, first axis = rows) and ``y`` (integer labels) as ``name``."""
        import numpy as np

        x, y = np.asarray(x), np.asarray(y)
        _check(x, y)
        target = self.path(name)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, x=x, y=y)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._changed()
        return self.info(name)

    def remove(self, name: str) -> bool:
        path = self.path(name)
        if not path.exists():
            return False
        path.unlink()
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # the dataset is stored; reporting it waits for the next report
                log.exception("reporting the changed datasets failed")


class _DatasetPaths(Mapping[str, Path]):
    def __init__(self, datasets: LocalDatasets) -> None:
        self._datasets = datasets

    def __getitem__(self, name: str) -> Path:
        if name not in self._datasets.names():
            raise KeyError(name)
        return self._datasets.path(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._datasets.names())

    def __len__(self) -> int:
        return len(self._datasets.names())


def _same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            ca, cb = fa.read(1 << 20), fb.read(1 << 20)
            if ca != cb:
                return False
            if not ca:
                return True


def _check(x: np.ndarray, y: np.ndarray) -> None:
    import numpy as np

    if x.ndim < 1 or x.dtype.hasobject or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DatasetError(f"x must be a numeric array with a first axis; got {x.dtype} {list(x.shape)}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"y must be a 1-D array of integer labels; got {y.dtype} {list(y.shape)}")
    if len(x) != len(y):
        raise DatasetError(f"x has {len(x)} rows but y {len(y)} labels")


def _load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data.files or "y" not in data.files:
                raise DatasetError(f"{path.name} must hold arrays x and y (it holds {data.files})")
            x, y = data["x"], data["y"]
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{path.name} does not load as an .npz of x and y: {exc}") from exc
    _check(x, y)
    return x, y


def describe_npz(path: Path) -> LocalDataset:
    """Rows, row shape and dtype from the ``.npy`` headers inside the ``.npz`` (nothing loaded); ``DatasetError`` when it
    is no ``.npz`` of inputs ``x`` and integer labels ``y``."""
    import numpy as np

    try:
        with zipfile.ZipFile(path) as archive:
            headers = {}
            for member in ("x", "y"):
                with archive.open(f"{member}.npy") as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    headers[member] = read(f)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{path.name} is not an .npz of x and y: {exc}") from exc
    (x_shape, _, x_dtype), (y_shape, _, y_dtype) = headers["x"], headers["y"]
    if not x_shape or x_dtype.hasobject or len(y_shape) != 1 or y_shape[0] != x_shape[0] or not np.issubdtype(y_dtype, np.integer):
        raise DatasetError(f"{path.name}: x {x_dtype} {list(x_shape)} and y {y_dtype} {list(y_shape)} are not inputs and labels")
    return LocalDataset(rows=int(x_shape[0]), shape=[int(d) for d in x_shape[1:]], dtype=str(x_dtype))
