"""One inference interface over the two runtimes a device may have (DESIGN §5, standard 6.3.2 a, b).

    from device.runtime import open_model

    model = open_model("digits-cnn.tflite", threads=2)      # or .onnx
    model.inputs        # [TensorInfo(name='x', shape=(None, 1, 8, 8), dtype='float32')]
    model.run({"x": images})["logits"]

:func:`open_model` picks the runtime by the file's suffix: ``.onnx`` runs in ONNX Runtime (CPU),
``.tflite`` in LiteRT (``ai_edge_litert``; the older ``tflite_runtime`` when that is what the board has).
Both read the model's inputs and outputs (name, shape, numpy dtype) from the file. A shape holds an ``int``
for a fixed dimension and, for a dynamic one, the ONNX dimension's name (a ``str``, such as ``"batch"``) or
``None`` (an unnamed ONNX dimension, or ``-1`` in a TFLite shape signature).

:meth:`Runtime.run` takes numpy arrays of the inputs' dtypes by input name and returns fresh arrays by output
name. ONNX Runtime runs concurrent requests on one session; a LiteRT interpreter runs one request at a time (a
lock) and is resized (``resize_tensor_input`` + ``allocate_tensors``) when a request's shapes differ from the
previous one's, so a model converted at batch 1 runs any batch when its graph allows it.

numpy and the runtimes are imported only when a model is opened: a board without LiteRT imports this module
and opens ONNX models; opening a ``.tflite`` file there raises :class:`RuntimeNotInstalled`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

ONNX_DTYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16", "tensor(int64)": "int64",
    "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool",
}  # fmt: skip
TFLITE_MISSING = "tflite runtime not installed (pip install 'aisynergy[tflite]')"


class RuntimeNotInstalled(ImportError):
    """The runtime the model file needs is not installed on this machine."""


@dataclass(frozen=True)
class TensorInfo:
    """One input or output: its name, shape (``int`` fixed; ``str`` or ``None`` dynamic) and numpy dtype name."""

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str

    @property
    def dynamic(self) -> bool:
        """Whether any dimension is dynamic."""
        return any(not isinstance(d, int) or d < 0 for d in self.shape)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


class Runtime(ABC):
    """A loaded model: :attr:`inputs`, :attr:`outputs` and :meth:`run` (see the module docstring)."""

    kind: ClassVar[str]
    path: Path
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model on ``feeds`` (one array per input name, of the input's dtype); outputs by name."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, inputs={[t.as_dict() for t in self.inputs]}, outputs={[t.as_dict() for t in self.outputs]})"


class OnnxRunner(Runtime):
    """A model in ONNX Runtime (CPU execution provider)."""

    kind = "onnx"

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise RuntimeNotInstalled("onnxruntime not installed (pip install 'aisynergy[device]')") from None

        self.path = Path(path)
        options = ort.SessionOptions()
        # idle pool threads sleep instead of spinning: a board (or an edge hosting many models) should not
        # burn its cores between requests
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        self.inputs = [TensorInfo(i.name, tuple(i.shape), ONNX_DTYPES.get(i.type, "float32")) for i in self._session.get_inputs()]
        self.outputs = [TensorInfo(o.name, tuple(o.shape), ONNX_DTYPES.get(o.type, "float32")) for o in self._session.get_outputs()]
        self._names = [o.name for o in self.outputs]
        # The session's compiled binding, which InferenceSession.run calls after Python checks that take 1-2 µs
        # (input names, graph capture, OrtValue ownership, EP fallback), a fifth of a small model's whole run
        # (bench/ml.py): feeds here are numpy arrays on the CPU provider, and the binding checks names, shapes
        # and dtypes itself (run checks that every input is there first).
        binding = getattr(self._session, "_sess", None)
        self._run = binding.run if callable(getattr(binding, "run", None)) else self._session.run

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(feeds) < len(self.inputs):  # the binding would start and fail in a kernel, logging to stderr
            missing = sorted({t.name for t in self.inputs} - set(feeds))
            raise ValueError(f"{self.path.name} takes inputs {[t.name for t in self.inputs]}; missing {missing}")
        names = self._names
        values = self._run(names, feeds, None)  # thread-safe: concurrent requests share the session
        return {names[0]: values[0]} if len(names) == 1 else dict(zip(names, values, strict=True))


def _tflite_interpreter() -> Any:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        try:
            from tflite_runtime.interpreter import Interpreter  # type: ignore[no-redef]
        except ImportError:
            raise RuntimeNotInstalled(TFLITE_MISSING) from None
    return Interpreter


def _tflite_shape(detail: dict[str, Any]) -> tuple[int | None, ...]:
    signature = detail.get("shape_signature")
    dims = signature if signature is not None and len(signature) == len(detail["shape"]) else detail["shape"]
    return tuple(int(d) if d >= 0 else None for d in dims)


class TfliteRunner(Runtime):
    """A model in a LiteRT (TFLite) interpreter. Inputs and outputs are named after the model's signature when
    it has exactly one (``litert-torch`` and the TensorFlow converter write one, named as the model's arguments
    and outputs), else after their tensors."""

    kind = "tflite"

    def __init__(self, path: str | Path, threads: int | None = None) -> None:
        import numpy as np

        interpreter_class = _tflite_interpreter()
        self.path = Path(path)
        self._interpreter = interpreter_class(model_path=str(self.path), num_threads=threads)
        self._lock = threading.Lock()  # one interpreter runs one request at a time
        inputs = {d["index"]: d for d in self._interpreter.get_input_details()}
        outputs = {d["index"]: d for d in self._interpreter.get_output_details()}
        in_names = {i: d["name"] for i, d in inputs.items()}
        out_names = {i: d["name"] for i, d in outputs.items()}
        in_order, out_order = list(inputs), list(outputs)
        named = self._signature()
        if named is not None and set(named[0].values()) == set(inputs) and set(named[1].values()) == set(outputs):
            in_names, out_names = {i: n for n, i in named[0].items()}, {i: n for n, i in named[1].items()}
            in_order, out_order = list(named[0].values()), list(named[1].values())
        self._interpreter.allocate_tensors()
        self._in_names, self._in_indices = [in_names[i] for i in in_order], in_order
        self._out = [(out_names[i], i) for i in out_order]
        self._one = (self._in_names[0], in_order[0], *self._out[0]) if len(in_order) == 1 and len(out_order) == 1 else None
        self._shapes = [tuple(int(n) for n in inputs[i]["shape"]) for i in in_order]  # what the interpreter is allocated for
        self.inputs = [TensorInfo(in_names[i], _tflite_shape(inputs[i]), np.dtype(inputs[i]["dtype"]).name) for i in in_order]
        self.outputs = [TensorInfo(out_names[i], _tflite_shape(outputs[i]), np.dtype(outputs[i]["dtype"]).name) for i in out_order]

    def _signature(self) -> tuple[dict[str, int], dict[str, int]] | None:
        """``({input name: tensor index}, {output name: tensor index})`` of the only signature, if one."""
        try:
            signatures = self._interpreter.get_signature_list()
            if len(signatures) != 1:
                return None
            runner = self._interpreter.get_signature_runner(next(iter(signatures)))
            named = ({n: int(d["index"]) for n, d in runner.get_input_details().items()}, {n: int(d["index"]) for n, d in runner.get_output_details().items()})
            del runner  # it holds the interpreter's internals, which resize_tensor_input refuses while referenced
            return named
        except (AttributeError, ValueError, KeyError):  # an old tflite_runtime, or no signature
            return None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._one is not None:  # one input, one output: the common case, without loops (a third of a small model's time)
            in_name, in_index, out_name, out_index = self._one
            try:
                value = feeds[in_name]
            except KeyError:
                raise ValueError(f"{self.path.name} takes inputs {self._in_names}; missing {in_name!r}") from None
            with self._lock:
                if value.shape != self._shapes[0]:
                    self._resize([value.shape])
                self._interpreter.set_tensor(in_index, value)
                self._interpreter.invoke()
                return {out_name: self._interpreter.get_tensor(out_index)}  # get_tensor copies
        try:
            values = [feeds[name] for name in self._in_names]
        except KeyError as exc:
            raise ValueError(f"{self.path.name} takes inputs {self._in_names}; missing {exc.args[0]!r}") from None
        interpreter = self._interpreter
        with self._lock:
            shapes = [value.shape for value in values]
            if shapes != self._shapes:
                self._resize(shapes)
            for index, value in zip(self._in_indices, values):
                interpreter.set_tensor(index, value)
            interpreter.invoke()
            return {name: interpreter.get_tensor(index) for name, index in self._out}  # get_tensor copies

    def _resize(self, shapes: list[tuple[int, ...]]) -> None:
        interpreter = self._interpreter
        try:
            for index, shape in zip(self._in_indices, shapes):
                interpreter.resize_tensor_input(index, shape)
            interpreter.allocate_tensors()
        except Exception as exc:
            for index, shape in zip(self._in_indices, self._shapes):  # back to shapes that worked
                interpreter.resize_tensor_input(index, shape)
            interpreter.allocate_tensors()
            wanted = {name: list(shape) for name, shape in zip(self._in_names, shapes)}
            raise ValueError(f"{self.path.name} cannot run inputs of shapes {wanted}: {exc}") from exc
        self._shapes = shapes


RUNNERS: dict[str, type[Runtime]] = {".onnx": OnnxRunner, ".tflite": TfliteRunner}


def open_model(path: str | Path, threads: int | None = None, *, kind: str | None = None) -> Runtime:
    """Load the model at ``path`` in the runtime its suffix names (``.onnx``, ``.tflite``), or ``kind``
    (``onnx``, ``tflite``) when given. ``threads``: the runtime's intra-op threads (default: the runtime's).

    Raises ``ValueError`` for another suffix or kind, :class:`RuntimeNotInstalled` when the runtime is missing,
    and what the runtime raises for a file it cannot load."""
    path = Path(path)
    suffix = f".{kind.lower()}" if kind else path.suffix.lower()
    runner = RUNNERS.get(suffix)
    if runner is None:
        raise ValueError(f"{path.name}: not a model this device runs (one of {', '.join(RUNNERS)})")
    return runner(path, threads)
