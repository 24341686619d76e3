"""MilestoneCheckpointManager in one process, no torchrun: milestones survive purging,
keep-last-k holds, a resumed run takes the new schedule's lr, damaged folders are never picked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rundir
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from train.titan import GuardedOptimizers, MilestoneCheckpointManager

LR = 0.01


@pytest.fixture(autouse=True, scope="module")
def one_rank(tmp_path_factory):
    """torchtitan's save and load run collectives: a 1-rank gloo group for this module."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def manager(run, steps: int, decay_ratio: float | None, keep: int = 2, milestones=()):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizers = GuardedOptimizers.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": LR})]).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=decay_ratio, min_lr_factor=0.0).build(
        optimizers=optimizers, training_steps=steps)
    config = MilestoneCheckpointManager.Config(enable=True, folder="checkpoints", interval=1, keep_latest_k=keep,
                                               milestones=list(milestones), last_save_model_only=False)
    ckpt = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={}, sd_adapter=None, base_folder=str(run))
    return ckpt, model, optimizers, schedulers


def train(model, optimizers, schedulers, steps):
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        optimizers.skip = torch.tensor(0.0)
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()


def test_milestones_are_never_purged_and_the_last_k_are_kept(tmp_path):
    ckpt, *_ = manager(tmp_path, steps=10, decay_ratio=None, keep=2, milestones=[2, 5])
    for step in range(1, 9):
        ckpt.save(step)
    ckpt.save(9, last_step=True)  # torchtitan's own last-step save does not purge: ours does
    ckpt.close()  # joins the purge thread
    assert rundir.complete_steps(tmp_path) == [2, 5, 8, 9]


def test_a_resumed_run_takes_its_new_schedules_lr(tmp_path):
    # A 6-step run with decay over its last 80%: at step 4 it is decaying.
    ckpt, model, optimizers, schedulers = manager(tmp_path, steps=6, decay_ratio=0.8)
    train(model, optimizers, schedulers, 4)
    stale = optimizers.optimizers[0].param_groups[0]["lr"]
    assert stale < LR
    ckpt.save(4)
    ckpt.close()
    # Extended to 100 steps, decaying over its last 10%: step 4 is on the plateau, at the peak lr.
    ckpt, model, optimizers, schedulers = manager(tmp_path, steps=100, decay_ratio=0.1)
    assert ckpt.load()
    assert optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR)
    ckpt.close()


def test_the_latest_step_ignores_damaged_and_half_written_folders(tmp_path):
    ckpt, *_ = manager(tmp_path, steps=10, decay_ratio=None, keep=0)
    for step in (3, 6):
        ckpt.save(step)
    (rundir.checkpoints_dir(tmp_path) / "step-6").rename(rundir.checkpoints_dir(tmp_path) / "step-9.damaged")
    rundir.step_dir(tmp_path, 12).mkdir()  # no .metadata: half-written
    assert ckpt._find_load_step() == 3
    ckpt.close()
