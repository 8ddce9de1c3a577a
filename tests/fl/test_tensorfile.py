"""interfaces/tensorfile.py against the safetensors library, both ways, and on malformed files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from interfaces.tensorfile import TensorFile, TensorFileError, TensorInfo, TensorWriter, write_tensors

METADATA = {"format": "np", "round": "3"}


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "fc.bias": rng.standard_normal(10).astype(np.float16),
        "double": rng.standard_normal((2, 5)),
        "steps": rng.integers(-1000, 1000, size=(3, 2)).astype(np.int64),
        "ids": rng.integers(0, 2**31, size=7).astype(np.int32),
        "small": rng.integers(-100, 100, size=5).astype(np.int8),
        "pixels": rng.integers(0, 255, size=(2, 2)).astype(np.uint8),
        "half": rng.integers(-3000, 3000, size=3).astype(np.int16),
        "count": rng.integers(0, 2**32 - 1, size=4).astype(np.uint32),
        "mask": rng.integers(0, 2, size=6).astype(bool),
        "scale": np.array(0.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(actual) == set(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype and actual[name].shape == want.shape, name
        np.testing.assert_array_equal(actual[name], want, err_msg=name)


def write_raw(path: Path, header: Any, data: bytes, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


# ------------------------------------------------------------------------------------------------ compatibility


def test_files_written_one_tensor_at_a_time_load_with_safetensors(tmp_path: Path) -> None:
    tensors = sample()
    asked: list[str] = []

    def produce(name: str) -> np.ndarray:
        asked.append(name)
        return tensors[name]

    size = write_tensors(tmp_path / "m.safetensors", {k: TensorInfo.of(v) for k, v in tensors.items()}, produce,
                         metadata=METADATA)

    assert asked == list(tensors)
    assert size == (tmp_path / "m.safetensors").stat().st_size
    assert_same(load_file(tmp_path / "m.safetensors"), tensors)
    with safe_open(tmp_path / "m.safetensors", framework="np") as opened:
        assert opened.metadata() == METADATA
    (length,) = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])
    assert length % 8 == 0
    assert list(tmp_path.iterdir()) == [tmp_path / "m.safetensors"]  # no temporary left


def test_files_written_by_safetensors_read_identically(tmp_path: Path) -> None:
    tensors = sample()
    save_file(tensors, tmp_path / "m.safetensors", metadata=METADATA)

    with TensorFile(tmp_path / "m.safetensors") as file:
        read = {name: file.read(name) for name in file.names}
        infos = file.infos()
        assert file.metadata == METADATA
        assert file.nbytes == sum(v.nbytes for v in tensors.values())
        assert file.info("scale") == TensorInfo("float32", ())
        with pytest.raises(KeyError, match="'nope'"):
            file.read("nope")

    assert_same(read, tensors)
    assert infos == {name: TensorInfo.of(tensors[name]) for name in infos}
    assert all(array.flags.writeable and array.flags.owndata for array in read.values())


def test_a_round_trip_through_both_writers_keeps_the_layout_order_and_metadata(tmp_path: Path) -> None:
    tensors = sample()
    write_tensors(tmp_path / "a.safetensors", {k: TensorInfo.of(v) for k, v in tensors.items()}, tensors.__getitem__)

    with TensorFile(tmp_path / "a.safetensors") as file:
        assert file.names == list(tensors)
        assert file.metadata == {}


def test_the_writer_refuses_a_tensor_that_is_not_the_layouts(tmp_path: Path) -> None:
    infos = {"a": TensorInfo("float32", (2,)), "b": TensorInfo("int8", ())}
    target = tmp_path / "m.safetensors"

    with pytest.raises(TensorFileError, match="'a' is float64"):
        write_tensors(target, infos, lambda name: np.zeros(2))
    with pytest.raises(TensorFileError, match=r"\(3,\)"):
        write_tensors(target, infos, lambda name: np.zeros(3, np.float32))
    with pytest.raises(TensorFileError, match="expects tensor 'a'"), TensorWriter(target, infos) as writer:
        writer.write("b", np.zeros((), np.int8))
    with pytest.raises(TensorFileError, match="before tensor 'b'"), TensorWriter(target, infos) as writer:
        writer.write("a", np.zeros(2, np.float32))
        writer.close()

    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary


def test_tensor_infos_refuse_what_no_file_can_hold() -> None:
    with pytest.raises(TensorFileError, match="unsupported"):
        TensorInfo("complex64", (2,))
    with pytest.raises(TensorFileError, match="shape"):
        TensorInfo("float32", (2, -1))
    assert TensorInfo("float16", (2, 3)).nbytes == 12


# ------------------------------------------------------------------------------------------------------ malformed


def header(*tensors: tuple[str, str, list[Any], list[int]]) -> dict[str, Any]:
    return {name: {"dtype": dtype, "shape": shape, "data_offsets": offsets} for name, dtype, shape, offsets in tensors}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: p.write_bytes(b"\x10\x00"), "truncated"),
        (lambda p: write_raw(p, header(("a", "F32", [2], [0, 8])), b"\0" * 4), "truncated"),
        (lambda p: write_raw(p, header(("a", "F32", [2], [0, 8])), b"", length=1000), "truncated"),
        (lambda p: write_raw(p, {}, b"", length=200 * 1024 * 1024), "more than"),
        (lambda p: write_raw(p, header(("a", "F32", [2], [0, 8]), ("b", "F32", [1], [4, 8])), b"\0" * 8), "overlaps"),
        (lambda p: write_raw(p, header(("a", "F32", [1], [0, 4]), ("b", "F32", [1], [8, 12])), b"\0" * 12), "gap"),
        (lambda p: write_raw(p, header(("a", "F32", [1], [4, 8])), b"\0" * 8), "gap"),
        (lambda p: write_raw(p, header(("a", "F32", [1], [0, 4])), b"\0" * 8), "cover 4 data bytes, the file has 8"),
        (lambda p: write_raw(p, header(("a", "BF16", [2], [0, 4])), b"\0" * 4), "numpy has no such dtype"),
        (lambda p: write_raw(p, header(("a", "Q7", [2], [0, 4])), b"\0" * 4), "unknown dtype"),
        (lambda p: write_raw(p, header(("a", "F32", [2], [0, 4])), b"\0" * 4), "needs 8 bytes"),
        (lambda p: write_raw(p, header(("a", "F32", [-1], [0, 4])), b"\0" * 4), "shape"),
        (lambda p: write_raw(p, header(("a", "F32", [1.0], [0, 4])), b"\0" * 4), "shape"),
        (lambda p: write_raw(p, header(("", "F32", [1], [0, 4])), b"\0" * 4), "empty name"),
        (lambda p: write_raw(p, [1, 2], b""), "not an object"),
        (lambda p: write_raw(p, {"__metadata__": {"a": 1}}, b""), "__metadata__"),
        (lambda p: write_raw(p, {"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "data_offsets"),
        (lambda p: p.write_bytes(struct.pack("<Q", 3) + b"{x}"), "JSON"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, build, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    build(path)

    with pytest.raises(TensorFileError, match=message):
        TensorFile(path)


def test_duplicate_tensor_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "dup.safetensors"
    raw = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)

    with pytest.raises(TensorFileError, match="duplicate"):
        TensorFile(path)
