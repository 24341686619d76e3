"""The CPU-only adjustments torchtitan 0.3.0's Trainer needs, in one place.

torchtitan assumes an accelerator ("cuda" when none is found), gloo lacks the
PREMUL_SUM reduction FSDP uses, and bf16 GEMMs are ~20x slower on CPU. Tests
and CI run on CPU-only machines, so:

    from train.cpu import use_cpu_if_no_gpu, adapt_config
    use_cpu_if_no_gpu()            # first thing in an entry point
    config = adapt_config(config)  # on the Trainer.Config, before building

Both are no-ops when a CUDA GPU is present, so the same entry points and
configs run unchanged on a cluster. The attention kernel is not chosen here:
``model_registry`` picks it (``models.laneformer.attention``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

__all__ = [
    "CPU_COMM_TIMEOUT_SECONDS",
    "adapt_config",
    "force_sum_reduction",
    "has_gpu",
    "use_cpu_if_no_gpu",
]

# Compile and gloo collectives on 2 slow cores can exceed torchtitan's 100 s.
CPU_COMM_TIMEOUT_SECONDS = 1800


def has_gpu() -> bool:
    return torch.cuda.is_available()


class _CpuDeviceModule:
    """The slice of the ``torch.cuda`` API that torchtitan's Trainer, metrics
    and distributed utils call, answered for the host CPU."""

    def __getattr__(self, name: str) -> Any:
        # Streams, Event, synchronize, is_available, ... come from torch.cpu.
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0  # an int: used as barrier(device_ids=[...]) and device index

    @staticmethod
    def device_count() -> int:
        return 1  # get_local_device() then picks index 0 on every rank

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return _CpuProperties(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _CpuProperties:
    name: str
    total_memory: int


CPU_DEVICE_MODULE = _CpuDeviceModule()


def use_cpu_if_no_gpu() -> bool:
    """Point torchtitan at the CPU when no CUDA GPU is visible.

    Patches ``torchtitan.tools.utils.device_type``/``device_module`` and the
    copies that modules already imported with ``from torchtitan.tools.utils
    import device_type, device_module`` (metrics, distributed.utils,
    parallel_dims, profiler, token_dispatcher, ...), so the call order relative
    to torchtitan imports does not matter. Idempotent. Returns True when the
    CPU path is active.
    """
    if has_gpu():
        return False
    import torchtitan.tools.utils as tt_utils

    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        namespace = vars(module)
        if namespace.get("device_type", None) is old_type and isinstance(old_type, str):
            namespace["device_type"] = "cpu"
        if "device_module" in namespace and namespace["device_module"] is old_module:
            namespace["device_module"] = CPU_DEVICE_MODULE
    tt_utils.device_type = "cpu"
    tt_utils.device_module = CPU_DEVICE_MODULE
    return True


def force_sum_reduction(model: nn.Module) -> nn.Module:
    """Make every FSDP module reduce-scatter with SUM (gloo has no PREMUL_SUM).

    torchtitan sets gradient_divide_factor=1.0, which FSDP otherwise turns into
    ``ReduceOp.PREMUL_SUM(1.0)``; with force-sum it divides by 1.0 afterwards,
    so gradients are unchanged.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _with_force_sum_reduction(parallelize_fn):
    if getattr(parallelize_fn, "_cpu_force_sum", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(model, *args, **kwargs):
        return force_sum_reduction(parallelize_fn(model, *args, **kwargs))

    parallelize._cpu_force_sum = True
    return parallelize


def adapt_config(config: Trainer.Config, fp32: bool = True) -> Trainer.Config:
    """Adjust a ``Trainer.Config`` in place for CPU; unchanged with a GPU.

    fp32 params unless ``fp32`` is False (bf16 GEMMs are ~20x slower on CPU;
    the recipe's ``[parallel] cpu_fp32``: False keeps FSDP2's bf16 compute with
    fp32 master weights and reductions, the cluster's precision), no CUDA graphs,
    long comm timeouts, and FSDP modules forced to SUM reductions (wrapping
    ``model_spec.parallelize_fn``, which the Trainer also hands to pipelining_fn).
    """
    if has_gpu():
        return config
    if fp32:
        config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.comm.init_timeout_seconds = max(
        config.comm.init_timeout_seconds, CPU_COMM_TIMEOUT_SECONDS
    )
    config.comm.train_timeout_seconds = max(
        config.comm.train_timeout_seconds, CPU_COMM_TIMEOUT_SECONDS
    )
    spec = config.model_spec
    if spec is not None:
        spec.parallelize_fn = _with_force_sum_reduction(spec.parallelize_fn)
    return config

