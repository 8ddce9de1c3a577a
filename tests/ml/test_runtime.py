"""One runtime interface over ONNX Runtime and LiteRT (device/runtime.py), and ModelHost on top of it, with the
committed digits models: an MLP and a CNN, each as ONNX and as TFLite converted from the same weights."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from device.ota.models import ModelHost, ModelLoadError
from device.runtime import OnnxRunner, RuntimeNotInstalled, TensorInfo, TfliteRunner, open_model
from interfaces.deployments import ArtifactFormat
from tests.ml.conftest import KINDS, model_path

INPUT_SHAPES = {"mlp": (64,), "cnn": (1, 8, 8)}


def tflite(kind: str) -> Path:
    path = model_path(kind, "tflite")
    if not path.exists():
        pytest.skip(f"no {path.name} fixture (see tests/fixtures/README.md)")
    pytest.importorskip("ai_edge_litert", reason="LiteRT is not installed")
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_is_read_from_both_files(kind: str) -> None:
    # Execute
    onnx_model = open_model(model_path(kind, "onnx"))
    tflite_model = open_model(tflite(kind))

    # Assert: same names and dtypes; the batch is dynamic in both (a name in ONNX, None from the TFLite shape signature)
    assert isinstance(onnx_model, OnnxRunner) and onnx_model.kind == "onnx"
    assert isinstance(tflite_model, TfliteRunner) and tflite_model.kind == "tflite"
    assert onnx_model.inputs == [TensorInfo("x", ("batch", *INPUT_SHAPES[kind]), "float32")]
    assert onnx_model.outputs == [TensorInfo("logits", ("batch", 10), "float32")]
    assert tflite_model.inputs == [TensorInfo("x", (None, *INPUT_SHAPES[kind]), "float32")]
    assert tflite_model.outputs == [TensorInfo("logits", (None, 10), "float32")]
    assert all(t.dynamic for t in onnx_model.inputs + tflite_model.inputs)
    assert not TensorInfo("x", (1, 64), "float32").dynamic


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_and_tflite_versions_agree_on_the_digits_test_split(kind: str, digits) -> None:  # type: ignore[no-untyped-def]
    # Prepare
    x = digits.inputs(kind)
    onnx_model, tflite_model = open_model(model_path(kind, "onnx"), threads=1), open_model(tflite(kind), threads=1)

    # Execute: the whole split at once, then batches of other sizes (the interpreter is resized each time)
    whole_onnx, whole_tflite = onnx_model.run({"x": x})["logits"], tflite_model.run({"x": x})["logits"]
    parts = [tflite_model.run({"x": x[i : i + n]})["logits"] for i, n in ((0, 1), (1, 7), (8, 32), (40, 1))]

    # Assert
    assert whole_onnx.shape == whole_tflite.shape == (len(x), 10)
    np.testing.assert_allclose(whole_tflite, whole_onnx, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(parts), whole_onnx[:41], rtol=0, atol=1e-4)
    accuracy = (whole_tflite.argmax(axis=1) == digits.y_test).mean()
    assert accuracy > 0.9


def test_tflite_outputs_are_fresh_arrays_and_concurrent_requests_are_serialised() -> None:
    # Prepare
    model = open_model(tflite("mlp"))
    rng = np.random.default_rng(1)
    batches = [rng.random((n, 64), dtype=np.float32) for n in (1, 3, 5, 2)]
    expected = [open_model(model_path("mlp", "onnx")).run({"x": b})["logits"] for b in batches]
    first = model.run({"x": batches[0]})["logits"]
    kept = first.copy()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(30):
                got = model.run({"x": batches[i]})["logits"]
                np.testing.assert_allclose(got, expected[i], atol=1e-4)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    # Execute
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Assert: every thread got its own batch's answer; an earlier result was not overwritten by later runs
    assert errors == []
    np.testing.assert_array_equal(first, kept)


def test_open_model_refuses_other_files_and_missing_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a model"):
        open_model(tmp_path / "weights.pt")
    model = open_model(tflite("mlp"))
    with pytest.raises(ValueError, match="missing 'x'"):
        model.run({"y": np.zeros((1, 64), np.float32)})
    # a shape the graph cannot take fails clearly, and the interpreter still serves the next request
    with pytest.raises(ValueError, match="cannot run inputs of shapes"):
        model.run({"x": np.zeros((2, 63), np.float32)})
    assert model.run({"x": np.zeros((2, 64), np.float32)})["logits"].shape == (2, 10)
    # the same for ONNX: every mistake is an error before or from ONNX Runtime
    onnx_model = open_model(model_path("mlp", "onnx"))
    with pytest.raises(ValueError, match=r"missing \['x'\]"):
        onnx_model.run({})
    for bad in ({"x": np.zeros((1, 64), np.float64)}, {"x": np.zeros((1, 63), np.float32)}, {"x": np.zeros((1, 64), np.float32), "y": np.zeros(1)}):
        with pytest.raises(Exception, match="INVALID_ARGUMENT"):
            onnx_model.run(bad)
    # kind= overrides the suffix
    copy = tmp_path / "model.bin"
    shutil.copyfile(model_path("mlp", "onnx"), copy)
    assert open_model(copy, kind="onnx").inputs[0].name == "x"


def test_runtime_module_imports_without_numpy_or_runtimes() -> None:
    # A board without LiteRT (or before any model) imports the module; only opening a model loads a runtime.
    import subprocess
    import sys

    code = (
        "import sys; import device.runtime, device.tensors; "
        "assert not {'numpy', 'onnxruntime', 'ai_edge_litert', 'tflite_runtime', 'safetensors'} & set(sys.modules), sorted(sys.modules); "
        "import device.ota.models; "
        "assert not {'onnxruntime', 'ai_edge_litert', 'tflite_runtime'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_missing_tflite_runtime_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_litert(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name.startswith(("ai_edge_litert", "tflite_runtime")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_litert)
    with pytest.raises(RuntimeNotInstalled, match="tflite runtime not installed"):
        open_model(model_path("mlp", "tflite"))
    # ModelHost turns it into the load error an OTA execution reports (the old model serves on)
    host = ModelHost(tmp_path / "models")
    with pytest.raises(ModelLoadError, match=r"^tflite runtime not installed \(pip install 'aisynergy\[tflite\]'\)$"):
        host.load("m", "1.0.0", "sha", ArtifactFormat.TFLITE, model_path("mlp", "tflite"))


@pytest.mark.parametrize("kind", KINDS)
def test_model_host_serves_tflite_as_well_as_onnx(tmp_path: Path, kind: str, digits) -> None:  # type: ignore[no-untyped-def]
    # Prepare: the ONNX version under one name, the TFLite version under another
    host = ModelHost(tmp_path / "models", threads=1)
    served = {}
    for fmt, suffix in ((ArtifactFormat.ONNX, "onnx"), (ArtifactFormat.TFLITE, "tflite")):
        source = tmp_path / f"upload.{suffix}"
        shutil.copyfile(model_path(kind, suffix) if suffix == "onnx" else tflite(kind), source)
        served[suffix] = host.install(f"digits-{suffix}", "1.0.0", f"{suffix}sha", fmt, source)
    seen: list[tuple[str, int, bool]] = []
    host.add_listener(lambda name, seconds, rows, ok: seen.append((name, rows, ok)))
    x = digits.inputs(kind)[:25]

    # Execute: arrays and nested lists alike (as the infer command sends them)
    from_onnx = host.infer({"x": x}, "digits-onnx")
    from_tflite = host.infer({"x": x.tolist()}, "digits-tflite")

    # Assert
    assert served["tflite"].format is ArtifactFormat.TFLITE and served["tflite"].path.suffix == ".tflite"
    described = {m["name"]: m for m in host.models()}
    assert described["digits-tflite"]["inputs"] == [{"name": "x", "shape": [None, *INPUT_SHAPES[kind]], "dtype": "float32"}]
    assert described["digits-onnx"]["inputs"] == [{"name": "x", "shape": ["batch", *INPUT_SHAPES[kind]], "dtype": "float32"}]
    assert (from_tflite.name, from_tflite.version) == ("digits-tflite", "1.0.0")
    np.testing.assert_allclose(from_tflite.outputs["logits"], from_onnx.outputs["logits"], rtol=0, atol=1e-4)
    assert seen == [("digits-onnx", 25, True), ("digits-tflite", 25, True)]
    with pytest.raises(ValueError, match="missing"):
        host.infer({}, "digits-tflite")


def test_model_host_reports_an_unloadable_tflite_file(tmp_path: Path) -> None:
    tflite("mlp")
    host = ModelHost(tmp_path / "models")
    source = tmp_path / "broken.tflite"
    source.write_bytes(b"TFL3" + b"\0" * 60)
    with pytest.raises(ModelLoadError, match="does not load or run"):
        host.install("broken", "1.0.0", "sha", ArtifactFormat.TFLITE, source)


def test_tflite_general_path_matches_the_single_input_fast_path() -> None:
    # the path a model with several inputs or outputs takes, forced on the one-input MLP
    fast, general = open_model(tflite("mlp")), open_model(tflite("mlp"))
    general._one = None  # type: ignore[attr-defined]
    rng = np.random.default_rng(3)
    for n in (1, 9, 9, 2):
        x = rng.random((n, 64), dtype=np.float32)
        np.testing.assert_array_equal(general.run({"x": x})["logits"], fast.run({"x": x})["logits"])
    with pytest.raises(ValueError, match="missing 'x'"):
        general.run({})
    with pytest.raises(ValueError, match="cannot run inputs of shapes"):
        general.run({"x": np.zeros((2, 63), np.float32)})
    assert general.run({"x": np.zeros((3, 64), np.float32)})["logits"].shape == (3, 10)
