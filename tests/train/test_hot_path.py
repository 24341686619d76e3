"""No host sync from our code in a steady step; a skipped step changes nothing, an applied one is AdamW."""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from rundir import REPO
from tests.conftest import env, free_port

STEPS, LOG_EVERY = 9, 4


def record_syncs(run: str, out: str) -> None:
    """Train the tiny model in this process under a dispatch mode that notes every
    ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``, ``if t:``) with the
    step it happened in and the innermost caller outside torch. Run in a subprocess."""
    from train.titan import use_cpu_if_no_gpu

    use_cpu_if_no_gpu()
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan.tools.logging import init_logger
    from train import recipe as R
    from train.build import trainer_config

    init_logger()
    recipe = R.load("tiny.toml", [
        f"run.output_dir={run}", f"training.steps={STEPS}", f"logging.interval={LOG_EVERY}",
        "training.seq_len=64", "training.global_batch=8", "training.micro_batch=4", "schedule.warmup_steps=2",
        "logging.tensorboard=false", 'logging.wandb_mode="disabled"', "eval.at_end=false",
        "checkpoint.interval=1000"])
    trainer = trainer_config(recipe, 1).build()
    calls: list[tuple[int, str]] = []
    torch_dir = str(Path(torch.__file__).parent) + "/"

    class CountSyncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                frames = [f for f in traceback.extract_stack()[:-1]
                          if not f.filename.startswith(torch_dir) and f.filename != __file__]
                f = frames[-1]
                calls.append((trainer.step, f"{f.filename}:{f.name}: {f.line}"))
            return func(*args, **(kwargs or {}))

    with CountSyncs():
        trainer.train()
    trainer.close()
    torch.distributed.destroy_process_group()
    Path(out).write_text(json.dumps(calls))


@pytest.fixture(scope="module")
def syncs(tmp_path_factory) -> dict[int, list[str]]:
    tmp = tmp_path_factory.mktemp("syncs")
    out = tmp / "calls.json"
    result = subprocess.run(
        [sys.executable, "-c", f"from tests.train.test_hot_path import record_syncs; "
                               f"record_syncs({str(tmp / 'run')!r}, {str(out)!r})"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert result.returncode == 0, result.stderr[-3000:]
    by_step: dict[int, list[str]] = {}
    for step, where in json.loads(out.read_text()):
        by_step.setdefault(step, []).append(where)
    return by_step


def test_a_steady_step_reads_nothing_from_the_device(syncs):
    steady = [s for s in range(2, STEPS) if s % LOG_EVERY]  # not the first, a logging or the last step
    assert {s: syncs.get(s, []) for s in steady} == {s: [] for s in steady}


def test_logging_steps_do_read_and_the_counter_sees_them(syncs):
    """The same mode sees the reads that logging needs (torchtitan's loss and grad norm, in the loop's log)."""
    for step in range(LOG_EVERY, STEPS, LOG_EVERY):
        sites = "\n".join(syncs[step])
        assert "float(grad_norm.item())" in sites and "float(loss.item())" in sites, sites


# ---- skipping through found_inf ----------------------------------------------------------


def adamw_reference(p, g, m, v, t, lr, betas, eps, weight_decay):
    """AdamW from Loshchilov & Hutter / torch's docs, one step, on copies."""
    b1, b2 = betas
    p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return p - lr * m_hat / (v_hat.sqrt() + eps), m, v


def test_a_skipped_step_changes_nothing_and_applied_steps_are_adamw():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from train.titan import GuardedOptimizers

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    kw = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = GuardedOptimizers.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kw)]).build(model_parts=[model])
    ref = {n: (p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for n, p in model.named_parameters()}
    applied = 0
    for i, skip in enumerate([0, 0, 1, 0, 1, 1, 0, 0]):
        scale = float("nan") if i == 2 else 1.0  # one skipped step has NaN gradients
        grads = {n: torch.randn_like(p) * scale for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        before = {n: (p.detach().clone(), {k: s.clone() for k, s in opt.optimizers[0].state[p].items()})
                  for n, p in model.named_parameters()}
        opt.skip = torch.tensor(float(skip))
        opt.step()
        assert opt.skip is None  # consumed: the next step needs a new decision
        applied += not skip
        for n, p in model.named_parameters():
            state = opt.optimizers[0].state[p]
            if skip:
                assert torch.equal(p, before[n][0])
                assert all(torch.equal(state[k], s) for k, s in before[n][1].items())
                continue
            ref[n] = adamw_reference(*ref[n][:1], grads[n], *ref[n][1:], applied, **kw)
            torch.testing.assert_close(p.detach(), ref[n][0], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["exp_avg"], ref[n][1], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["exp_avg_sq"], ref[n][2], rtol=1e-5, atol=1e-9)
            assert float(state["step"]) == applied


def test_a_step_without_a_decision_is_refused():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from train.titan import GuardedOptimizers

    opt = GuardedOptimizers.Config(param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})]
    ).build(model_parts=[torch.nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="without a skip decision"):
        opt.step()


def test_a_non_fused_optimizer_is_refused():
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from train.titan import GuardedOptimizers

    with pytest.raises(ValueError, match="fused Adam/AdamW and LaneMuon only"):
        GuardedOptimizers.Config(implementation="foreach", param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.1})]
        ).build(model_parts=[torch.nn.Linear(2, 2)])


# ---- the progress line of logging steps -----------------------------------------------------


def test_the_progress_line_gives_steps_tokens_and_an_eta_from_the_recent_step_time():
    from train.callbacks.progress import progress

    line, metrics = progress(50, 200, 4096, last=(40, 100.0), now=110.0)  # 10 steps in 10 s
    assert line == "progress: step 50/200 (25.0%)  tokens 205K/819K  ETA 0:02:30 (1 s/step)"
    assert metrics == {"progress/step_time_s": 1.0, "progress/eta_s": 150.0}
    # phase 1 of the 2B: 635,783 steps of 1536 x 4096 tokens at 2.9 s/step
    line, _ = progress(10, 635_783, 1536 * 4096, last=(0, 0.0), now=29.0)
    eta_days = (635_783 - 10) * 2.9 / 86400
    assert f"ETA {int(eta_days)}d {int(eta_days % 1 * 24)}h" in line and "tokens 62.9M/4T" in line
    assert progress(1, 10, 8, last=None, now=5.0) == ("progress: step 1/10 (10.0%)  tokens 8/80", {})
