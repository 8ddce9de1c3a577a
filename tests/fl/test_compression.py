"""Compressed whole-model updates (``interfaces.compression``): each scheme decodes to the participant's model within
its documented error, error feedback carries what was dropped into the next round, the hub's checks refuse a
malformed update, and a decoded update aggregates tensor by tensor like the plain one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from interfaces import compression
from interfaces.aggregation import FedAvg, StreamUpdate
from interfaces.tensorfile import TensorFile, TensorInfo


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"conv.weight": rng.normal(size=(8, 1, 3, 3)).astype(np.float32), "fc.weight": rng.normal(size=(10, 64)).astype(np.float32),
            "fc.bias": rng.normal(size=(10,)).astype(np.float32)}  # fmt: skip


def _decoded(kind: str, encoded: dict[str, np.ndarray], global_: dict[str, np.ndarray], tmp_path: Path, fraction: float = 0.1) -> dict[str, np.ndarray]:
    save_file(encoded, str(tmp_path / f"{kind}.safetensors"))
    save_file(global_, str(tmp_path / "global.safetensors"))
    with TensorFile(tmp_path / f"{kind}.safetensors") as update, TensorFile(tmp_path / "global.safetensors") as base:
        infos = {n: TensorInfo(str(a.dtype), a.shape) for n, a in global_.items()}
        assert compression.misfit(kind, update, infos, fraction) is None
        source = compression.Decoded(kind, update, base)
        return {name: source.read(name) for name in source.names}


@pytest.mark.parametrize("kind", ["none", "fp16", "int8", "topk"])
def test_each_scheme_decodes_to_the_trained_model_within_its_error(kind: str, tmp_path: Path) -> None:
    # Prepare: a global model and the model a participant trained from it
    rng = np.random.default_rng(0)
    global_ = _model(rng)
    local = {n: a + rng.normal(scale=0.05, size=a.shape).astype(np.float32) for n, a in global_.items()}

    # Execute
    encoded, feedback = compression.encode(kind, local, global_, None, fraction=0.25)
    back = _decoded(kind, encoded, global_, tmp_path, fraction=0.25)

    # Assert: the documented error of each, and what it left out is the error feedback
    for name, w in local.items():
        delta = w.astype(np.float64) - global_[name]
        err = np.abs(back[name] - w)
        if kind == "none":
            assert np.array_equal(back[name], w)
        elif kind == "fp16":
            assert err.max() <= np.abs(w).max() * 2**-10
        elif kind == "int8":
            scale = np.abs(delta).max() / 127
            assert err.max() <= scale / 2 + 1e-6
        else:
            k = compression.kept(delta.size, 0.25)
            moved = np.flatnonzero(np.abs(back[name] - global_[name]).ravel() > 0)
            assert len(moved) == k
            assert np.abs(delta).ravel()[moved].min() >= np.sort(np.abs(delta).ravel())[-k] - 1e-12  # the k largest
        if kind in ("int8", "topk"):
            assert np.allclose(back[name] + feedback[name], w, atol=1e-5)  # decoded + feedback = trained
        else:
            assert feedback == {}
    bytes_of = lambda tensors: sum(a.nbytes for a in tensors.values())  # noqa: E731
    assert bytes_of(encoded) < bytes_of(local) or kind == "none"


@pytest.mark.parametrize("kind", ["int8", "topk"])
def test_error_feedback_delivers_what_compression_dropped_in_later_rounds(kind: str) -> None:
    # Prepare: the same small delta every round (what top-k alone would drop for ever on most coordinates)
    rng = np.random.default_rng(1)
    global_ = {"w": np.zeros(1000, np.float32)}
    step = rng.normal(scale=1e-3, size=1000).astype(np.float32)
    residual = None
    sent = np.zeros(1000)

    # Execute: 50 rounds, each adding what was decoded
    for _ in range(50):
        encoded, residual = compression.encode(kind, {"w": global_["w"] + step}, global_, residual, fraction=0.05)
        if kind == "int8":
            decoded = encoded["w"].astype(np.float64) * float(encoded["w#scale"])
        else:
            decoded = np.zeros(1000)
            decoded[encoded["w#indices"]] = encoded["w#values"]
        sent += decoded

    # Assert: all but the last residual arrived
    assert np.allclose(sent + residual["w"], 50 * step.astype(np.float64), atol=1e-4)
    assert np.abs(residual["w"]).max() < 50 * np.abs(step).max() / 2


def test_malformed_updates_are_named_and_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    global_ = _model(rng)
    infos = {n: TensorInfo(str(a.dtype), a.shape) for n, a in global_.items()}
    encoded, _ = compression.encode("topk", global_, global_, None, fraction=0.5)
    cases = {
        "missing": ({k: v for k, v in encoded.items() if k != "fc.bias#values"}, "missing ['fc.bias#values']"),
        "out of range": ({**encoded, "fc.bias#indices": np.array([0, 1, 2, 3, 99], np.int64)}, "out of [0, 10)"),
        "repeated": ({**encoded, "fc.bias#indices": np.array([0, 1, 1, 3, 4], np.int64)}, "strictly ascending"),
        "nan": ({**encoded, "fc.bias#values": np.array([0, np.nan, 0, 0, 0], np.float32)}, "NaN"),
        "dtype": ({**encoded, "fc.bias#values": np.zeros(5, np.float64)}, "float64"),
    }
    for label, (tensors, text) in cases.items():
        save_file(tensors, str(tmp_path / "bad.safetensors"))
        with TensorFile(tmp_path / "bad.safetensors") as update:
            why = compression.misfit("topk", update, infos, 0.5)
        assert why is not None and text in why, (label, why)
    with pytest.raises(ValueError, match="unknown compression"):
        compression.encode("zip", global_, global_)


def test_decoded_updates_aggregate_tensor_by_tensor_as_numpy_does(tmp_path: Path) -> None:
    # Prepare: three int8 updates of one global model, as files
    rng = np.random.default_rng(3)
    global_ = _model(rng)
    save_file(global_, str(tmp_path / "global.safetensors"))
    decoded, weights = [], [100, 250, 40]
    for k in range(3):
        local = {n: a + rng.normal(scale=0.1, size=a.shape).astype(np.float32) for n, a in global_.items()}
        encoded, _ = compression.encode("int8", local, global_)
        save_file(encoded, str(tmp_path / f"u{k}.safetensors"))
        decoded.append({n: global_[n].astype(np.float64) + encoded[n].astype(np.float64) * float(encoded[n + "#scale"]) for n in global_})

    # Execute
    out: dict[str, np.ndarray] = {}
    with TensorFile(tmp_path / "global.safetensors") as base:
        files = [TensorFile(tmp_path / f"u{k}.safetensors") for k in range(3)]
        FedAvg().aggregate_stream(base, [StreamUpdate(compression.Decoded("int8", f, base), n) for f, n in zip(files, weights)], out.__setitem__)
        for f in files:
            f.close()

    # Assert
    for name in global_:
        expected = sum(n * d[name] for n, d in zip(weights, decoded)) / sum(weights)
        assert out[name].dtype == np.float32 and np.abs(out[name] - expected).max() <= 1e-6
