"""Cloud-side training (cloud/ml/train.py): torch on scikit-learn's shipped digits, exported to one ONNX file that
ONNX Runtime runs at any batch with over 90 % accuracy on the test split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

import onnx  # noqa: E402
import torch  # noqa: E402

from cloud.ml.train import OPSET, export_onnx, load_weights, onnx_accuracy, save_weights, train  # noqa: E402
from device.runtime import open_model  # noqa: E402


@pytest.mark.parametrize(("kind", "epochs"), [("mlp", 15), ("cnn", 10)])
def test_train_exports_an_onnx_model_above_90_percent(tmp_path: Path, digits, kind: str, epochs: int) -> None:  # type: ignore[no-untyped-def]
    # Execute: a short training run (a few seconds), then the export
    trained = train(kind, digits, epochs=epochs)
    path = export_onnx(trained.module, kind, tmp_path / f"{kind}.onnx")

    # Assert: one valid file, opset >= 17, dynamic batch; ONNX Runtime's accuracy matches torch's and is > 90 %
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [OPSET] and OPSET >= 17
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    accuracy = onnx_accuracy(path, digits)
    assert accuracy > 0.9
    assert accuracy == pytest.approx(trained.accuracy, abs=1 / len(digits.y_test))
    runner = open_model(path)
    assert runner.run({"x": digits.inputs(kind)[:3]})["logits"].shape == (3, 10)

    # the saved weights give back the same model (what the TFLite conversion reads)
    weights = save_weights(trained.module, tmp_path / f"{kind}.safetensors")
    with torch.no_grad():
        again = load_weights(kind, weights)(torch.from_numpy(digits.inputs(kind)[:16])).numpy()
    np.testing.assert_allclose(again, runner.run({"x": digits.inputs(kind)[:16]})["logits"], atol=1e-5)


def test_training_is_reproducible(digits) -> None:  # type: ignore[no-untyped-def]
    first, second = train("mlp", digits, epochs=2), train("mlp", digits, epochs=2)
    for (name, a), (_, b) in zip(first.module.state_dict().items(), second.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model kind"):
        train("transformer")
