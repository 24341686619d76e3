"""Data-parallel layouts on real processes (torchrun, gloo on CPU): HSDP, 2 replicas x 2 shards,
with the all-reduce across replicas only at a step's last micro batch, trains as FSDP over 4 ranks does
(one process: tests/e2e/test_train_runs.py); checkpoints move between the layouts both ways. FSDP2's switches that defer
gradient reduction are also checked in one process, where their effect can be seen.

Every run continues from the same checkpoint of the FSDP reference: a fresh model's initial weights
depend on the number of ranks (torchtitan initializes the sharded parameters rank by rank), so
equality is asked of the steps, as for resuming on another number of ranks (test_train_runs.py).
"""

from __future__ import annotations

import shutil
import types

import pytest
import torch
import torch.distributed as dist

import rundir
from models.laneformer import read_native_config
from models.laneformer.hf.checkpoint_io import load_dcp
from tests.conftest import losses, train

STEPS = 3
# 8 sequences per step: 4 ranks x micro batch 1 x 2 accumulated micro batches.
SETS = (f"training.steps={STEPS}", "training.seq_len=64", "training.global_batch=8", "training.micro_batch=1",
        "schedule.warmup_steps=2", "logging.interval=1", "run.deterministic=true", "checkpoint.interval=1",
        "checkpoint.keep_last=10", "logging.tensorboard=false", "eval.at_end=false")
HSDP = ("parallel.replicate=2", 'parallel.reduce_grads="replicas_last_micro_batch"')
FSDP_DEFERRED = ('parallel.reduce_grads="last_micro_batch"',)


def run(run_dir, *sets, nproc):
    result = train("tiny.toml", f"run.output_dir={run_dir}", *SETS, *sets, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def resume_copy(src, dst, step: int):
    """``dst``: ``src``'s run dir with its checkpoints after ``step`` removed (a run stopped there)."""
    shutil.copytree(src, dst)
    for later in (dst / rundir.CHECKPOINTS_DIR).glob("step-*"):
        if rundir.step_number(later) > step:
            shutil.rmtree(later)
    return dst


def weights(run_dir):
    step = run_dir / rundir.CHECKPOINTS_DIR / f"step-{STEPS}"
    return load_dcp(step, read_native_config(run_dir / rundir.MODEL_CONFIG_FILE))


@pytest.mark.slow
def test_hsdp_fsdp_and_one_process_train_alike_and_checkpoints_cross_layouts(tmp_path):
    fsdp = tmp_path / "fsdp"
    out = run(fsdp, nproc=4)  # the reference: FSDP over 4, every micro batch reduced
    assert "dp_replicate=1, dp_shard=4" in out
    reference, final = losses(fsdp), weights(fsdp)

    # FSDP's step-1 checkpoint under HSDP 2 x 2 (all-reduce across replicas at the last micro batch)
    hsdp = resume_copy(fsdp, tmp_path / "hsdp", 1)
    out = run(hsdp, *HSDP, nproc=4)
    assert "dp_replicate=2, dp_shard=2" in out and "Training starts at step 2" in out
    # HSDP's step-2 checkpoint under FSDP over 4 (every reduction at the last micro batch)
    back = resume_copy(hsdp, tmp_path / "back", 2)
    out = run(back, *FSDP_DEFERRED, nproc=4)
    assert "dp_replicate=1, dp_shard=4" in out and "Training starts at step 3" in out

    # Only the order of the gradient sums differs (reduce-scatter over 4, or over 2 then an all-reduce
    # over 2): today's cross-world tolerance, on losses and on the final weights. (A resume on one
    # process is tests/e2e/test_train_runs.py's.)
    for other, first in ((hsdp, 2), (back, 3)):
        got = losses(other)
        assert all(got[s] == pytest.approx(reference[s], rel=1e-5) for s in range(first, STEPS + 1)), (other, got)
        for name, tensor in weights(other).items():
            torch.testing.assert_close(tensor, final[name], rtol=1e-5, atol=1e-6, msg=f"{other.name}: {name}")


# ---- the switches, seen in one process ---------------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mode, mesh_dims", [("last_micro_batch", ("fsdp",)),
                                             ("replicas_last_micro_batch", ("dp_replicate", "fsdp"))])
def test_reduce_grads_leaves_the_sharded_gradients_empty_until_the_last_micro_batch(one_rank, mode, mesh_dims):
    """``LaneformerTrainer._reduce_grads_now`` on an FSDP2 model: after a micro batch that is not
    the step's last nothing has been reduced into the sharded gradients; after the last one they hold
    the sum over the step, as with a reduction after every micro batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from train.trainer import LaneformerTrainer

    xs = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))
    grads = {}
    for reduce_grads in (mode, "every_micro_batch"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        mesh = init_device_mesh("cpu", (1,) * len(mesh_dims), mesh_dim_names=mesh_dims)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trainer = types.SimpleNamespace(config=types.SimpleNamespace(reduce_grads=reduce_grads), model_parts=[model])
        for i, x in enumerate(xs):
            LaneformerTrainer._reduce_grads_now(trainer, last=i == len(xs) - 1)
            model(x).sum().backward()
            if i < len(xs) - 1:
                assert (model[0].weight.grad is None) == (reduce_grads != "every_micro_batch"), (reduce_grads, i)
        grads[reduce_grads] = [p.grad.full_tensor() for p in model.parameters()]
    for deferred, every in zip(grads[mode], grads["every_micro_batch"]):
        torch.testing.assert_close(deferred, every)
