"""GPU energy through NVML (``nvidia-ml-py``): joules consumed by this rank's GPU between readings.

NVML's total-energy counter (millijoules since the driver loaded; Volta and newer) is read at the
start and end of an interval. It measures the whole device, so another process on the same GPU is
counted too. On CPU, or without NVML, the meter is unavailable and says why.
"""

from __future__ import annotations

from typing import Optional

import torch


class EnergyMeter:
    """Energy of one CUDA device between successive :meth:`joules_since_last` calls."""

    def __init__(self, device: torch.device) -> None:
        self.reason: Optional[str] = None
        """Why energy is not measured (None when it is)."""
        self._handle = None
        self._last_mj: Optional[int] = None
        if device.type != "cuda":
            self.reason = f"energy needs an NVIDIA GPU (NVML); this rank runs on {device.type}"
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "energy needs nvidia-ml-py (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
            self._nvml = pynvml
            self._last_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception as error:  # noqa: BLE001 - any NVML failure means "not measured", with the reason
            self.reason = f"NVML energy counter unavailable: {error}"
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def joules_since_last(self) -> Optional[float]:
        """Joules used by the device since the previous call (or since construction)."""
        if not self.available:
            return None
        now = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        joules = (now - self._last_mj) / 1000.0
        self._last_mj = now
        return joules


def _physical_index(index: int) -> int:
    # NVML numbers devices physically; CUDA_VISIBLE_DEVICES renumbers them for torch.
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return index
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return int(entries[index]) if index < len(entries) and entries[index].isdigit() else index
