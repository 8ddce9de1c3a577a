"""Accelerator allocation (standard 7.2 c 4, 7.3.2 b): what a target has free for a request, given what
its active workers reserved."""

from __future__ import annotations

from cloud.placement import free_accelerators
from interfaces.resources import Accelerator, CpuReading, DiskReading, MemoryReading, NetworkReading, Resources
from interfaces.tasks import AcceleratorRequest


def _target(*cards: Accelerator) -> Resources:
    return Resources(cpu=CpuReading(cores=4, utilisation=0), memory=MemoryReading(total_bytes=1, available_bytes=1),
                     disk=DiskReading(path="/", total_bytes=1, free_bytes=1), network=NetworkReading(bytes_sent=0, bytes_received=0),
                     accelerators=list(cards))  # fmt: skip


def _card(purpose: str | None, count: int = 1, memory: int = 8 << 30) -> Accelerator:
    return Accelerator(type="gpu", model="g", count=count, memory_bytes=memory, utilisation=0, purpose=purpose)  # type: ignore[arg-type]


def test_a_training_reservation_leaves_the_inference_card_free() -> None:
    target = _target(_card("training"), _card("inference"))
    training = {"type": "gpu", "count": 1, "purpose": "training"}

    assert free_accelerators(target, [training], AcceleratorRequest(type="gpu", purpose="inference")) == 1  # type: ignore[arg-type]
    assert free_accelerators(target, [training], AcceleratorRequest(type="gpu", purpose="training")) == 0  # type: ignore[arg-type]
    assert free_accelerators(target, [training], AcceleratorRequest(type="gpu")) == 1  # type: ignore[arg-type]


def test_reservations_use_the_card_of_their_purpose_before_a_card_for_both() -> None:
    target = _target(_card("inference"), _card("both"))
    inference = {"type": "gpu", "count": 1, "purpose": "inference"}

    assert free_accelerators(target, [inference], AcceleratorRequest(type="gpu", purpose="training")) == 1  # type: ignore[arg-type]
    assert free_accelerators(target, [inference, inference], AcceleratorRequest(type="gpu", purpose="training")) == 0  # type: ignore[arg-type]


def test_memory_and_type_still_decide_and_unreadable_reservations_are_ignored() -> None:
    target = _target(_card(None, count=2, memory=4 << 30), Accelerator(type="npu", model="n", count=1, memory_bytes=0, utilisation=0))  # type: ignore[arg-type]

    assert free_accelerators(target, [], AcceleratorRequest(type="gpu", min_memory_bytes=8 << 30)) == 0  # type: ignore[arg-type]
    assert free_accelerators(target, [{"type": "gpu", "count": 1}, {"bogus": True}], AcceleratorRequest(type="gpu")) == 1  # type: ignore[arg-type]
    assert free_accelerators(target, [{"type": "gpu", "count": 2}], AcceleratorRequest(type="npu")) == 1  # type: ignore[arg-type]
    assert free_accelerators(None, [], AcceleratorRequest(type="gpu")) == 0  # type: ignore[arg-type]
