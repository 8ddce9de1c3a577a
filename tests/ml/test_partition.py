"""Partitioning (cloud/ml/partition.py) on the committed digits MLP and CNN: every candidate cut's head and tail
are valid ONNX and together compute the whole model; int8 activation frames (device/tensors.py) keep the
predictions; profiles are sane. Also hand-built graphs for what is not a clean cut."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from cloud.ml.partition import candidate_cuts, profile, split_model, tensor_types
from device.tensors import decode_activation, encode_activation
from tests.ml.conftest import KINDS, model_path

EXPECTED_CUTS = {
    "mlp": ["linear", "relu", "linear_1", "relu_1"],
    "cnn": ["conv2d", "relu", "conv2d_1", "relu_1", "max_pool2d", "conv2d_2", "relu_2", "mean"],
}


def load(kind: str) -> onnx.ModelProto:
    return onnx.load(str(model_path(kind, "onnx")))


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def parts() -> dict[str, list[tuple[str, onnx.ModelProto, onnx.ModelProto]]]:
    """Every candidate cut of both models, split once."""
    return {kind: [(t, *split_model(load(kind), t)) for t in candidate_cuts(load(kind))] for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_candidate_cuts_are_every_intermediate_tensor_in_order(kind: str) -> None:
    assert candidate_cuts(load(kind)) == EXPECTED_CUTS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_head_then_tail_equals_the_whole_model_at_every_cut(kind: str, parts, digits) -> None:  # type: ignore[no-untyped-def]
    # Prepare: a test batch of 64 real images
    x = digits.inputs(kind)[:64]
    whole = session(load(kind)).run(None, {"x": x})[0]
    assert len(parts[kind]) == len(EXPECTED_CUTS[kind])

    for tensor, head, tail in parts[kind]:
        # Assert: both parts are valid ONNX; the boundary keeps the dynamic batch; head∘tail == whole (fp32)
        onnx.checker.check_model(head, full_check=True)
        onnx.checker.check_model(tail, full_check=True)
        assert [i.name for i in head.graph.input] == ["x"] and [o.name for o in head.graph.output] == [tensor]
        assert [i.name for i in tail.graph.input] == [tensor] and [o.name for o in tail.graph.output] == ["logits"]
        assert tail.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
        assert len(head.graph.node) + len(tail.graph.node) == len(load(kind).graph.node)
        (activation,) = session(head).run(None, {"x": x})
        (out,) = session(tail).run(None, {tensor: activation})
        np.testing.assert_allclose(out, whole, rtol=0, atol=1e-5, err_msg=f"{kind} cut at {tensor}")


@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_keep_top1_agreement_at_every_cut(kind: str, parts, digits) -> None:  # type: ignore[no-untyped-def]
    # Prepare: the whole digits test split, one frame per batch of 32 (as a device would send it)
    x = digits.inputs(kind)
    whole = session(load(kind)).run(None, {"x": x})[0].argmax(axis=1)

    for tensor, head, tail in parts[kind]:
        head_session, tail_session = session(head), session(tail)
        predicted, sizes = [], []
        for start in range(0, len(x), 32):
            (activation,) = head_session.run(None, {"x": x[start : start + 32]})
            frame, metadata = encode_activation(activation, quantize=True)
            sizes.append((len(frame), activation.nbytes))
            decoded = decode_activation(frame)
            assert decoded.dtype == np.float32 and decoded.shape == activation.shape
            assert np.abs(decoded - activation).max() <= float(metadata["scale"]) * 1.0001
            predicted.append(tail_session.run(None, {tensor: decoded})[0].argmax(axis=1))
        agreement = (np.concatenate(predicted) == whole).mean()
        assert agreement >= 0.99, f"{kind} cut at {tensor}: {agreement:.4f}"
        frame_bytes, raw_bytes = map(sum, zip(*sizes, strict=True))
        assert frame_bytes < raw_bytes / 2 or raw_bytes < 4096  # int8 data + a small header


def residual() -> onnx.ModelProto:
    """x -> a = Relu(x W) -> b = Relu(a V) -> c = a + b -> y = c U: 'b' is not a clean cut (the tail needs 'a')."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in (("W", (4, 6)), ("V", (6, 6)), ("U", (6, 3)))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a0"]), helper.make_node("Relu", ["a0"], ["a"]),
        helper.make_node("MatMul", ["a", "V"], ["b0"]), helper.make_node("Relu", ["b0"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("MatMul", ["c", "U"], ["y"]),
        helper.make_node("Constant", [], ["unused"], value=numpy_helper.from_array(np.ones(3, np.float32))),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], weights
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_residual_block_is_cut_only_outside_it() -> None:
    model = residual()
    assert candidate_cuts(model) == ["a0", "a", "c"]
    with pytest.raises(ValueError, match=r"'b' is not a clean cut: the tail would also need 'a'"):
        split_model(model, "b")
    head, tail = split_model(model, "c")
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    (c,) = session(head).run(None, {"x": x})
    np.testing.assert_allclose(session(tail).run(None, {"c": c})[0], session(model).run(None, {"x": x})[0], atol=1e-5)


@pytest.mark.parametrize(
    ("tensor", "problem"),
    [("nonexistent", "no node of the main graph computes"), ("x", "graph input"), ("W", "initializer"), ("y", "graph output"),
     ("unused", "constant"), ("b0", "not a clean cut")],
)  # fmt: skip
def test_a_tensor_that_is_not_a_clean_cut_is_refused_naming_the_problem(tensor: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        split_model(residual(), tensor)
    with pytest.raises(ValueError, match="no node of the main graph computes 'nope'"):
        split_model(load("cnn"), "nope")


@pytest.mark.parametrize("kind", KINDS)
def test_profile_returns_sane_numbers_for_every_cut(kind: str) -> None:
    # Execute
    rows = profile(load(kind), runs=5, batch=3)

    # Assert: the whole model first, then every cut in order; positive latencies; 4 bytes per float32 element
    types = tensor_types(load(kind))
    assert [r.tensor for r in rows] == [None, *EXPECTED_CUTS[kind]]
    whole = rows[0]
    assert whole.head_ms > 0 and whole.tail_ms == 0 and whole.activation_shape[0] == 3
    assert whole.activation_bytes == math.prod(whole.activation_shape) * 4
    for row in rows[1:]:
        assert row.head_ms > 0 and row.tail_ms > 0 and row.batch == 3 and row.activation_dtype == "float32"
        assert row.activation_bytes == math.prod(row.activation_shape) * 4
        assert list(row.activation_shape[1:]) == types[row.tensor][0][1:] and types[row.tensor][0][0] == "batch"
        assert row.total_ms == row.head_ms + row.tail_ms and row.as_dict()["tensor"] == row.tensor
    only = profile(load(kind), cuts=[EXPECTED_CUTS[kind][-1]], runs=2)
    assert [r.tensor for r in only] == [None, EXPECTED_CUTS[kind][-1]] and only[1].activation_shape[0] == 1


def test_model_command_lists_splits_and_profiles(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cloud.cli.model import model as command

    source = str(model_path("cnn", "onnx"))
    runner = CliRunner()

    listed = runner.invoke(command, ["cuts", source])
    assert listed.exit_code == 0, listed.output
    assert [line.split()[0] for line in listed.output.splitlines()[1:]] == EXPECTED_CUTS["cnn"]
    as_json = runner.invoke(command, ["cuts", source, "--json"])
    import json

    assert [c["tensor"] for c in json.loads(as_json.output)] == EXPECTED_CUTS["cnn"]

    split = runner.invoke(command, ["split", source, "max_pool2d", "--head", str(tmp_path / "h.onnx"), "--tail", str(tmp_path / "t.onnx")])
    assert split.exit_code == 0, split.output
    onnx.checker.check_model(onnx.load(str(tmp_path / "h.onnx")), full_check=True)
    assert [i.name for i in onnx.load(str(tmp_path / "t.onnx")).graph.input] == ["max_pool2d"]
    bad = runner.invoke(command, ["split", source, "nope"])
    assert bad.exit_code != 0 and "no node of the main graph computes 'nope'" in bad.output

    profiled = runner.invoke(command, ["profile", source, "--runs", "2", "--json"])
    assert profiled.exit_code == 0, profiled.output
    assert [r["tensor"] for r in json.loads(profiled.output)] == [None, *EXPECTED_CUTS["cnn"]]
    table = runner.invoke(command, ["profile", source, "--runs", "2", "--cut", "mean", "--batch", "4"])
    assert table.exit_code == 0 and "mean" in table.output and "(whole model)" in table.output
