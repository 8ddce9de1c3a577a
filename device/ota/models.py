"""The models a device serves, swapped atomically on update (DESIGN §5).

``<root>/<name>/<sha256>.<ext>`` holds each installed model file; the current and the previous version
are kept (rollback target, delta base), older ones are removed. Each name maps to one
:class:`LoadedModel`; :meth:`ModelHost.infer` reads that reference once, so a request in flight
finishes on the model it started with while later requests use the new one. A new model is loaded and
run once on zeros before the swap: one that does not load or run raises :class:`ModelLoadError` and the
old one keeps serving.

Observers (:meth:`ModelHost.add_listener`) hear of every request :meth:`ModelHost.infer` ran: the model's
name, the seconds it took, the rows of its first input and whether it succeeded (an ``inference`` task
worker counts requests and latencies with them, whatever the caller: the ``infer`` command, the
application, a batch worker).

ONNX models run in ONNX Runtime (CPU); TFLite models in LiteRT (``ai_edge_litert``, or the older
``tflite_runtime``) when installed. numpy and the runtimes are imported only when a model is loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from interfaces.deployments import ArtifactFormat

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("aisynergy.device.ota")

_ONNX_DTYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16", "tensor(int64)": "int64",
    "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool",
}  # fmt: skip
EXTENSIONS = {ArtifactFormat.ONNX: "onnx", ArtifactFormat.TFLITE: "tflite"}


InferListener = Callable[[str, float, int, bool], None]
"""``(model name, seconds, rows, ok)``, called on the requesting thread after each request; keep it cheap."""


class ModelLoadError(Exception):
    """The model file cannot be loaded or does not run (the execution is FAILED; the old model serves on)."""


class NoModel(LookupError):
    """No model of that name (or none at all) is loaded."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int | str | None, ...]
    dtype: str  # numpy dtype name

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


class Runner(Protocol):
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class LoadedModel:
    name: str
    version: str
    sha256: str
    format: ArtifactFormat
    path: Path
    runner: Runner = field(repr=False)

    @property
    def inputs(self) -> list[TensorInfo]:
        return self.runner.inputs

    @property
    def outputs(self) -> list[TensorInfo]:
        return self.runner.outputs

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "version": self.version, "sha256": self.sha256, "format": self.format.value,
            "inputs": [t.as_dict() for t in self.inputs], "outputs": [t.as_dict() for t in self.outputs],
        }  # fmt: skip


@dataclass(frozen=True)
class Inference:
    outputs: dict[str, np.ndarray]
    name: str
    version: str


