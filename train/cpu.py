"""The CPU-only adjustments of a torchtitan 0.3.0 ``Trainer.Config``, in one place.

Gloo lacks the PREMUL_SUM reduction FSDP uses, bf16 GEMMs are ~20x slower on CPU, and compiling
and gloo collectives on a few slow cores outlast torchtitan's timeouts. Tests and CI run on
CPU-only machines, so::

    from train.titan import use_cpu_if_no_gpu
    use_cpu_if_no_gpu()            # first thing in an entry point: torchtitan's device (train.titan)
    config = adapt_config(config)  # on the Trainer.Config, before building

Both are no-ops when a CUDA GPU is present, so the same entry points and
configs run unchanged on a cluster. The attention kernel is not chosen here:
``model_registry`` picks it (``models.laneformer.attention``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

__all__ = [
    "CPU_COMM_TIMEOUT_SECONDS",
    "adapt_config",
    "force_sum_reduction",
    "has_gpu",
]

# Compile and gloo collectives on 2 slow cores can exceed torchtitan's 100 s.
CPU_COMM_TIMEOUT_SECONDS = 1800


def has_gpu() -> bool:
    return torch.cuda.is_available()


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

