"""Muon (``[optimizer] name = "muon"``): train.muon.LaneMuon against torch.optim.Muon lane by lane, its skipped
steps, its parameter groups in the run's optimizer container, the recipe's checks (a bad name, patterns that pick
no matrix, a resume or an initial load that would give it another optimizer's state) and the planner's count of
its state and its Newton–Schulz. Multi-rank layouts and kill -9 resume: tests/e2e/test_muon.py."""

from __future__ import annotations

import pytest
import torch

import rundir
from train import recipe as R
from train.build.checks import check_optimizer
from train.build.resume import check_resume
from train.muon import LaneMuon, newton_schulz, newton_schulz_flops
from train.recipe import model_config
from train.snapshot import record_launch

TINY = R.RECIPES / "tiny.toml"


def muon_pair(shape, steps=3, seed=0, **kwargs):
    """(LaneMuon's parameter, torch.optim.Muon's parameters, one per lane) after ``steps`` steps of the same
    gradients from the same weights."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) for _ in range(steps)]
    ours = torch.nn.Parameter(weight.clone())
    theirs = [torch.nn.Parameter(lane.clone()) for lane in weight]
    a, b = LaneMuon([ours], **kwargs), torch.optim.Muon(theirs, **kwargs)
    for grad in grads:
        ours.grad = grad.clone()
        for p, lane in zip(theirs, grad):
            p.grad = lane.clone()
        a.step()
        b.step()
    return ours, theirs, a, b


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(8, 16, 64), (8, 64, 16), (3, 24, 24)])  # wide, tall (transposed), square
def test_each_lane_is_torch_muon_on_its_slice(shape, adjust_lr_fn):
    """Three steps of LaneMuon on a [lanes, R, C] stack equal torch.optim.Muon run on each lane's [R, C] slice,
    weights and momentum, with both of torch's learning-rate adjustments that matter here and with and without
    Nesterov. Bitwise on this CPU; a GPU's batched bf16 kernels may round otherwise (DistMuon says as much)."""
    for nesterov in (True, False):
        kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
        ours, theirs, a, b = muon_pair(shape, **kwargs)
        for lane, p in enumerate(theirs):
            assert torch.equal(ours[lane], p), (lane, (ours[lane] - p).abs().max())
            assert torch.equal(a.state[ours]["momentum_buffer"][lane], b.state[p]["momentum_buffer"])
        assert not torch.equal(ours, muon_pair(shape, steps=0, **kwargs)[0])  # it moved


def test_a_2d_matrix_is_torch_muon():
    kwargs = dict(lr=0.01, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    ours, theirs, _, _ = muon_pair((1, 32, 48), **kwargs)
    g = torch.Generator().manual_seed(1)
    w, grads = torch.randn(32, 48, generator=g), [torch.randn(32, 48, generator=g) for _ in range(3)]
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    oa, ob = LaneMuon([a], **kwargs), torch.optim.Muon([b], **kwargs)
    for grad in grads:
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


def test_newton_schulz_flops_are_what_torch_counts():
    from torch.utils.flop_counter import FlopCounterMode

    for shape in [(8, 16, 64), (8, 64, 16), (24, 40)]:
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(*shape), ns_steps=5)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5), shape


