"""Peak memory per GPU of one training step, traced on fake tensors.

The recipe's model is built on fake tensors (``FakeTensorMode``: shapes, no
storage), with the recipe's activation checkpointing and FSDP2 applied by
torchtitan's own parallelize path over a fake process group of N ranks;
forward, loss, backward, clipping and the recipe's optimizer (fused AdamW, or
Muon on the matrices and fused AdamW on the rest: ``step.step_optimizers``) run under
``FSDPMemTracker``, as torchtitan's former ``scripts/estimate/estimation.py``
did. Two steps run: the first creates the optimizer state. Without a GPU the
tensors are fake *CPU* tensors (autograd refuses fake CUDA tensors then); the
sizes are the same. Eager: ``torch.compile`` may save fewer tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .gpus import GIB, Gpu
from .step import Shape, _ac_config, _batch, _build, _loss, _windows, step_optimizers, use_cuda_kernels

FIT_FRACTION = 0.9  # a plan fits with >= 10% of the GPU left for the allocator and NCCL buffers

@dataclass
class Memory:
    """Bytes per GPU: the peak and its parts (FSDPMemTracker's kinds), and the persistent state."""

    peak: int
    parts: dict[str, int]  # at the peak
    state: int  # sharded params + grads + optimizer state, after backward
    gpu: Gpu
    optimizer_state: int = 0  # of ``state``: the optimizer's (AdamW's two moments, Muon's one momentum)

    @property
    def fits(self) -> bool:
        return self.peak <= FIT_FRACTION * self.gpu.memory_gib * GIB

    def to_json(self) -> dict:
        return {"peak_gib": self.peak / GIB, "gpu_gib": self.gpu.memory_gib, "fits": self.fits,
                "state_gib": self.state / GIB, "optimizer_state_gib": self.optimizer_state / GIB,
                "parts_gib": {k: v / GIB for k, v in self.parts.items()}}

    def lines(self) -> list[str]:
        p = self.parts
        return [
            f"peak memory per GPU: {self.peak / GIB:.2f} GiB of {self.gpu.memory_gib:.1f} GiB "
            f"({'fits' if self.fits else 'does not fit'})",
            f"sharded params+grads+optimizer per GPU: {self.state / GIB:.2f} GiB",
            f"activations per GPU: {p['Activation'] / GIB:.2f} GiB",
            f"temporaries per GPU: {p['Temp'] / GIB:.2f} GiB",
            f"all-gather buffers per GPU: {p['All Gather'] / GIB:.2f} GiB",
            f"reduce-scatter buffers per GPU: {p['Reduce Scatter'] / GIB:.2f} GiB",
            f"unsharded params+grads per GPU: {(p['Unsharded Param'] + p['Unsharded Grad']) / GIB:.2f} GiB",
            f"(at the peak: sharded params {p['Sharded Param'] / GIB:.2f}, sharded grads "
            f"{p['Sharded Grad'] / GIB:.2f}, optimizer {p['OptState'] / GIB:.2f}, inputs "
            f"{p['Inputs'] / GIB:.2f}, buffers {p['Buffer'] / GIB:.2f} GiB; fits means at most "
            f"{FIT_FRACTION:.0%} of the GPU)",
        ]


def memory_plans(config, shape: Shape, gpu: Gpu, micro_batches: tuple[int, ...] | None = None,
                 stop_when_full: bool = False) -> dict[int, Memory]:
    """One FSDP2 training step of ``config`` at ``shape`` for each micro batch, traced on
    fake tensors; the sharded model is built once. ``stop_when_full``: no micro batch
    larger than one that does not fit is traced."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.tools import utils as tt_utils

    from models.laneformer import parallelize_laneformer
    from train.titan import use_cpu_if_no_gpu

    use_cpu_if_no_gpu()  # torchtitan's mesh and our fake tensors on the same device type
    device = tt_utils.device_type
    if dist.is_initialized():
        raise RuntimeError("memory_plans needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", rank=0, world_size=shape.gpus, store=FakeStore())
    plans = {}
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=shape.gpus, cp=1, tp=1, pp=1, ep=1,
                            world_size=shape.gpus, spmd_backend="partial_dtensor")
        dims.build_mesh()  # outside fake mode
        with FakeTensorMode():
            model = use_cuda_kernels(_build(config, torch.float32, device), _windows(config), shape.cp)
            parallelize_laneformer(
                model, parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param=shape.param_dtype,
                                        mixed_precision_reduce=shape.reduce_dtype),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                compile_config=CompileConfig(enable=False), ac_config=_ac_config(shape.ac), dump_folder="",
            )
            optimizer = step_optimizers(list(model.named_parameters()), shape)
            for p in model.parameters():  # the optimizer state exists from the second step on
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad()
            tracker = FSDPMemTracker(model, optimizer)  # tracks the existing state on entry
            with tracker:
                for mb in micro_batches or (shape.micro_batch,):
                    tracker.reset_mod_stats()  # one step per micro batch, each with its own peak
                    tracker._peak_mem = dict.fromkeys(tracker._peak_mem, 0)  # (no public reset)
                    tokens, labels = _batch(config.vocab_size, dataclasses.replace(shape, micro_batch=mb), device)
                    tracker.track_inputs((tokens, labels))
                    _loss(model(tokens), labels).backward()
                    after_backward = tracker.get_tracker_snapshot()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), shape.grad_clip, foreach=True)
                    optimizer.step()
                    optimizer.zero_grad()
                    del tokens, labels
                    plans[mb] = _memory(tracker.get_tracker_snapshot("peak"), after_backward, gpu)
                    if stop_when_full and not plans[mb].fits:
                        break
    finally:
        dist.destroy_process_group()
    return plans


def _memory(peak: dict, after_backward: dict, gpu: Gpu) -> Memory:
    (at_peak,) = peak.values()  # one device
    (state,) = after_backward.values()
    name = lambda kind: getattr(kind, "value", kind)
    parts = {name(k): v for k, v in at_peak.items()}
    persistent = sum(v for k, v in state.items() if name(k) in ("Sharded Param", "Sharded Grad", "OptState"))
    optimizer = sum(v for k, v in state.items() if name(k) == "OptState")
    return Memory(peak=parts.pop("Total"), parts=parts, state=persistent, gpu=gpu, optimizer_state=optimizer)


def memory_plan(config, shape: Shape, gpu: Gpu) -> Memory:
    """Peak memory per GPU of one training step at ``shape``."""
    return memory_plans(config, shape, gpu)[shape.micro_batch]

