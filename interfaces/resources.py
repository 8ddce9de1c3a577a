"""Resource readings a node reports in its heartbeat (standard 7.2 d 2, 7.2 c 4)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from interfaces.strict import BY_VALUE, INT64_MAX, WireModel


class _Strict(WireModel):
    model_config = ConfigDict(extra="forbid")


class AcceleratorType(StrEnum):
    GPU = "gpu"
    NPU = "npu"
    TPU = "tpu"
    FPGA = "fpga"
    OTHER = "other"


class Accelerator(_Strict):
    type: Annotated[AcceleratorType, BY_VALUE]
    model: str = Field(max_length=128)
    count: int = Field(ge=0, le=1024)
    memory_bytes: int = Field(ge=0, le=INT64_MAX, description="memory per accelerator")
    utilisation: float = Field(ge=0, le=1, description="mean utilisation, 0..1")
    purpose: str | None = Field(default=None, max_length=32, description="training | inference | both")


class CpuReading(_Strict):
    cores: int = Field(ge=1, le=65536)
    utilisation: float = Field(ge=0, le=1)
    load_1m: float | None = Field(default=None, ge=0)


class MemoryReading(_Strict):
    total_bytes: int = Field(ge=0, le=INT64_MAX)
    available_bytes: int = Field(ge=0, le=INT64_MAX)


class DiskReading(_Strict):
    path: str = Field(max_length=1024)
    total_bytes: int = Field(ge=0, le=INT64_MAX)
    free_bytes: int = Field(ge=0, le=INT64_MAX)


class NetworkReading(_Strict):
    bytes_sent: int = Field(ge=0, le=INT64_MAX)
    bytes_received: int = Field(ge=0, le=INT64_MAX)
    send_rate_bps: float | None = Field(default=None, ge=0, description="bits per second since the previous reading")
    receive_rate_bps: float | None = Field(default=None, ge=0, description="bits per second since the previous reading")


class Resources(_Strict):
    cpu: CpuReading
    memory: MemoryReading
    disk: DiskReading
    network: NetworkReading
    accelerators: list[Accelerator] = Field(default_factory=list, max_length=64)
    frameworks: dict[
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")],
        Annotated[str, Field(min_length=1, max_length=64)],
    ] = Field(default_factory=dict, max_length=64, description="the training frameworks a site runs algorithms with: distribution name -> version (torch: 2.13.0)")
