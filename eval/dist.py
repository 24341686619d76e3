"""The collectives evaluation needs, and lock-step forwards for FSDP.

Ranks score disjoint shares of the items and sum their results. Under FSDP a
forward is itself a sequence of collectives (parameter all-gathers), so every
rank must run the same number of forwards or the job deadlocks; ``Lockstep``
makes a rank with no work left keep running dummy forwards until all ranks are
done. Without an initialised process group everything here is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

ModelFn = Callable[[torch.Tensor], torch.Tensor]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (it must live where the backend can reach: CUDA for NCCL)."""
    if distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool, device: torch.device | str) -> bool:
    """True when ``flag`` is true on at least one rank."""
    if not distributed():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class Lockstep:
    """Calls a model so that all ranks run the same number of forwards.

    Each real forward is preceded by a one-integer all-reduce saying "I have
    work"; ``finish`` (run on leaving the ``with`` block) answers "no work"
    and runs a dummy forward for as long as another rank still has work. Used
    as ``with Lockstep(model_fn, device, pad_id) as forward: forward(ids)``.
    Forwards run under ``torch.no_grad``.
    """

    def __init__(self, model_fn: ModelFn, device: torch.device | str, pad_id: int):
        self.model_fn = model_fn
        self.device = torch.device(device)
        self.pad_id = pad_id

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        any_rank(True, self.device)
        return self._forward(ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model_fn(ids.to(self.device))

    def finish(self) -> None:
        while any_rank(False, self.device):
            self._forward(torch.full((1, 2), self.pad_id, dtype=torch.long))

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 (a scalar counts as one element)."""
    t = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if not distributed():
        return t
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` in rank order on ``dst``; None elsewhere."""
    if not distributed():
        return [obj]
    out = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def barrier() -> None:
    if distributed():
        dist.barrier()
