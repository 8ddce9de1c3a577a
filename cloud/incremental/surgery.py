"""ONNX surgery for incremental training: find a classifier's last dense layer, cut off the frozen body, put a
trained layer back (DESIGN §5).

The last dense layer is ``Gemm(feature, W, b)`` or ``MatMul(feature, W)`` followed by ``Add(·, b)``, with W
and b initializers, optionally followed by ``Softmax``/``LogSoftmax``/``Identity`` up to the graph's output.
Found from the output backwards (:func:`find_dense`), or confirmed when the caller names the tensor that
feeds it (``layer``). The layer's numbers are handed out in one orientation (:func:`layer_arrays`: ``weight``
[features, classes], ``bias`` [classes], Gemm's ``alpha``/``beta`` and ``transB`` folded in) and put back
in the file's own (:func:`with_layer`). :func:`body` is the model from its inputs to ``feature``: the head of
the partitioning tool's cut there (``cloud.ml.partition.split_model``), the frozen part a device runs once over
its data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnx

# onnx loads at the first cut, not with the hub

TRAILING = frozenset({"Softmax", "LogSoftmax", "Identity"})


class SurgeryError(ValueError):
    """The model is not one this module can split (the message says why)."""


@dataclass(frozen=True)
class DenseLayer:
    """Where the trainable last layer sits in the model."""

    feature: str
    """the tensor feeding the layer (the body's output)"""
    weight: str
    """the weight initializer"""
    bias: str
    """the bias initializer"""
    transposed: bool
    """the weight is stored [classes, features] (Gemm transB=1)"""
    alpha: float
    beta: float
    features: int
    classes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DenseLayer:
        return cls(**doc)


def load(data: bytes) -> onnx.ModelProto:
    import onnx

    try:
        return onnx.load_from_string(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise SurgeryError(f"not an ONNX model: {exc}") from None


def find_dense(model: onnx.ModelProto, layer: str | None = None) -> DenseLayer:
    """The last dense layer (see the module docstring); ``layer`` names the tensor that must feed it."""
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    outputs = [o.name for o in graph.output]
    if len(outputs) != 1:
        raise SurgeryError(f"the model has {len(outputs)} outputs {outputs}; the last dense layer is found from its one output")
    tensor = outputs[0]
    while (node := producer.get(tensor)) is not None and node.op_type in TRAILING:
        tensor = node.input[0]
    if node is None:
        raise SurgeryError(f"the model's output {outputs[0]!r} is not computed by a dense layer")
    bias: str | None = None
    if node.op_type == "Add":
        a, b = node.input
        bias, tensor = (b, a) if b in inits else (a, b) if a in inits else (None, tensor)
        if bias is None:
            raise SurgeryError(f"the Add before the output ({node.name or node.output[0]}) adds no initializer (bias)")
        node = producer.get(tensor)
        if node is None or node.op_type != "MatMul":
            raise SurgeryError("the bias is not added to a MatMul: the model does not end in a dense layer (MatMul + Add or Gemm)")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            raise SurgeryError("the last Gemm transposes its input (transA=1); not supported")
        if len(node.input) < 3 or not node.input[2]:
            raise SurgeryError("the last dense layer has no bias; a bias is needed")
        bias = node.input[2]
    elif node.op_type != "MatMul":
        raise SurgeryError(f"the model ends in {node.op_type}, not a dense layer (MatMul + Add or Gemm, then Softmax)")
    if bias is None:
        raise SurgeryError("the last dense layer has no bias; a bias is needed")
    feature, weight = node.input[0], node.input[1]
    if layer is not None and layer != feature:
        raise SurgeryError(f"tensor {layer!r} does not feed the last dense layer; {feature!r} does")
    for name, what in ((weight, "weight"), (bias, "bias")):
        if name not in inits:
            raise SurgeryError(f"the last layer's {what} {name!r} is not an initializer")
        if uses.get(name, 0) != 1:
            raise SurgeryError(f"the last layer's {what} {name!r} is shared with other nodes")
        if inits[name].data_type != onnx.TensorProto.FLOAT:
            raise SurgeryError(f"the last layer's {what} is not float32")
    transposed = node.op_type == "Gemm" and bool(attrs.get("transB", 0))
    w = numpy_helper.to_array(inits[weight])
    b = numpy_helper.to_array(inits[bias])
    if w.ndim != 2:
        raise SurgeryError(f"the last layer's weight has shape {list(w.shape)}, not 2-D")
    features, classes = (w.shape[1], w.shape[0]) if transposed else w.shape
    if b.size != classes or b.ndim > 2:
        raise SurgeryError(f"the last layer's bias has shape {list(b.shape)}; {classes} classes expected")
    alpha = float(attrs.get("alpha", 1.0)) if node.op_type == "Gemm" else 1.0
    beta = float(attrs.get("beta", 1.0)) if node.op_type == "Gemm" else 1.0
    if alpha == 0 or beta == 0:
        raise SurgeryError("the last Gemm has alpha or beta 0")
    return DenseLayer(feature, weight, bias, transposed, alpha, beta, int(features), int(classes))


def layer_arrays(model: onnx.ModelProto, layer: DenseLayer) -> tuple[np.ndarray, np.ndarray]:
    """The layer as the device trains it: ``weight`` [features, classes] and ``bias`` [classes] (float32),
    so that logits = feature @ weight + bias."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    w = numpy_helper.to_array(inits[layer.weight]).astype(np.float32)
    b = numpy_helper.to_array(inits[layer.bias]).astype(np.float32).reshape(-1)
    w = w.T if layer.transposed else w
    return np.ascontiguousarray(w * np.float32(layer.alpha)), np.ascontiguousarray(b * np.float32(layer.beta))


def with_layer(model: onnx.ModelProto, layer: DenseLayer, weight: np.ndarray, bias: np.ndarray, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose last layer is (``weight``, ``bias``) in :func:`layer_arrays`'s orientation."""
    import onnx
    from onnx import numpy_helper

    if weight.shape != (layer.features, layer.classes) or bias.shape != (layer.classes,):
        raise SurgeryError(f"the trained layer has weight {list(weight.shape)} and bias {list(bias.shape)}; "
                           f"[{layer.features}, {layer.classes}] and [{layer.classes}] expected")  # fmt: skip
    out = onnx.ModelProto()
    out.CopyFrom(model)
    stored_w = (weight / np.float32(layer.alpha)).astype(np.float32)
    stored_w = np.ascontiguousarray(stored_w.T if layer.transposed else stored_w)
    stored_b = (bias / np.float32(layer.beta)).astype(np.float32)
    for init in out.graph.initializer:
        if init.name == layer.weight:
            init.CopyFrom(numpy_helper.from_array(stored_w, layer.weight))
        elif init.name == layer.bias:
            shape = tuple(init.dims)
            init.CopyFrom(numpy_helper.from_array(stored_b.reshape(shape), layer.bias))
    for key, value in (metadata or {}).items():
        entry = next((p for p in out.metadata_props if p.key == key), None) or out.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(out)
    return out


def body(model: onnx.ModelProto, layer: DenseLayer) -> onnx.ModelProto:
    """The model from its inputs to ``layer.feature``: the head of ``cloud.ml.partition.split_model`` cut there
    (initializers and nodes that feed it only; checked in full)."""
    from cloud.ml.partition import split_model

    from onnx.checker import ValidationError

    try:
        head, _tail = split_model(model, layer.feature)
    except (ValueError, ValidationError) as exc:
        raise SurgeryError(f"cannot cut the body at {layer.feature!r}: {exc}") from None
    head.doc_string = f"the frozen body of {model.graph.name or 'a model'} up to {layer.feature}"
    return head


@dataclass(frozen=True)
class Cut:
    """A model cut at the input of its last dense layer: where the layer is, its numbers, the frozen body."""

    layer: DenseLayer
    head: bytes
    """safetensors: weight [features, classes], bias [classes]"""
    body: bytes
    """the ONNX model from the inputs to ``layer.feature``"""


def cut(data: bytes, layer: str | None, max_head_bytes: int, carrier: str) -> Cut:
    """Cut the ONNX model ``data`` (:func:`find_dense` with ``layer``); :class:`SurgeryError` when it cannot be, or
    when the layer's frame is over ``max_head_bytes`` (what one ``carrier`` holds)."""
    from safetensors.numpy import save

    model = load(data)
    found = find_dense(model, layer)
    weight, bias = layer_arrays(model, found)
    head = save({"weight": weight, "bias": bias})
    if len(head) > max_head_bytes:
        raise SurgeryError(f"the last layer ({found.features} x {found.classes}) takes {len(head)} bytes; {carrier} carries at most {max_head_bytes}")
    return Cut(found, head, body(model, found).SerializeToString())