def test_a_skipped_step_leaves_weights_and_momentum_as_they_were():
    """``found_inf`` (the spike guard's skip, as GuardedOptimizers passes it): 1 changes nothing, even with a
    non-finite gradient; 0 is the step without it, bit for bit."""
    ours, _, opt, _ = muon_pair((4, 8, 16), steps=2, lr=0.02)
    weight, momentum = ours.detach().clone(), opt.state[ours]["momentum_buffer"].clone()
    ours.grad = torch.full_like(ours, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(ours, weight) and torch.equal(opt.state[ours]["momentum_buffer"], momentum)
    grad = torch.randn_like(ours)
    plain = muon_pair((4, 8, 16), steps=2, lr=0.02)
    ours.grad, plain[0].grad = grad.clone(), grad.clone()
    opt.found_inf = torch.zeros(())
    opt.step()
    plain[2].step()
    assert torch.equal(ours, plain[0])


# ---- the recipe and the run's optimizer container ---------------------------------------------------------------


def test_a_bad_optimizer_name_is_refused_naming_file_and_field(tmp_path):
    with pytest.raises(R.RecipeError) as e:
        R.load("tiny", ['optimizer.name="sgd"'])
    assert str(e.value) == (f"--set optimizer.name=\"sgd\" (over {TINY}): [optimizer] name: must be one of "
                            "['adamw', 'muon'], got 'sgd'")
    recipe = tmp_path / "r.toml"
    recipe.write_text(TINY.read_text().replace("[optimizer]\n", '[optimizer]\nname = "Muon"\n'))
    with pytest.raises(R.RecipeError) as e:
        R.load(str(recipe))
    assert str(e.value) == f"{recipe}: [optimizer] name: must be one of ['adamw', 'muon'], got 'Muon'"
    with pytest.raises(R.RecipeError, match=r"\[optimizer\] adjust_lr_fn: must be one of \['original', "):
        R.load("tiny", ['optimizer.adjust_lr_fn="moonlight"'])
    assert R.load("tiny").optimizer.name == "adamw"  # the default
    assert 'name = "muon"' in R.to_toml(R.load("tiny", ['optimizer.name="muon"']))


def test_muon_trains_the_lane_weights_and_adamw_the_rest(tmp_path):
    """The run's container (GuardedOptimizers over train.build.config.param_groups, torchtitan's first-match
    patterns) on the tiny model: the 28 attention and MLP lane weights on LaneMuon, embeddings, head and norms
    on AdamW; the checkpointed state is one momentum for each of the first and two moments for the others."""
    from train.build.config import param_groups
    from train.titan import GuardedOptimizers

    recipe = R.load("tiny", ['optimizer.name="muon"'])
    model = model_config(recipe).build()
    model.init_states()
    optimizers = GuardedOptimizers(GuardedOptimizers.Config(param_groups=param_groups(recipe)), model_parts=[model])
    by_type = {type(o).__name__: [n for g in o.param_groups for n in g["param_names"]] for o in optimizers}
    assert sorted(by_type) == ["AdamW", "LaneMuon"]
    assert len(by_type["LaneMuon"]) == 28 and all(".attention.w" in n or ".feed_forward.w" in n
                                                  for n in by_type["LaneMuon"])
    assert {"tok_embeddings.weight", "lm_head.weight", "norm.weight"} <= set(by_type["AdamW"])
    model(torch.randint(0, 4096, (1, 16))).float().mean().backward()
    optimizers.skip = torch.zeros(())
    optimizers.step()
    state = optimizers.state_dict()
    assert "state.layers.0.attention.wq.weight.momentum_buffer" in state
    assert "state.layers.0.attention.wq.weight.exp_avg" not in state
    assert "state.lm_head.weight.exp_avg_sq" in state


def test_muon_params_must_pick_matrices():
    def problems(*sets):
        recipe = R.load("tiny", ['optimizer.name="muon"', *sets])
        return check_optimizer(recipe, model_config(recipe))

    assert problems() == []
    [none] = problems('optimizer.muon_params=["nothing"]')
    assert "[optimizer] muon_params: ['nothing'] match no parameter of the model" in none
    found = problems(r'optimizer.muon_params=["\\.attention\\.w", "norm\\.weight$"]')
    assert found and all("has shape" in line and "norm.weight" in line for line in found)
    with pytest.raises(R.RecipeError, match=r"\[optimizer\] muon_params\[0\]: '\(' is not a regular expression"):
        R.load("tiny", ['optimizer.muon_params=["("]'])


def test_another_optimizer_never_loads_this_ones_state(tmp_path):
    """A resume with another ``[optimizer] name`` is refused (its checkpoints hold the other's state), naming the
    key, the value and the file; an ``init_from`` of an AdamW run starts Muon fresh (``init_weights_only``, the
    default) and is refused when it would load the AdamW state into Muon."""
    run = tmp_path / "adamw"
    recipe = R.load("tiny", [f"run.output_dir={run}"])
    record_launch(recipe, model_config(recipe))
    rundir.step_dir(run, 100).mkdir(parents=True)
    (rundir.step_dir(run, 100) / ".metadata").write_bytes(b"")

    muon = R.load("tiny", [f"run.output_dir={run}", 'optimizer.name="muon"'])
    [refused] = check_resume(muon, model_config(muon))
    assert refused.startswith(f"--set optimizer.name=\"muon\" (over {TINY}): [optimizer] name: 'muon', but the "
                              f"checkpoints in {run} hold the state of 'adamw' ({run / 'recipe.toml'})")
    assert check_resume(R.load("tiny", [f"run.output_dir={run}"]), model_config(recipe)) == []

    def from_adamw(*sets):
        recipe = R.load("tiny", [f"run.output_dir={tmp_path / 'muon'}", 'optimizer.name="muon"',
                                 f"checkpoint.init_from={run}", *sets])
        return check_optimizer(recipe, model_config(recipe))

    assert from_adamw() == []
    [loads] = from_adamw("checkpoint.init_weights_only=false")
    assert loads.startswith("--set checkpoint.init_weights_only=false") and "trained 'adamw'" in loads


# ---- the planner ------------------------------------------------------------------------------------------------


def test_the_plan_counts_muons_one_buffer_and_its_newton_schulz():
    """tiny on 2 GPUs (whole lanes on each) and, for the roofline, 16 (lane weights split on dim 1): Muon's
    state is one fp32 momentum where AdamW holds two moments (the difference: 4 bytes for each Muon parameter
    over 2 GPUs), and its Newton–Schulz has FLOPs and time."""
    from plan import GPUS, Shape, make_plan
    from plan.comm import cluster_for
    from plan.roofline import roofline

    plans = {name: make_plan(R.load("tiny", [f'optimizer.name="{name}"']), gpus=2, gpu="h100",
                             cluster=cluster_for("h100"), with_compiled=False, with_dense=False, with_lengths=False)
             for name in ("adamw", "muon")}
    adamw, muon = plans["adamw"], plans["muon"]
    assert adamw.lanes.muon is None and muon.lanes.muon is not None
    work = muon.lanes.muon
    assert work.matrices == 28 and work.local == 28 and work.gathered_bytes == 0
    assert adamw.memory.optimizer_state - muon.memory.optimizer_state == pytest.approx(4 * work.numel / 2, rel=0.01)
    assert work.flops > 0 and 0 < work.seconds < muon.lanes.optimizer_s
    lines = "\n".join(muon.lines())
    assert "optimizer: muon (one fp32 momentum per muon_params parameter" in lines
    assert "Muon per GPU per step: Newton–Schulz" in lines and "no communication" in lines
    assert "optimizer: adamw (fused AdamW, two fp32 moments per parameter)" in "\n".join(adamw.lines())
    assert muon.to_json()["optimizer"]["newton_schulz"]["flops"] == work.flops

    recipe = R.load("tiny", ['optimizer.name="muon"'])
    wide = roofline(model_config(recipe), Shape.of(recipe, 16), GPUS["h100"]).muon
    assert wide.local == 0 and wide.gathered_bytes > 0 and wide.flops == 2 * work.flops  # every lane, not half
