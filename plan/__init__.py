"""Plan a run before it starts: its size, its data, its memory per GPU, its speed.

Every fact about a GPU run that a CPU can give comes from this package, so a
recipe is checked before a job waits in a queue for 24 nodes:

- ``gpus``: the GPU datasheets (torch-free; every user of a GPU's peak reads it);
- ``data``: planned vs available tokens per source, the realized mix (``--dry-run``);
- ``step``: the traced training step and the stand-ins for CUDA kernels;
- ``memory``: peak memory per GPU, FSDP2 on fake tensors;
- ``roofline``: the eager per-op roofline and its table;
- ``compiled``: the estimate from Inductor's fused kernels;
- ``replica``: what the replica check (health.consistency) costs a step;
- ``report``: the text and JSON of ``--dry-run`` and ``--plan``, and the sweep.

Names are imported from the submodules on first use, so ``plan.gpus``
stays importable without torch.
"""

import importlib

_EXPORTS = {
    "gpus": ("GIB", "GPUS", "Gpu", "gpu_for_device"),
    "data": ("data_report", "realized_mix"),
    "step": ("AC_MODES", "Shape", "_visible_pairs", "use_cuda_kernels"),
    "memory": ("FIT_FRACTION", "Memory", "memory_plan", "memory_plans"),
    "roofline": ("ROOFLINE_NOTE", "Speed", "_shard_dim", "_shard_numel", "ops_table", "roofline"),
    "report": ("MICRO_BATCHES", "Plan", "dry_run", "make_plan", "plan", "run_report", "sweep"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'plan' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
