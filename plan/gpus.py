"""GPU datasheets: the one table every user of a GPU's peak reads (planner, bench, dry run).

Torch-free, so that tools which only need a number (``bench.dataloader``'s
need, ``bench.gpu_throughput``'s MFU, ``train.py --dry-run``) read it without
importing torch. Peaks are dense (no 2:4 sparsity) datasheet figures; the
roofline rescales torch's own cost model (``torch.utils._runtime_estimation``,
which looks devices up by ``datasheet``) to them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """A GPU kind: peak FLOP/s per dtype, HBM bandwidth and memory."""

    label: str
    datasheet: str  # the torch._inductor.analysis.device_info entry torch's cost model uses
    memory_gib: float  # total memory as the driver reports it
    tflops: dict[str, float]  # dense peak TFLOP/s by dtype name ("bfloat16", "float32")
    dram_gbs: float  # HBM bandwidth, GB/s

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Peak FLOP/s for a dtype name (a torch dtype's ``str`` without ``torch.`` works too)."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.tflops:
            raise KeyError(f"{self.label}: no datasheet peak for {name}; known: {', '.join(self.tflops)}")
        return self.tflops[name] * 1e12


GPUS = {
    # NVIDIA H100 SXM: 989 TFLOP/s bf16 dense (1979 with sparsity), 67 fp32, 3.35 TB/s.
    "h100": Gpu("H100 80GB", "NVIDIA H100", 81559 / 1024, {"bfloat16": 989.0, "float32": 67.0}, 3350.0),
    # H200: the H100's compute with 4.8 TB/s of HBM3e (torch's table has no H200).
    "h200": Gpu("H200 141GB", "NVIDIA H100", 143771 / 1024, {"bfloat16": 989.0, "float32": 67.0}, 4800.0),
    "a100": Gpu("A100 80GB", "NVIDIA A100", 81920 / 1024, {"bfloat16": 312.0, "float32": 19.5}, 2039.0),
    "mi300x": Gpu("MI300X 192GB", "AMD MI300X", 205822885888 / GIB, {"bfloat16": 1307.4, "float32": 163.4}, 5300.0),
}


def gpu_for_device(device_name: str) -> str | None:
    """The ``GPUS`` key of a device name as CUDA reports it (``"NVIDIA H100 80GB HBM3"``), or None."""
    name = device_name.lower().replace(" ", "")
    return next((k for k in ("h200", "h100", "a100", "mi300x") if k in name), None)
