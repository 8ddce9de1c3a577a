"""Resource readings validate into the wire model."""

from __future__ import annotations

import time
from pathlib import Path

from device.resources import ResourceSampler, parse_nvidia_smi
from interfaces.messages import HeartbeatBody, envelope
from interfaces.resources import AcceleratorType, Resources
from interfaces.topics import NODE_HEARTBEAT


def test_readings_validate_and_rates_appear_on_the_second_call(tmp_path: Path) -> None:
    sampler = ResourceSampler(tmp_path)

    first = sampler.read()
    time.sleep(0.05)
    second = sampler.read()

    for reading in (first, second):
        assert Resources.model_validate(reading.model_dump(mode="json")) == reading
        assert reading.cpu.cores >= 1 and 0 <= reading.cpu.utilisation <= 1
        assert 0 < reading.memory.available_bytes <= reading.memory.total_bytes
        assert reading.disk.path == str(tmp_path.resolve()) and reading.disk.free_bytes <= reading.disk.total_bytes
    assert first.network.send_rate_bps is None
    assert second.network.send_rate_bps is not None and second.network.receive_rate_bps is not None


def test_a_heartbeat_with_readings_matches_the_topic_payload(tmp_path: Path) -> None:
    body = HeartbeatBody(seq=0, agent_version="0.1.0", uptime_s=1.0, resources=ResourceSampler(tmp_path).read())

    message = envelope("nd-0001", body)

    assert isinstance(message, NODE_HEARTBEAT.payload)
    assert NODE_HEARTBEAT.payload.model_validate_json(message.model_dump_json()) == message


def test_reading_is_cheap(tmp_path: Path) -> None:
    sampler = ResourceSampler(tmp_path)

    started = time.perf_counter()
    for _ in range(20):
        sampler.read()

    assert (time.perf_counter() - started) / 20 < 0.05


def test_nvidia_smi_output_groups_gpus_by_model() -> None:
    output = "NVIDIA H200, 143771, 40\nNVIDIA H200, 143771, 60\nTesla T4, 15360, [N/A]\n\n"

    gpus = {gpu.model: gpu for gpu in parse_nvidia_smi(output)}

    assert set(gpus) == {"NVIDIA H200", "Tesla T4"}
    h200 = gpus["NVIDIA H200"]
    assert (h200.type, h200.count, h200.memory_bytes, h200.utilisation) == (
        AcceleratorType.GPU,
        2,
        143771 * 1024**2,
        0.5,
    )
    assert (gpus["Tesla T4"].count, gpus["Tesla T4"].utilisation) == (1, 0.0)


def test_a_site_reports_the_training_frameworks_it_has_with_their_installed_versions(tmp_path: Path) -> None:
    import importlib.metadata

    import numpy

    reading = ResourceSampler(tmp_path).read()

    assert reading.frameworks["numpy"] == importlib.metadata.version("numpy") == numpy.__version__
    assert set(reading.frameworks) <= {"torch", "numpy", "jax", "tensorflow", "onnx", "onnxruntime", "scikit-learn", "safetensors", "paddlepaddle", "mindspore"}
    assert reading.frameworks["onnx"] == importlib.metadata.version("onnx")  # what an algorithm exporting ONNX in numpy asks for
    assert "jax" not in reading.frameworks or reading.frameworks["jax"] == importlib.metadata.version("jax")
    assert Resources.model_validate(reading.model_dump(mode="json")).frameworks == reading.frameworks


def test_frameworks_are_read_strictly() -> None:
    import pytest
    from pydantic import ValidationError

    base = Resources.model_validate(ResourceSampler(Path(".")).read().model_dump(mode="json")).model_dump(mode="json")
    for bad in ({"torch": 2}, {"bad name!": "1.0"}, {"torch": ""}, {f"f{i}": "1" for i in range(65)}):
        with pytest.raises(ValidationError):
            Resources.model_validate({**base, "frameworks": bad})
