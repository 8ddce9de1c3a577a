"""Activation frames (device/tensors.py): safetensors bytes with their metadata, float32 exact, int8 within one
quantisation step; anything malformed is a ValueError, never executed."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load, save

from device.tensors import decode_activation, encode_activation, frame_metadata, quantize_int8


def test_float32_frames_round_trip_exactly() -> None:
    x = np.random.default_rng(0).standard_normal((3, 16, 4, 4)).astype(np.float32)
    frame, metadata = encode_activation(x, quantize=False)
    assert metadata == {"encoding": "float32", "dtype": "float32", "shape": "3,16,4,4"}
    assert frame_metadata(frame) == metadata
    assert load(frame)["activation"].dtype == np.float32  # a plain safetensors file any reader takes
    np.testing.assert_array_equal(decode_activation(frame), x)


@pytest.mark.parametrize(
    "x",
    [np.random.default_rng(1).standard_normal((2, 32)) * 5, np.abs(np.random.default_rng(2).standard_normal((4, 8))),  # after a ReLU
     -np.abs(np.random.default_rng(3).standard_normal(10)), np.zeros((2, 3)), np.float32(2.5), np.linspace(-1, 3, 1000).reshape(10, 100)],
)  # fmt: skip
def test_int8_frames_are_within_one_step_and_keep_zero(x: np.ndarray) -> None:
    x = np.asarray(x, dtype=np.float32)
    frame, metadata = encode_activation(x, quantize=True)
    scale, zero_point = float(metadata["scale"]), int(metadata["zero_point"])
    decoded = decode_activation(frame)
    assert metadata["encoding"] == "int8" and metadata["dtype"] == "float32" and -128 <= zero_point <= 127
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    assert np.abs(decoded - x).max() <= scale * 1.0001
    assert np.abs(decoded - x).mean() <= scale / 2
    assert (decoded[x == 0] == 0).all()
    if x.size > 100:
        assert len(frame) < x.nbytes / 3  # about a quarter: one byte an element and a small header


def test_int8_parameters_span_the_range() -> None:
    codes, scale, zero_point = quantize_int8(np.array([-1.0, 0.0, 3.0], np.float32))
    assert scale == pytest.approx(4 / 255) and codes.min() == -128 and codes.max() == 127
    assert codes[1] == zero_point


def test_non_finite_values_are_not_quantised() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode_activation(np.array([1.0, np.nan], np.float32), quantize=True)


def forged(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> bytes:
    return save(tensors, metadata=metadata)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"", "shorter than"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header of"),
        (struct.pack("<Q", 4) + b"nope", "not a safetensors frame"),
        (struct.pack("<Q", 2) + b"[]", "no activation metadata"),
        (forged({"activation": np.zeros(4, np.float32)}, None), "no activation metadata"),
        (forged({"activation": np.zeros(4, np.float32)}, {"encoding": "pickle", "shape": "4"}), "unknown activation encoding"),
        (forged({"activation": np.zeros(4, np.float32)}, {"encoding": "float32", "shape": "2,x"}), "bad activation shape"),
        (forged({"activation": np.zeros(4, np.float32)}, {"encoding": "float32", "shape": "5"}), "says shape"),
        (forged({"other": np.zeros(4, np.float32)}, {"encoding": "float32", "shape": "4"}), "one tensor 'activation'"),
        (forged({"activation": np.zeros(4, np.float64)}, {"encoding": "float32", "shape": "4"}), "holds float64"),
        (forged({"activation": np.zeros(4, np.int8)}, {"encoding": "int8", "shape": "4"}), "scale and zero_point"),
        (forged({"activation": np.zeros(4, np.int8)}, {"encoding": "int8", "shape": "4", "scale": "-1", "zero_point": "0"}), "bad int8 parameters"),
        (forged({"activation": np.zeros(4, np.float32)}, {"encoding": "int8", "shape": "4", "scale": "1", "zero_point": "0"}), "holds float32"),
    ],
)
def test_malformed_frames_are_refused(frame: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        decode_activation(frame)


def test_a_truncated_frame_is_refused() -> None:
    frame, _ = encode_activation(np.ones((4, 4), np.float32), quantize=False)
    header = json.loads(frame[8 : 8 + struct.unpack("<Q", frame[:8])[0]])
    assert header["__metadata__"]["shape"] == "4,4"
    with pytest.raises(ValueError, match="not a safetensors frame"):
        decode_activation(frame[:-5])
