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

Models run behind :mod:`device.runtime`'s one interface: ONNX models in ONNX Runtime (CPU), TFLite models in
LiteRT (``ai_edge_litert``, or the older ``tflite_runtime``) when installed. numpy and the runtimes are imported
only when a model is loaded.
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
from typing import TYPE_CHECKING, Any, NamedTuple

from device.runtime import Runtime, RuntimeNotInstalled, TensorInfo, open_model
from interfaces.deployments import ArtifactFormat

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("aisynergy.device.ota")

EXTENSIONS = {ArtifactFormat.ONNX: "onnx", ArtifactFormat.TFLITE: "tflite"}
Runner = Runtime  # what a LoadedModel runs on (device.runtime); TensorInfo is re-exported from there too


_numpy: Any = None  # the numpy module, set when the first model is loaded (LoadedModel)


def _rows(feeds: dict[str, Any] | None) -> int:
    """The rows of a request's first input (0 when it failed before its inputs were read)."""
    if not feeds:
        return 0
    first = next(iter(feeds.values()))
    return int(first.shape[0]) if first.ndim else 1


InferListener = Callable[[str, float, int, bool], None]
"""``(model name, seconds, rows, ok)``, called on the requesting thread after each request; keep it cheap."""


class ModelLoadError(Exception):
    """The model file cannot be loaded or does not run (the execution is FAILED; the old model serves on)."""


class NoModel(LookupError):
    """No model of that name (or none at all) is loaded."""


@dataclass(frozen=True)
class LoadedModel:
    name: str
    version: str
    sha256: str
    format: ArtifactFormat
    path: Path
    runner: Runner = field(repr=False)
    # input name -> numpy dtype, computed once: the request path only compares (ModelHost.infer)
    dtypes: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        global _numpy
        import numpy as np

        _numpy = np  # for ModelHost.infer: numpy is imported once a model exists, not when this module is
        object.__setattr__(self, "dtypes", {t.name: np.dtype(t.dtype) for t in self.runner.inputs})

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


class Inference(NamedTuple):
    """One request's answer: the outputs by name, which model (name, version) computed them and how: ``local``
    (here, the usual way) or what a route said (a split-inference worker: ``split:<cut>``, ``edge``, ``device``,
    ``fallback``). (A named tuple: immutable, and cheaper to make on every request than a frozen dataclass.)"""

    outputs: dict[str, np.ndarray]
    name: str
    version: str
    route: str = "local"


Route = Callable[[LoadedModel, dict[str, Any]], tuple[dict[str, Any], str]]
"""``route(model, feeds) -> (outputs, how)``: serves a model's requests instead of running it here (split
inference); ``feeds`` are already checked and converted; it may run ``model.runner`` itself (a fallback)."""


class ModelHost:
    """The served models by name; see the module docstring. ``threads``: ONNX Runtime intra-op threads."""

    def __init__(self, root: Path, threads: int | None = None) -> None:
        self.root = Path(root)
        self._threads = threads
        self._models: dict[str, LoadedModel] = {}
        self._default: str | None = None
        self._swap = threading.Lock()  # serialises swaps and listener changes; readers never take it
        self._listeners: tuple[InferListener, ...] = ()
        self._routes: dict[str, Route] = {}

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
        # This is every request's path: it stays within a few hundred nanoseconds of the runtime's own call
        # (bench/ml.py). Arrays of the right dtype pass as they are; anything else is converted once.
        model = self.get(name)  # the one reference this request uses, however many swaps follow
        started, feeds, ok = time.perf_counter(), None, False
        try:
            dtypes = model.dtypes
            if inputs.keys() != dtypes.keys():
                missing, unknown = set(dtypes) - set(inputs), set(inputs) - set(dtypes)
                raise ValueError(f"{model.name} {model.version} takes inputs {sorted(dtypes)}; missing {sorted(missing)}, unknown {sorted(unknown)}")
            ndarray, asarray = _numpy.ndarray, _numpy.asarray
            feeds = {}
            for key, value in inputs.items():
                dtype = dtypes[key]
                feeds[key] = value if type(value) is ndarray and value.dtype == dtype else asarray(value, dtype=dtype)
            route = self._routes.get(model.name) if self._routes else None
            if route is None:
                result = Inference(model.runner.run(feeds), model.name, model.version)
            else:
                outputs, how = route(model, feeds)
                result = Inference(outputs, model.name, model.version, how)
            ok = True
            return result
        finally:
            if self._listeners:
                self._observe(model.name, time.perf_counter() - started, _rows(feeds), ok)

    def add_listener(self, listener: InferListener) -> None:
        """Call ``listener`` after every request from now on (see the module docstring)."""
        with self._swap:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: InferListener) -> None:
        with self._swap:
            self._listeners = tuple(item for item in self._listeners if item != listener)  # bound methods: equal, not identical

    def set_route(self, name: str, route: Route) -> None:
        """Serve the requests to model ``name`` through ``route`` from now on (one route per name)."""
        with self._swap:
            if name in self._routes and self._routes[name] != route:
                raise ValueError(f"model {name} is already routed elsewhere (another split_inference worker serves it)")
            self._routes = {**self._routes, name: route}

    def clear_route(self, name: str, route: Route) -> None:
        """Stop routing ``name`` through ``route`` (requests run here again); nothing if another route took over."""
        with self._swap:
            if self._routes.get(name) == route:
                self._routes = {k: v for k, v in self._routes.items() if k != name}

    def routed(self, name: str) -> bool:
        return name in self._routes

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

        if fmt not in EXTENSIONS:
            raise ModelLoadError(f"format {fmt.value} is not a model format (onnx, tflite)")
        try:
            runner = open_model(path, self._threads, kind=EXTENSIONS[fmt])
            feeds = {t.name: np.zeros([d if isinstance(d, int) and d > 0 else 1 for d in t.shape], dtype=t.dtype) for t in runner.inputs}
            runner.run(feeds)
        except RuntimeNotInstalled as exc:
            raise ModelLoadError(str(exc)) from exc
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
        return {
            "outputs": {k: v.tolist() for k, v in result.outputs.items()}, "model": {"name": result.name, "version": result.version}, "route": result.route,
        }  # fmt: skip

    def models(args: dict[str, Any]) -> dict[str, Any]:
        return {"models": host.models()}

    return {"infer": infer, "models": models}
