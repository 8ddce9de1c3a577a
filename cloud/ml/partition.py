"""Cut an ONNX model into a device head and an edge tail, and measure the parts (DESIGN §5, split inference;
standard 7.2 b 1, 7.3.1 c 5).

* :func:`candidate_cuts` — every intermediate tensor at which the graph splits cleanly, in topological order;
* :func:`split_model` — the head (model inputs → the tensor) and the tail (the tensor → model outputs), both
  valid ONNX (``onnx.checker.check_model(full_check=True)``);
* :func:`profile` — ONNX Runtime latencies of every cut's head and tail and the activation's size, and the
  whole model's as the reference.

A tensor ``t`` is a *clean cut* when it is computed by a node of the main graph from the graph's inputs (not a
graph input, an initializer, a constant or a graph output) and the tail — the nodes that compute the outputs,
walking back from the outputs and stopping at ``t`` — needs nothing computed from the inputs other than ``t``:
no graph input and no other tensor of the head (the nodes ``t`` is computed from). Only ``t`` crosses the link.
Initializers and nodes that depend on no input (``Constant``, shape arithmetic on weights) are copied into
whichever part uses them, both if both do. Nodes with subgraphs (``If``, ``Loop``, ``Scan``) count the outer
tensors their subgraphs read as inputs.

    aisynergy model cuts model.onnx
    aisynergy model split model.onnx relu_1 --head head.onnx --tail tail.onnx
    aisynergy model profile model.onnx --runs 50 --batch 8
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx
from onnx import helper

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class _Index:
    """The main graph's dataflow: who produces each tensor, what each node reads."""

    nodes: list[onnx.NodeProto]
    reads: list[list[str]]  # per node: its inputs and the outer tensors its subgraphs read
    producer: dict[str, int]  # tensor -> index of the node that computes it
    inputs: set[str]  # graph inputs that are not initializers
    initializers: set[str]
    outputs: list[str]
    dynamic: set[str]  # tensors computed (transitively) from a graph input


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` (a node attribute's subgraph) reads from its enclosing scopes."""
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {s.values.name for s in graph.sparse_initializer}
    outer: set[str] = set()
    for node in graph.node:
        for name in [*node.input, *_nested_reads(node)]:
            if name and name not in local:
                outer.add(name)
        local.update(o for o in node.output if o)
    return outer


def _nested_reads(node: onnx.NodeProto) -> set[str]:
    reads: set[str] = set()
    for attribute in node.attribute:
        for graph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
            reads |= _subgraph_reads(graph)
    return reads


def _index(model: onnx.ModelProto) -> _Index:
    graph = model.graph
    initializers = {i.name for i in graph.initializer} | {s.values.name for s in graph.sparse_initializer}
    inputs = {i.name for i in graph.input} - initializers
    nodes = list(graph.node)
    reads = [[name for name in node.input if name] + sorted(_nested_reads(node)) for node in nodes]
    producer: dict[str, int] = {}
    dynamic = set(inputs)
    for position, node in enumerate(nodes):
        computed = any(name in dynamic for name in reads[position])
        for name in node.output:
            if name:
                producer[name] = position
                if computed:
                    dynamic.add(name)
    return _Index(nodes, reads, producer, inputs, initializers, [o.name for o in graph.output], dynamic)


def _ancestors(index: _Index, targets: Iterable[str], stop: set[str] = frozenset()) -> set[int]:  # type: ignore[assignment]
    """The nodes needed to compute ``targets``, not walking past the tensors in ``stop``."""
    seen: set[int] = set()
    pending = [t for t in targets if t not in stop]
    while pending:
        position = index.producer.get(pending.pop())
        if position is None or position in seen:
            continue
        seen.add(position)
        pending.extend(name for name in index.reads[position] if name not in stop)
    return seen


@dataclass(frozen=True)
class _Cut:
    head: set[int]
    tail: set[int]
    crossing: list[str]  # tensors other than the cut the tail would need from the head or the inputs


def _cut(index: _Index, tensor: str) -> _Cut:
    """Where ``tensor`` cuts the graph; raises ``ValueError`` when it is not a tensor the graph computes."""
    if tensor in index.inputs:
        raise ValueError(f"{tensor!r} is a graph input, not an intermediate tensor")
    if tensor in index.initializers:
        raise ValueError(f"{tensor!r} is an initializer, not an intermediate tensor")
    if tensor in index.outputs:
        raise ValueError(f"{tensor!r} is a graph output, not an intermediate tensor")
    if tensor not in index.producer:
        raise ValueError(f"no node of the main graph computes {tensor!r}")
    if tensor not in index.dynamic:
        raise ValueError(f"{tensor!r} is a constant (it does not depend on the graph's inputs)")
    head = _ancestors(index, [tensor])
    head_tensors = {o for position in head for o in index.nodes[position].output if o} & index.dynamic
    stop = (head_tensors | index.inputs) | {tensor}
    tail = _ancestors(index, index.outputs, stop)
    needed = [*index.outputs, *(name for position in sorted(tail) for name in index.reads[position])]
    crossing = sorted({name for name in needed if name in stop and name != tensor})
    if tensor not in needed:
        raise ValueError(f"{tensor!r} does not lead to any graph output")
    return _Cut(head, tail, crossing)


def candidate_cuts(model: onnx.ModelProto) -> list[str]:
    """Every tensor at which ``model`` splits cleanly (see the module docstring), in topological order."""
    index = _index(model)
    cuts = []
    for node in index.nodes:
        for name in node.output:
            if not name or name in index.outputs or name not in index.dynamic:
                continue
            try:
                cut = _cut(index, name)
            except ValueError:
                continue
            if not cut.crossing:
                cuts.append(name)
    return cuts


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every tensor's type and shape, from ONNX shape inference (symbolic dimensions such as the batch kept)."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    graph = inferred.graph
    return {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}


def _part(
    model: onnx.ModelProto, index: _Index, nodes: set[int], inputs: Sequence[onnx.ValueInfoProto], outputs: Sequence[onnx.ValueInfoProto],
    infos: Mapping[str, onnx.ValueInfoProto], name: str, doc: str,
) -> onnx.ModelProto:  # fmt: skip
    graph = model.graph
    chosen = [index.nodes[position] for position in sorted(nodes)]
    read = {name for position in nodes for name in index.reads[position]}
    initializers = [i for i in graph.initializer if i.name in read]
    sparse = [s for s in graph.sparse_initializer if s.values.name in read]
    boundary = {v.name for v in [*inputs, *outputs]} | {i.name for i in initializers} | {s.values.name for s in sparse}
    computed = {o for node in chosen for o in node.output if o}
    value_info = [infos[t] for t in sorted(computed - boundary) if t in infos and infos[t].type.HasField("tensor_type")]
    part_graph = helper.make_graph(chosen, name, list(inputs), list(outputs), initializers, doc_string=doc, value_info=value_info, sparse_initializer=sparse)
    part = helper.make_model(part_graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    part.ir_version = model.ir_version
    part.producer_name, part.producer_version = model.producer_name, model.producer_version
    part.domain, part.model_version, part.doc_string = model.domain, model.model_version, doc
    for prop in model.metadata_props:
        part.metadata_props.add(key=prop.key, value=prop.value)
    onnx.checker.check_model(part, full_check=True)
    return part


def split_model(model: onnx.ModelProto, tensor: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """``(head, tail)``: the head takes the model's inputs and outputs ``tensor``; the tail takes ``tensor`` (typed
    and shaped by shape inference, dynamic dimensions kept) and outputs the model's outputs. Both pass
    ``onnx.checker.check_model(full_check=True)``. ``ValueError`` when ``tensor`` is not a clean cut, naming why
    (and the other tensors that would have to cross)."""
    index = _index(model)
    cut = _cut(index, tensor)
    if cut.crossing:
        shown = ", ".join(repr(t) for t in cut.crossing[:8]) + (f" and {len(cut.crossing) - 8} more" if len(cut.crossing) > 8 else "")
        raise ValueError(f"{tensor!r} is not a clean cut: the tail would also need {shown} from the device side")
    infos = _value_infos(model)
    info = infos.get(tensor)
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.elem_type:
        raise ValueError(f"shape inference gives no tensor type for {tensor!r}: cannot make it the parts' boundary")
    boundary = onnx.ValueInfoProto()
    boundary.CopyFrom(info)
    graph = model.graph
    name = graph.name or "model"
    head = _part(model, index, cut.head, [i for i in graph.input if i.name in index.inputs], [boundary], infos, f"{name}_head",
                 f"head of {name}: {', '.join(sorted(index.inputs))} -> {tensor}")  # fmt: skip
    tail = _part(model, index, cut.tail, [boundary], list(graph.output), infos, f"{name}_tail",
                 f"tail of {name}: {tensor} -> {', '.join(index.outputs)}")  # fmt: skip
    return head, tail


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[list[int | str | None], str]]:
    """``{tensor: (shape, numpy dtype name)}`` from shape inference (dimension: int, symbolic name or None)."""
    result = {}
    for name, info in _value_infos(model).items():
        if not info.type.HasField("tensor_type"):
            continue
        tensor_type = info.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim] if tensor_type.HasField("shape") else []
        result[name] = (shape, helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name if tensor_type.elem_type else "")
    return result


# ---- profiling ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CutProfile:
    """One row of :func:`profile`. ``tensor`` None is the whole model: ``head_ms`` is its latency (run on one
    side), ``tail_ms`` 0 and the activation is the model's inputs (what offloading the whole model sends)."""

    tensor: str | None
    head_ms: float  # median
    tail_ms: float  # median
    activation_bytes: int  # bytes of the activation for the batch profiled
    activation_shape: tuple[int, ...]
    activation_dtype: str
    batch: int

    @property
    def total_ms(self) -> float:
        return self.head_ms + self.tail_ms

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor, "head_ms": self.head_ms, "tail_ms": self.tail_ms, "activation_bytes": self.activation_bytes,
            "activation_shape": list(self.activation_shape), "activation_dtype": self.activation_dtype, "batch": self.batch,
        }  # fmt: skip


def sample_inputs(model: onnx.ModelProto, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``model``: the first dynamic dimension of each input is ``batch``, other dynamic ones 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    index = _index(model)
    for info in model.graph.input:
        if info.name not in index.inputs:
            continue
        tensor_type = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        shape = [d if d is not None else (batch if position == 0 else 1) for position, d in enumerate(dims)]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        feeds[info.name] = rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating) else np.zeros(shape, dtype=dtype)
    return feeds


def _session(model: onnx.ModelProto, threads: int | None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _median_ms(session: Any, feeds: Mapping[str, Any], runs: int) -> tuple[float, list[Any]]:
    outputs = session.run(None, dict(feeds))  # warm-up (allocations, kernel choice)
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, dict(feeds))
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples), outputs


def profile(
    model: onnx.ModelProto, cuts: Sequence[str] | None = None, runs: int = 20, batch: int = 1, *,
    feeds: Mapping[str, np.ndarray] | None = None, threads: int | None = None,
) -> list[CutProfile]:  # fmt: skip
    """Measure, with ONNX Runtime on this machine, the whole model and every cut in ``cuts`` (default: every
    candidate): the median latency of the head and of the tail over ``runs`` runs each (after one warm-up) and
    the activation's size, on ``feeds`` (default: :func:`sample_inputs` with ``batch``). The whole model comes
    first (``tensor`` None), then the cuts in the order given. ``threads``: intra-op threads (default ORT's)."""
    if runs < 1 or batch < 1:
        raise ValueError("runs and batch must be at least 1")
    feeds = dict(feeds) if feeds is not None else sample_inputs(model, batch)
    rows = int(next(iter(feeds.values())).shape[0]) if feeds and next(iter(feeds.values())).ndim else batch
    whole_ms, _ = _median_ms(_session(model, threads), feeds, runs)
    sent = list(feeds.values())
    first = sent[0] if sent else None
    result = [CutProfile(None, whole_ms, 0.0, int(sum(a.nbytes for a in sent)), tuple(first.shape) if first is not None else (), str(first.dtype) if first is not None else "", rows)]
    for tensor in candidate_cuts(model) if cuts is None else cuts:
        head, tail = split_model(model, tensor)
        head_ms, (activation,) = _median_ms(_session(head, threads), feeds, runs)
        tail_ms, _ = _median_ms(_session(tail, threads), {tensor: activation}, runs)
        result.append(CutProfile(tensor, head_ms, tail_ms, int(activation.nbytes), tuple(activation.shape), str(activation.dtype), rows))
    return result
