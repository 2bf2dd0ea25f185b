"""Limits of the machine: GPU memory and count, host RAM, nodes — detected, or given for a planned machine."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zerolab.memory.units import KIB, format_gib


@dataclass(frozen=True)
class Limits:
    """Memory of the machine a job runs on. ``None`` means unknown (that check is skipped)."""

    gpu_mem_bytes: int | None = None
    """Memory of each GPU (the smallest, if they differ)."""
    gpus_per_node: int | None = None
    host_mem_bytes: int | None = None
    """Host RAM of each node (the cgroup limit where one applies)."""
    num_nodes: int = 1
    source: str = "given"
    """Where the figures come from (shown in reports)."""

    @classmethod
    def detect(cls) -> Limits:
        """This machine: GPUs from torch.cuda (none without CUDA), RAM from /proc/meminfo or
        psutil, capped by a cgroup memory limit."""
        gpu_mem = gpus = None
        try:
            import torch

            if torch.cuda.is_available():
                gpus = torch.cuda.device_count()
                gpu_mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        except ImportError:
            pass
        return cls(gpu_mem_bytes=gpu_mem, gpus_per_node=gpus, host_mem_bytes=_host_memory_bytes(), source="detected on this machine")

    @classmethod
    def detect_with_nvml(cls) -> Limits:
        """This node, seen by NVML: every GPU whatever CUDA_VISIBLE_DEVICES says (Ray hides GPUs from
        tasks that reserve none); :meth:`detect` where NVML is missing."""
        try:
            import pynvml
        except ImportError:
            return cls.detect()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:  # no NVIDIA driver here: a machine without NVIDIA GPUs
            return cls.detect()
        try:
            gpus = pynvml.nvmlDeviceGetCount()
            mem = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(gpus)]
        finally:
            pynvml.nvmlShutdown()
        return cls(gpu_mem_bytes=min(mem) if mem else None, gpus_per_node=gpus or None, host_mem_bytes=_host_memory_bytes(),
                   source="detected on this node")

    def describe(self) -> str:
        gpu = f"{self.gpus_per_node} × {format_gib(self.gpu_mem_bytes)} GPU" if self.gpu_mem_bytes and self.gpus_per_node else (
            f"GPUs of {format_gib(self.gpu_mem_bytes)}" if self.gpu_mem_bytes else "no GPU known")
        host = f"{format_gib(self.host_mem_bytes)} host RAM" if self.host_mem_bytes else "host RAM unknown"
        nodes = f" per node, {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{gpu}, {host}{nodes} ({self.source})"


def _host_memory_bytes() -> int | None:
    total = None
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        meminfo = Path("/proc/meminfo")
        if meminfo.is_file():
            match = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())
            total = int(match.group(1)) * KIB if match else None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)(B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``24GiB``, ``80GB``, ``500MiB``, ``64G`` (a bare K/M/G/T is binary) or a plain
    byte count of at least 1 MiB (a smaller bare number, such as ``80``, is a unit left out).
    Raises ValueError with the accepted forms."""
    match = _SIZE.match(str(text))
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"{text!r} is not a size; write e.g. 24GiB, 80GB, 500MiB or 64G")
    number, prefix, binary, unit = match.groups()
    if not prefix and not unit and float(number) < 2**20:
        raise ValueError(f"{text!r} would be {number} bytes; give the unit, e.g. {number}GiB or {number}GB")
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if (unit and not binary) else 1024
    return int(float(number) * base**power)
