"""Resource readings a node reports in its heartbeat (standard 7.2 d 2, 7.2 c 4)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AcceleratorType(StrEnum):
    GPU = "gpu"
    NPU = "npu"
    TPU = "tpu"
    FPGA = "fpga"
    OTHER = "other"


class Accelerator(_Strict):
    type: AcceleratorType
    model: str = Field(max_length=128)
    count: int = Field(ge=0, le=1024)
    memory_bytes: int = Field(ge=0, description="memory per accelerator")
    utilisation: float = Field(ge=0, le=1, description="mean utilisation, 0..1")
    purpose: str | None = Field(default=None, max_length=32, description="training | inference | both")


class CpuReading(_Strict):
    cores: int = Field(ge=1, le=65536)
    utilisation: float = Field(ge=0, le=1)
    load_1m: float | None = Field(default=None, ge=0)


class MemoryReading(_Strict):
    total_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)


class DiskReading(_Strict):
    path: str = Field(max_length=1024)
    total_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)


class NetworkReading(_Strict):
    bytes_sent: int = Field(ge=0)
    bytes_received: int = Field(ge=0)
    send_rate_bps: float | None = Field(default=None, ge=0, description="bits per second since the previous reading")
    receive_rate_bps: float | None = Field(default=None, ge=0, description="bits per second since the previous reading")


class Resources(_Strict):
    cpu: CpuReading
    memory: MemoryReading
    disk: DiskReading
    network: NetworkReading
    accelerators: list[Accelerator] = Field(default_factory=list, max_length=64)
