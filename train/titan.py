"""Everything this framework changes of torchtitan 0.3.0, in one place.

``train.trainer.LaneformerTrainer.train`` runs the loop, ported from torchtitan's ``Trainer.train``
and ``train_step`` (as torchtitan's own torchft trainer does) and calling torchtitan's parts; a few
of those parts need more than their configs give. Each change below names the torchtitan code it
replaces or hooks, and ``TORCHTITAN_API`` lists the signatures they rely on (``TORCHTITAN_LOOP``: the
source the loop was ported from): ``tests/train/test_titan.py`` fails when torchtitan's side of any
of them changes, before a run silently loses one. Nothing else in ``train/`` assigns into torchtitan.

- ``use_cpu_if_no_gpu``: torchtitan's device (``torchtitan.tools.utils.device_type`` and
  ``device_module``, and the copies its modules imported) pointed at the CPU when no GPU is visible.
- ``GuardedOptimizers``: fused Adam(W) and Muon that apply or skip a step on the device; Muon by name.
- ``MilestoneCheckpointManager``: torchtitan's DCP checkpointing, with milestones that are never
  purged, damaged checkpoints moved aside and a full disk named.
- ``LaneformerMetrics``: torchtitan's metrics, also at the last step, with MFU "N/A" on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import torchtitan.distributed.context_parallel as tt_cp
import torchtitan.distributed.flex_shard.dist_muon as tt_dist_muon
import torchtitan.tools.utils as tt_utils
from rundir import STEP_DIR, checkpoint_of, is_complete, step_number
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import LR_SCHEDULER, MODEL
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from data.mixture import MixtureError
from train.cpu import has_gpu
from train.muon import LaneMuon
from health.consistency import is_verified
from health.storage import NoSpace, checkpoint_bytes, free_bytes, is_out_of_space

# What the changes below and the loop rely on: (owner, attribute) -> its signature in torchtitan 0.3.0
# (None: it only has to exist).
TORCHTITAN_API = {
    (tt_utils, "device_type"): None,  # use_cpu_if_no_gpu
    (tt_utils, "device_module"): None,
    # the loop's clipping: the pre-clip norm, which the spike guard reads before the update
    (dist_utils, "clip_grad_norm_"): "(parameters: 'torch.Tensor | Iterable[torch.Tensor]', max_norm: 'float', "
    "norm_type: 'float' = 2.0, error_if_nonfinite: 'bool' = False, foreach: 'bool | None' = None, "
    "pp_mesh: 'DeviceMesh | None' = None, ep_enabled: 'bool' = False) -> 'torch.Tensor'",
    (MetricsProcessor, "should_log"): "(self, step: int) -> bool",
    # GuardedOptimizers names LaneMuon beside torchtitan's optimizers; LaneMuon runs torchtitan's batched
    # Newton-Schulz (DistMuon's kernel), held to torch.optim.Muon lane by lane by tests/train/test_muon.py
    (OptimizersContainer, "_resolve_optimizer_factory"): "(name: str) -> collections.abc.Callable[..., "
    "torch.optim.optimizer.Optimizer]",
    (tt_dist_muon, "_zeropower_via_newtonschulz"): "(update: 'Tensor', *, ns_coefficients: 'tuple[float, float, "
    "float]', ns_steps: 'int', eps: 'float') -> 'Tensor'",
    (CheckpointManager, "_should_save"): "(self, curr_step: 'int', last_step: 'bool' = False) -> 'bool'",
    (CheckpointManager, "_save"): "(self, curr_step: 'int', last_step: 'bool' = False) -> 'bool'",
    (CheckpointManager, "_load"): "(self, step: 'int' = -1) -> 'bool'",
    (CheckpointManager, "_find_load_step"): "(self, folder: 'str' = '') -> 'int'",
    (CheckpointManager, "_purge_stale_checkpoints"): "(self)",
    (CheckpointManager, "_should_purge"): "(self) -> 'bool'",
    (CheckpointManager, "dcp_load"): "(self, state_dict: 'dict[str, Any]', checkpoint_id: 'str', from_hf: 'bool', "
    "from_quantized: 'bool') -> 'None'",
    # the loop calls it per micro batch
    (Trainer, "forward_backward_step"): "(self, *, input_dict: dict[str, torch.Tensor] | list[dict[str, "
    "torch.Tensor]], labels: torch.Tensor | list[torch.Tensor], global_valid_tokens: torch.Tensor) -> torch.Tensor",
    (Trainer, "batch_generator"): None,  # overridden and called through
    # overridden and called through: under context parallelism the trainer adds the masks of the whole sequence
    # (Laneformer.attention_masks) before torchtitan's slices them with the batch (prepare_context_parallel_input)
    (Trainer, "post_dataloading_process"): "(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> "
    "tuple[torch.Tensor, torch.Tensor, dict[str, typing.Any]]",
    (tt_cp, "prepare_context_parallel_input"): "(inputs: torch.Tensor, labels: torch.Tensor, extra_kwargs: "
    "dict[str, typing.Any], cp_mesh: torch.distributed.device_mesh.DeviceMesh, device: torch.device, "
    "load_balancer_type: str | None = 'headtail', ptrr_mask_key: str | None = None) -> tuple[torch.Tensor, "
    "torch.Tensor, dict[str, typing.Any]]",
    # the objective's per-token inputs (loss weights) cut over the CP ranks as the tokens (train.trainer.cut_like_tokens)
    (tt_cp, "cp_shard"): (
        '(cp_mesh: torch.distributed.device_mesh.DeviceMesh, inputs: tuple[torch.Tensor, ...], attention_mask'
        's: collections.abc.Mapping[str, torch.nn.attention.flex_attention.BlockMask | torchtitan.models.comm'
        'on.attention.VarlenMetadata | None] | torch.nn.attention.flex_attention.BlockMask | torchtitan.model'
        "s.common.attention.VarlenMetadata | None, load_balancer_type: str | None = 'headtail', input_seq_dim"
        ': int = 1, ptrr_mask_key: str | None = None) -> tuple[tuple[torch.Tensor, ...], collections.abc.Mapp'
        'ing[str, torch.nn.attention.flex_attention.BlockMask | torchtitan.models.common.attention.VarlenMeta'
        'data | None] | torch.nn.attention.flex_attention.BlockMask | torchtitan.models.common.attention.Varl'
        'enMetadata | None]'),
    # train.trainer: one micro batch's forward, the run's objective's loss (train.objectives) and backward
    (Trainer, "_forward_backward_body"): "(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: "
    "torch.Tensor, extra_kwargs: dict[str, typing.Any]) -> torch.Tensor",
}

# The torchtitan 0.3.0 code LaneformerTrainer ports: (owner, function) -> the first 16 hex digits of the
# sha256 of its source. A change there is a change to read and port. (``_forward_backward_body``: ported
# with the run's objective as its loss, in LaneformerTrainer._forward_backward_body.)
# TORCHTITAN_LOOP_FROM: the upstream file they were taken from, to diff against the new release on an upgrade
# (``git diff <sha> <new tag> -- torchtitan/trainer.py``). The v0.3.0 wheel's trainer.py is git blob a6639b28,
# last changed upstream by that commit (#4141) and unchanged on release/0.3 from 0.3.0rc1 on.
TORCHTITAN_LOOP_FROM = "pytorch/torchtitan@6bc2108e9914e1e993f8086fe5a8dfa035eafd41 torchtitan/trainer.py (v0.3.0)"
TORCHTITAN_LOOP = {
    (Trainer, "train"): "d2fe16fca25c505b",
    (Trainer, "train_step"): "911f8077fc175e7f",
    (Trainer, "_forward_backward_body"): "2d88c5250155b17d",
}


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
    """Point torchtitan at the CPU when no CUDA GPU is visible (torchtitan picks "cuda" when it finds
    no accelerator); the first thing an entry point does. Tests and CI run on CPU-only machines.

    Replaces ``torchtitan.tools.utils.device_type``/``device_module`` and the copies that modules
    already imported with ``from torchtitan.tools.utils import device_type, device_module``
    (metrics, distributed.utils, parallel_dims, profiler, token_dispatcher, ...), so the call order
    relative to torchtitan imports does not matter. Idempotent. Returns True when the CPU path is
    active; with a GPU it changes nothing.
    """
    if has_gpu():
        return False
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


class GuardedOptimizers(OptimizersContainer):
    """Fused Adam(W) and Muon (``train.muon.LaneMuon``) steps that apply or skip on the device: ``skip``
    (the spike guard's 0/1 tensor, set before every step) is passed as ``found_inf``, the switch torch's
    fused kernels already have for AMP (LaneMuon reads it the same way). Clipping is torchtitan's
    (``training.max_norm``). ``ParamGroupConfig(optimizer_name="LaneMuon")`` names Muon, beside torchtitan's
    own names (``OptimizersContainer._resolve_optimizer_factory``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass  # its own Config, so that build() makes a GuardedOptimizers

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == LaneMuon.__name__:
            return LaneMuon
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        for optimizer in self.optimizers:
            if not (isinstance(optimizer, LaneMuon) or isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
                    and all(g.get("fused") for g in optimizer.param_groups)):
                raise ValueError(f"GuardedOptimizers skips steps through fused Adam/AdamW and LaneMuon only, got "
                                 f"{type(optimizer).__name__} (implementation={config.implementation!r})")
        self.skip: torch.Tensor | None = None  # set by the spike guard (train.callbacks.spike_guard) before each step
        self._last_skip: torch.Tensor | None = None

    def step(self, closure=None):
        if self.skip is None:
            raise RuntimeError("GuardedOptimizers.step without a skip decision for this step")
        for optimizer in self.optimizers:
            optimizer.found_inf = self.skip
        try:
            return super().step(closure)
        finally:
            for optimizer in self.optimizers:
                del optimizer.found_inf
            self._last_skip, self.skip = self.skip, None

    @property
    def skipped(self) -> bool:
        """Whether the latest step was skipped (a host sync: for error paths only)."""
        return self._last_skip is not None and bool(self._last_skip)


class MilestoneCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointing; ``milestones`` steps are never purged, a damaged
    latest checkpoint is moved aside (``step-N.damaged``) instead of failing every restart,
    a save that runs out of disk space stops the run with ``NoSpace``. ``due`` tells the trainer
    which saves happen, so that it calls the points around them (``LaneformerTrainer.save_checkpoint``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        milestones: list[int] = field(default_factory=list)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.milestones = set(config.milestones)
        self.prefer_verified = False  # with HSDP replicas: resume from a checkpoint whose copies were compared
        self.last_saved_step = -1  # the step of this process's latest save
        self.loading: set[str] | None = None  # during a load: the keys its checkpoint holds

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether ``save(step, last_step)`` writes a checkpoint."""
        return self._should_save(step, last_step)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        # replaces CheckpointManager._should_save: also at every milestone
        return super()._should_save(curr_step, last_step) or (self.enable and curr_step in self.milestones)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # wraps CheckpointManager._save (torchtitan's save() calls it): the purge its last-step save
        # skips, and a full disk named
        try:
            saved = super()._save(curr_step, last_step)  # an async save's failure surfaces at the next
        except (Exception, CheckpointException) as e:
            self._no_space(e, curr_step)
            raise
        if saved:
            if last_step:  # torchtitan's last-step save skips its purge: keep_last + 1 would stay
                self._purge_stale_checkpoints()
            self.last_saved_step = curr_step
        return saved

    def _no_space(self, error: BaseException, step: int) -> None:
        """Raise ``NoSpace`` when ``error`` is the disk running full (else return: the caller re-raises)."""
        nparams = sum(p.numel() for part in self.states[MODEL].model for p in part.parameters())
        needed = checkpoint_bytes(nparams)  # numel of a sharded parameter is the whole one's
        if not (is_out_of_space(error) or free_bytes(Path(self.folder)) < needed):
            return
        # The half-written step (no .metadata) would never load; its space goes back.
        if not dist.is_initialized() or dist.get_rank() == 0:
            for partial in Path(self.folder).glob(STEP_DIR.format(step="*")):
                if step_number(partial) is not None and not is_complete(partial):
                    shutil.rmtree(partial, ignore_errors=True)
        raise NoSpace.at(Path(self.folder), needed, error, step) from error

    def _find_load_step(self, folder: str = "") -> int:
        # replaces CheckpointManager._find_load_step: exactly ``step-N`` with DCP's .metadata (rundir's
        # rule; torchtitan's own search would also pick ``step-N.damaged``), verified ones first with replicas
        path = Path(folder or self.folder)
        steps = [n for p in path.iterdir() if (n := step_number(p)) is not None and is_complete(p)] \
            if path.is_dir() else []
        if self.prefer_verified:
            steps = [n for n in steps if is_verified(checkpoint_of(path, n))] or steps
        return max(steps, default=-1)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        # wraps CheckpointManager.dcp_load: the checkpoint's keys are known while it loads, so a state
        # whose layout changed (the trainer's) asks for what that checkpoint holds
        if not from_hf:
            self.loading = set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
        try:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        finally:
            self.loading = None

    def _load(self, step: int = -1) -> bool:
        # wraps CheckpointManager._load: a damaged latest checkpoint is moved aside and the previous one loaded
        damaged = sorted(p.name for p in Path(self.folder).glob(STEP_DIR.format(step="*") + ".damaged*")) if Path(self.folder).is_dir() else []
        if step < 0 and damaged and self._find_load_step() < 0:
            raise RuntimeError(f"{self.folder} holds only damaged checkpoints ({', '.join(damaged)}): not starting "
                               "from scratch beside them; rename one back to step-N to resume from it, or move "
                               "them away to start afresh")
        while True:
            which = step if step >= 0 else self._find_load_step()
            try:
                loaded = super()._load(step)
                failure = None
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                failure = e
            if not self._anyone_failed(failure is not None):
                break
            where = str(checkpoint_of(Path(self.folder), which)) if which >= 0 else self.initial_load_path
            if isinstance(failure, MixtureError):  # it read whole but holds another data order: not damaged
                raise RuntimeError(f"checkpoint {where} does not fit this run's data ({failure}); it is left "
                                   "as it is") from failure
            if step >= 0 or which < 0:  # an explicit step or the initial load: nothing to fall back to
                raise RuntimeError(f"checkpoint {where} could not be loaded ({failure})") from failure
            self._move_aside(which, failure)
            if self._find_load_step() < 0:
                raise RuntimeError(
                    f"checkpoint {where} could not be loaded and no complete checkpoint is left in "
                    f"{self.folder} (damaged ones are kept as step-N.damaged); not starting from scratch"
                ) from failure
        # torchtitan restores the schedulers' step but the optimizers keep the lr saved in
        # their state, i.e. the old schedule's; a resumed run whose schedule changed (more
        # steps, another decay) would take its first step at that stale lr.
        for scheduler in self.states[LR_SCHEDULER].schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        return loaded

    @staticmethod
    def _anyone_failed(failed: bool) -> bool:
        """Every rank learns whether any rank's load failed (DCP mostly fails on all at once)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return failed
        everyone: list[bool | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failed)
        return any(everyone)

    def _move_aside(self, which: int, failure: BaseException | None) -> None:
        src = checkpoint_of(Path(self.folder), which)
        dst = src.with_name(f"{src.name}.damaged")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{src.name}.damaged-{n}")
        if not dist.is_initialized() or dist.get_rank() == 0:
            why = f"{type(failure).__name__}: {failure}" if failure else "failed on another rank"
            logger.error(f"DAMAGED CHECKPOINT {src} could not be loaded ({why}); moved to {dst.name}, "
                         "resuming from the previous complete checkpoint")
            src.rename(dst)
        if dist.is_initialized():
            dist.barrier()

    def _purge_stale_checkpoints(self):
        # replaces CheckpointManager._purge_stale_checkpoints: milestones are never purged
        if not self._should_purge():
            return
        steps = sorted(n for name in os.listdir(self.folder)
                       if (n := step_number(Path(name))) is not None and n not in self.milestones)
        for n in steps[: -self.keep_latest_k]:
            self.purge_queue.put(str(checkpoint_of(Path(self.folder), n)))


class LaneformerMetrics(MetricsProcessor):
    """torchtitan's metrics processor, logging the last step too (a run's final loss is its last
    step's, whatever the interval), with MFU "N/A" on a CPU."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        last_step: int = 0  # [training] steps

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if tt_utils.device_type == "cpu":
            # MFU against a GPU's peak means nothing on a CPU; torchtitan prints N/A for it only under this flag
            self.has_quantization = True

    def should_log(self, step: int) -> bool:
        # replaces MetricsProcessor.should_log (step 1 and every log_freq steps): also the last step
        return super().should_log(step) or step == self.config.last_step
