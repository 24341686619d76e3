"""Every CPU-only adjustment torchtitan 0.3.0 needs, in one place.

torchtitan assumes an accelerator ("cuda" when none is found), gloo lacks the
PREMUL_SUM reduction FSDP uses, FlexAttention has no CPU backward, and bf16
GEMMs are ~20x slower on CPU. Tests and CI run on CPU-only machines, so:

    from train.cpu import use_cpu_if_no_gpu, adapt_config
    use_cpu_if_no_gpu()            # first thing in an entry point
    config = adapt_config(config)  # on the Trainer.Config, before building

Both are no-ops when a CUDA GPU is present, so the same entry points and
configs run unchanged on a cluster (where FlexAttention stays in use, so masks
have a single definition: the BlockMask's mask_mod). torchtitan's compiled
create_block_mask works on CPU, so masks are built the same way on both.
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
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.models.common.attention import FlexAttention

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer

__all__ = [
    "CPU_COMM_TIMEOUT_SECONDS",
    "DenseMaskFlexAttention",
    "adapt_config",
    "dense_mask_from_block_mask",
    "force_sum_reduction",
    "has_gpu",
    "use_cpu_if_no_gpu",
    "use_dense_attention",
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


def adapt_config(config: Trainer.Config) -> Trainer.Config:
    """Adjust a ``Trainer.Config`` in place for CPU; unchanged with a GPU.

    fp32 params (bf16 GEMMs are ~20x slower on CPU), no CUDA graphs, long
    comm timeouts, FlexAttention -> DenseMaskFlexAttention, and FSDP modules
    forced to SUM reductions (wrapping ``model_spec.parallelize_fn``, which
    the Trainer also hands to pipelining_fn).
    """
    if has_gpu():
        return config
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
        use_dense_attention(spec)
        spec.parallelize_fn = _with_force_sum_reduction(spec.parallelize_fn)
    return config


def use_dense_attention(config: Any) -> Any:
    """Swap every FlexAttention.Config under ``config`` (a ModelSpec or model
    config) for DenseMaskFlexAttention.Config; returns ``config``."""
    for _, cfg, parent, attr in list(config.traverse(FlexAttention.Config)):
        if isinstance(cfg, DenseMaskFlexAttention.Config) or parent is None:
            continue
        new = DenseMaskFlexAttention.Config(
            block_size=cfg.block_size, kernel_options=dict(cfg.kernel_options)
        )
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return config


def dense_mask_from_block_mask(block_mask: BlockMask) -> torch.Tensor:
    """Evaluate ``block_mask.mask_mod`` on every (b, h, q, kv): a boolean
    tensor [B_mask, H_mask, Q, KV] (B_mask/H_mask as the BlockMask was built,
    usually [B, 1, S, S]) that broadcasts against SDPA's [B, H, Q, KV]."""
    q_len, kv_len = block_mask.seq_lengths
    n_b, n_h = block_mask.kv_num_blocks.shape[:2]
    device = block_mask.kv_num_blocks.device
    b = torch.arange(n_b, device=device).view(-1, 1, 1, 1)
    h = torch.arange(n_h, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    mask = block_mask.mask_mod(b, h, q, kv)
    return mask.to(torch.bool).expand(n_b, n_h, q_len, kv_len)


class DenseMaskFlexAttention(FlexAttention):
    """FlexAttention's interface computed with SDPA and a dense boolean mask.

    CPU fallback: flex_attention has no backward on CPU. The mask is the
    BlockMask's own ``mask_mod``, so masks are defined once for both paths.
    O(S^2) memory: for tests and small CPU runs only. (A query whose mask row
    is empty gets 0 from SDPA, as from flex.)
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: BlockMask,
        score_mod=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform=None,
        **kwargs,
    ) -> torch.Tensor:
        assert isinstance(
            attention_masks, BlockMask
        ), f"attention_masks must be a BlockMask, got {type(attention_masks)}"
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError(
                "DenseMaskFlexAttention supports mask_mod only (no score_mod, "
                "no lse/out_transform)"
            )
        mask = dense_mask_from_block_mask(attention_masks)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)
