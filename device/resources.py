"""Resource readings for heartbeats (standard 7.2 d 2): CPU, memory, disk, network, accelerators."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import shutil
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import psutil

from interfaces.resources import (
    Accelerator,
    AcceleratorType,
    CpuReading,
    DiskReading,
    MemoryReading,
    NetworkReading,
    Resources,
)

log = logging.getLogger("aisynergy.resources")

FRAMEWORKS = ("torch", "numpy", "jax", "tensorflow", "onnx", "onnxruntime", "scikit-learn", "safetensors", "paddlepaddle", "mindspore")
"""The training frameworks a site reports (as its installed distributions name them): an algorithm's manifest says
which it needs, and only a site that has them in the versions it asks runs it."""


@functools.cache
def installed_frameworks() -> dict[str, str]:
    """``{distribution: version}`` of the :data:`FRAMEWORKS` installed here (read once: installing one means restarting
    the agent). Read from the installed distributions' metadata; nothing is imported."""
    found = {}
    for name in FRAMEWORKS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


NVIDIA_SMI_QUERY = ["--query-gpu=name,memory.total,utilization.gpu", "--format=csv,noheader,nounits"]


def _number(text: str) -> float:
    """A non-negative reading; nvidia-smi writes ``[N/A]`` for what a board does not report."""
    try:
        return max(0.0, float(text))
    except ValueError:
        return 0.0


def parse_nvidia_smi(output: str) -> list[Accelerator]:
    """One :class:`Accelerator` per GPU model: count, memory per GPU and mean utilisation."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0]:
            continue
        name, memory_mib, utilisation = fields
        memory = int(_number(memory_mib) * 1024 * 1024)  # nvidia-smi reports MiB
        groups[(name[:128], memory)].append(min(1.0, _number(utilisation) / 100))
    return [
        Accelerator(
            type=AcceleratorType.GPU,
            model=name,
            count=len(utils),
            memory_bytes=memory,
            utilisation=sum(utils) / len(utils),
        )
        for (name, memory), utils in groups.items()
    ]


def nvidia_gpus(binary: str | None = None) -> list[Accelerator]:
    """NVIDIA GPUs as ``nvidia-smi`` sees them; empty when it is absent or fails."""
    binary = binary or shutil.which("nvidia-smi")
    if not binary:
        return []
    try:
        done = subprocess.run([binary, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return []
    return parse_nvidia_smi(done.stdout)


class ResourceSampler:
    """Cheap, repeatable readings; network rates and CPU utilisation are measured since the last call.

    ``nvidia-smi`` costs tens of milliseconds, so its answer is reused for ``accelerator_refresh_s``.
    """

    def __init__(self, disk_path: Path, accelerator_refresh_s: float = 30.0) -> None:
        self.disk_path = Path(disk_path).resolve()
        self.accelerator_refresh_s = accelerator_refresh_s
        self._smi = shutil.which("nvidia-smi")
        self._accelerators: list[Accelerator] = []
        self._accelerators_at = float("-inf")
        self._net_prev: tuple[float, int, int] | None = None
        psutil.cpu_percent(interval=None)  # the first call only sets the reference point

    def read(self) -> Resources:
        return Resources(
            cpu=self._cpu(),
            memory=self._memory(),
            disk=self._disk(),
            network=self._network(),
            accelerators=self._accelerators_cached(),
            frameworks=installed_frameworks(),
        )

    def _cpu(self) -> CpuReading:
        try:
            load_1m: float | None = os.getloadavg()[0]
        except (OSError, AttributeError):
            load_1m = None
        utilisation = min(1.0, max(0.0, psutil.cpu_percent(interval=None) / 100))
        return CpuReading(cores=psutil.cpu_count(logical=True) or 1, utilisation=utilisation, load_1m=load_1m)

    def _memory(self) -> MemoryReading:
        vm = psutil.virtual_memory()
        return MemoryReading(total_bytes=vm.total, available_bytes=vm.available)

    def _disk(self) -> DiskReading:
        usage = psutil.disk_usage(str(self.disk_path))
        return DiskReading(path=str(self.disk_path), total_bytes=usage.total, free_bytes=usage.free)

    def _network(self) -> NetworkReading:
        counters = psutil.net_io_counters()
        sent, received = (counters.bytes_sent, counters.bytes_recv) if counters else (0, 0)
        now = time.monotonic()
        send_rate = receive_rate = None
        if self._net_prev is not None:
            then, prev_sent, prev_received = self._net_prev
            elapsed = now - then
            if elapsed > 0 and sent >= prev_sent and received >= prev_received:  # counters may wrap or reset
                send_rate = (sent - prev_sent) * 8 / elapsed
                receive_rate = (received - prev_received) * 8 / elapsed
        self._net_prev = (now, sent, received)
        return NetworkReading(
            bytes_sent=sent, bytes_received=received, send_rate_bps=send_rate, receive_rate_bps=receive_rate
        )

    def _accelerators_cached(self) -> list[Accelerator]:
        if self._smi is None:
            return []
        now = time.monotonic()
        if now - self._accelerators_at >= self.accelerator_refresh_s:
            self._accelerators = nvidia_gpus(self._smi)
            self._accelerators_at = now
        return list(self._accelerators)