class _OnnxRunner:
    def __init__(self, path: Path, threads: int | None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # idle pool threads sleep instead of spinning: a board (or an edge hosting many models) should not
        # burn its cores between requests
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.inputs = [TensorInfo(i.name, tuple(i.shape), _ONNX_DTYPES.get(i.type, "float32")) for i in self._session.get_inputs()]
        self.outputs = [TensorInfo(o.name, tuple(o.shape), _ONNX_DTYPES.get(o.type, "float32")) for o in self._session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self._session.run(None, feeds)  # thread-safe: concurrent requests share the session
        return {o.name: v for o, v in zip(self.outputs, values, strict=True)}


class _TfliteRunner:
    def __init__(self, path: Path, threads: int | None) -> None:
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError:
            try:
                from tflite_runtime.interpreter import Interpreter  # type: ignore[no-redef]
            except ImportError:
                raise ModelLoadError("tflite runtime not installed (pip install 'aisynergy[tflite]')") from None
        self._interpreter = Interpreter(model_path=str(path), num_threads=threads)
        self._interpreter.allocate_tensors()
        self._lock = threading.Lock()  # one interpreter runs one request at a time
        self._in = self._interpreter.get_input_details()
        self._out = self._interpreter.get_output_details()
        self.inputs = [TensorInfo(d["name"], tuple(int(n) for n in d["shape"]), d["dtype"].__name__) for d in self._in]
        self.outputs = [TensorInfo(d["name"], tuple(int(n) for n in d["shape"]), d["dtype"].__name__) for d in self._out]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            for detail in self._in:
                value = feeds[detail["name"]]
                if tuple(value.shape) != tuple(detail["shape"]):
                    self._interpreter.resize_tensor_input(detail["index"], value.shape)
                    self._interpreter.allocate_tensors()
                self._interpreter.set_tensor(detail["index"], value)
            self._interpreter.invoke()
            return {d["name"]: self._interpreter.get_tensor(d["index"]).copy() for d in self._out}


class ModelHost:
    """The served models by name; see the module docstring. ``threads``: ONNX Runtime intra-op threads."""

    def __init__(self, root: Path, threads: int | None = None) -> None:
        self.root = Path(root)
        self._threads = threads
        self._models: dict[str, LoadedModel] = {}
        self._default: str | None = None
        self._swap = threading.Lock()  # serialises swaps and listener changes; readers never take it
        self._listeners: tuple[InferListener, ...] = ()

    # ---- serving ------------------------------------------------------------------------------------
    def get(self, name: str | None = None) -> LoadedModel:
        """The model ``name`` (default: the one installed last); :class:`NoModel` when there is none."""
        key = name or self._default
        model = self._models.get(key) if key else None
        if model is None:
            raise NoModel(f"no model {name!r} is loaded" if name else "no model is loaded")
        return model

    def infer(self, inputs: Mapping[str, Any], name: str | None = None) -> Inference:
        """Run the current model on ``inputs`` (arrays or nested lists, by input name).

        Raises :class:`NoModel`, ``ValueError`` for missing or unknown inputs, or what the runtime raises.
        """
        import numpy as np

        model = self.get(name)  # the one reference this request uses, however many swaps follow
        started, rows, ok = time.perf_counter(), 0, False
        try:
            expected = {t.name: t for t in model.inputs}
            missing, unknown = set(expected) - set(inputs), set(inputs) - set(expected)
            if missing or unknown:
                raise ValueError(f"{model.name} {model.version} takes inputs {sorted(expected)}; missing {sorted(missing)}, unknown {sorted(unknown)}")
            feeds = {k: np.asarray(v, dtype=expected[k].dtype) for k, v in inputs.items()}
            first = next(iter(feeds.values()), None)
            rows = int(first.shape[0]) if first is not None and first.ndim else 1
            result = Inference(model.runner.run(feeds), model.name, model.version)
            ok = True
            return result
        finally:
            self._observe(model.name, time.perf_counter() - started, rows, ok)

    def add_listener(self, listener: InferListener) -> None:
        """Call ``listener`` after every request from now on (see the module docstring)."""
        with self._swap:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: InferListener) -> None:
        with self._swap:
            self._listeners = tuple(item for item in self._listeners if item != listener)  # bound methods: equal, not identical

    def _observe(self, name: str, seconds: float, rows: int, ok: bool) -> None:
        for listener in self._listeners:  # one read of the tuple: a change meanwhile takes effect next time
            try:
                listener(name, seconds, rows, ok)
            except Exception:  # an observer's bug must not fail the request
                log.exception("an inference listener failed")

    def models(self) -> list[dict[str, Any]]:
        return [m.describe() for m in list(self._models.values())]

    # ---- installing ---------------------------------------------------------------------------------
    def file_for(self, name: str, sha256: str, fmt: ArtifactFormat) -> Path:
        return self.root / name / f"{sha256}.{EXTENSIONS.get(fmt, fmt.value)}"

    def load(self, name: str, version: str, sha256: str, fmt: ArtifactFormat, path: Path) -> LoadedModel:
        """Load ``path`` and run it once on zeros; :class:`ModelLoadError` when either fails."""
        import numpy as np

        try:
            if fmt is ArtifactFormat.ONNX:
                runner: Runner = _OnnxRunner(path, self._threads)
            elif fmt is ArtifactFormat.TFLITE:
                runner = _TfliteRunner(path, self._threads)
            else:
                raise ModelLoadError(f"format {fmt.value} is not a model format (onnx, tflite)")
            feeds = {t.name: np.zeros([d if isinstance(d, int) and d > 0 else 1 for d in t.shape], dtype=t.dtype) for t in runner.inputs}
            runner.run(feeds)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{name} {version} does not load or run: {type(exc).__name__}: {exc}") from exc
        return LoadedModel(name, version, sha256, fmt, path, runner)

    def install(self, name: str, version: str, sha256: str, fmt: ArtifactFormat, source: Path, keep: frozenset[Path] = frozenset()) -> LoadedModel:
        """Move ``source`` into place, load and check it, then swap it in. Files of ``name`` other than
        the new one, the replaced one and ``keep`` are removed. Raises :class:`ModelLoadError`."""
        target = self.file_for(name, sha256, fmt)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source != target:
            tmp = target.with_name(f".{target.name}.tmp")
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        try:
            model = self.load(name, version, sha256, fmt, target)
        except ModelLoadError:
            serving = self._models.get(name)
            if target not in keep and (serving is None or serving.path != target):
                target.unlink(missing_ok=True)
            raise
        old = self.activate(model)
        kept = {target, *keep} | ({old.path} if old is not None else set())
        for stale in target.parent.iterdir():
            if stale.is_file() and stale not in kept:
                stale.unlink(missing_ok=True)
        return model

    def activate(self, model: LoadedModel) -> LoadedModel | None:
        """Swap ``model`` in; return the one it replaces (requests already running finish on it)."""
        with self._swap:
            old = self._models.get(model.name)
            models = dict(self._models)
            models[model.name] = model
            self._models = models  # one reference assignment: readers see the old dict or the new one
            self._default = model.name
        log.info("model %s %s now serves (was %s)", model.name, model.version, old.version if old else "none")
        return old


def model_commands(host: ModelHost) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    """The built-in commands over ``host``, by name (the device's and the edge node's): ``infer``
    (``{"inputs": {name: nested list}, "model": optional name}``) and ``models`` (what is loaded)."""

    def infer(args: dict[str, Any]) -> dict[str, Any]:
        inputs = args.get("inputs")
        if not isinstance(inputs, dict):
            raise TypeError('give {"inputs": {input name: nested list}}')
        result = host.infer(inputs, args.get("model"))
        return {"outputs": {k: v.tolist() for k, v in result.outputs.items()}, "model": {"name": result.name, "version": result.version}}

    def models(args: dict[str, Any]) -> dict[str, Any]:
        return {"models": host.models()}

    return {"infer": infer, "models": models}
