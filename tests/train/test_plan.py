"""plan/: the dry-run report, the fake-tensor memory plan and the roofline.

References: the analytic bytes of FSDP's sharded state (fp32 params, fp32
grads, two fp32 AdamW moments: 16 B per parameter over N ranks), the
linearity of activations in the micro batch, the order of the AC policies, and
the exact line formats that tools (bench/gpu_check.py, launch.slurm) read.
(The 2B's dry run is checked in test_train.py; the realized mix of a run there too.)
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest

from rundir import REPO
from tests.conftest import env
import plan as P
from train import recipe as R
from train.recipe import model_config


@pytest.fixture(scope="module")
def tiny():
    recipe = R.load("tiny.toml")
    return recipe, model_config(recipe)


def test_sharded_params_grads_and_adamw_state_are_16_bytes_per_parameter_over_n(tiny):
    recipe, config = tiny
    with __import__("torch").device("meta"):
        nparams = sum(p.numel() for p in config.build().parameters())
    for gpus in (2, 4, 16):  # 16 > 8 lanes: lane weights sharded on dim 1, no padding
        memory = P.memory_plan(config, P.Shape.of(recipe, gpus, micro_batch=1, ac="none"), P.GPUS["h100"])
        assert memory.state == pytest.approx(16 * nparams / gpus, rel=0.02)


def test_activations_grow_linearly_with_the_micro_batch_and_full_ac_saves_most(tiny):
    recipe, config = tiny
    act = {}
    for ac in P.AC_MODES:
        plans = P.memory_plans(config, P.Shape.of(recipe, 2, ac=ac), P.GPUS["h100"], (1, 2, 4))
        act[ac] = {mb: m.parts["Activation"] for mb, m in plans.items()}
        assert plans[4].peak > plans[2].peak > plans[1].peak
    for mb in (1, 2, 4):  # no AC holds everything; selective recomputes some; full keeps block inputs only
        assert act["full"][mb] < act["selective"][mb] < act["none"][mb]
    for ac in ("none", "selective"):
        a = act[ac]
        assert a[1] > 0 and a[4] - a[2] == pytest.approx(2 * (a[2] - a[1]), rel=0.02)
        assert a[2] == pytest.approx(2 * a[1], rel=0.02)


def test_the_stand_in_attention_is_charged_the_flops_of_its_visible_pairs():
    assert P._visible_pairs(8, 0) == 36  # causal: 1 + 2 + ... + 8
    assert P._visible_pairs(8, 3) == 1 + 2 + 3 * 6  # sliding window of 3
    assert P._visible_pairs(4, 16) == 10  # a window longer than the sequence is causal


def test_the_roofline_optimizer_shard_follows_fsdps_placement():
    """Beyond 8 GPUs lane weights split on dim 1 (parallelize.lane_placement), so each GPU's
    optimizer shard is 1/N of a lane weight, not the 1/8 a dim-0 split would leave it."""
    import torch

    from models.laneformer.parallelize import lane_placement

    lane_weight, norm = torch.empty(8, 384, 3072, device="meta"), torch.empty(3072, device="meta")
    assert P._shard_dim(lane_placement(8, 192), lane_weight) == 1
    assert P._shard_numel(lane_weight, 1, 192) == 2 * 8 * 3072 == lane_weight.numel() // 192
    assert P._shard_dim(lane_placement(8, 8), lane_weight) == 0  # up to 8 GPUs: a lane each
    assert P._shard_numel(lane_weight, 0, 8) == lane_weight.numel() // 8
    assert P._shard_dim(lane_placement(8, 192), norm) == 0
    assert P._shard_numel(norm, 0, 192) == 16  # ceil(3072 / 192), padded as FSDP pads


def tiny_plan(**flags):
    """What ``train.py --recipe tiny.toml --plan --gpus 2 --gpu h200 [flags]`` prints, made in this process
    (train.py's plan branch): the compiled layers are traced once for both tests that read them, and no
    process start imports torch again. The CLI itself prints a plan in tests/test_readme_commands.py."""
    from plan import make_plan
    from plan.comm import cluster_for

    return make_plan(R.load("tiny.toml"), gpus=2, gpu="h200", cluster=cluster_for("h200"), **flags)


@pytest.fixture(scope="module")
def text_plan() -> str:
    """The tiny recipe's whole plan as text (``--ops --compiled --sweep``), made once for the tests that read it."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        text = "\n".join(tiny_plan(with_sweep=True, with_ops=True, with_kernels=True).lines())
    # the sweep's traces take minutes for the 2B: it says how far it is, on stderr (stdout stays the plan)
    assert re.search(r"^plan --sweep: shard degree x AC traced: 100% ", err.getvalue(), re.M), err.getvalue()[-2000:]
    return text


def test_a_tiny_plan_prints_every_line_tools_read(text_plan):
    out = text_plan
    peak = re.search(r"^peak memory per GPU: ([\d.]+) GiB of ([\d.]+) GiB \((fits|does not fit)\)$", out, re.M)
    assert peak and peak.group(3) == "fits" and float(peak.group(2)) == pytest.approx(140.4, abs=0.1)
    for pattern in (r"^sharded params\+grads\+optimizer per GPU: [\d.]+ GiB$", r"^activations per GPU: [\d.]+ GiB$",
                    r"^temporaries per GPU: [\d.]+ GiB$", r"^all-gather buffers per GPU: [\d.]+ GiB$",
                    r"^reduce-scatter buffers per GPU: [\d.]+ GiB$",
                    r"^roofline: [\d,]+ tokens/s/GPU, MFU [\d.]+% \(estimate: eager ops, compute and memory "
                    r"traffic only, no communication, no compile fusion\)$",
                    r"^dense twin roofline: [\d,]+ tokens/s/GPU, MFU [\d.]+%",
                    r"^lanes/dense roofline step ratio: [\d.]+",
                    r"stand-in that saves what flex attention saves \(q, k, v, output, logsumexp\)",
                    r"^per-op roofline of layer 2",
                    r"^compiled roofline: [\d,]+ tokens/s/GPU, MFU [\d.]+% \(estimate: Inductor's fused kernels .*"
                    r"ignores communication",
                    r"^lanes/dense compiled roofline step ratio: [\d.]+$",
                    r"^compiled kernels of layer 2, one micro batch",
                    r"^in passes over one lane-wide tensor",
                    r"^recommended: micro batch \d+, activation checkpointing (none|selective|full) .*"
                    r"gradient accumulation \d+ keeps 16 sequences per step on 2 GPUs$"):
        assert re.search(pattern, out, re.M), pattern
    sweep = out[out.index("sweep on 2 x"):]
    assert len(re.findall(r"^(none|selective|full) +(1|2|4|8|16) ", sweep, re.M)) == 15


def test_dry_run_refuses_a_plan_beyond_max_epochs():
    result = subprocess.run([sys.executable, "train.py", "--recipe", "tiny.toml", "--dry-run",
                             "--set", "training.steps=5000"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "prose (" in result.stderr and "epochs > max_epochs=4.0" in result.stderr


def test_plan_json_carries_the_numbers_of_the_text(text_plan):
    """``--json`` alone (no tables, no sweep) gives the numbers of the whole text plan."""
    plan = json.loads(json.dumps(tiny_plan().to_json(), indent=1))  # as --json prints it
    peak = re.search(r"^peak memory per GPU: ([\d.]+) GiB", text_plan, re.M)
    assert plan["memory"]["peak_gib"] == pytest.approx(float(peak.group(1)), abs=0.006)
    for key, label in (("roofline", "roofline"), ("compiled", "compiled roofline")):
        tps = re.search(rf"^{label}: ([\d,]+) tokens/s/GPU", text_plan, re.M).group(1)
        speed = plan[key] if key == "roofline" else plan[key]["roofline"]
        assert round(speed["tokens_per_s"]) == int(tps.replace(",", ""))
    ratio = re.search(r"^lanes/dense compiled roofline step ratio: ([\d.]+)$", text_plan, re.M).group(1)
    assert plan["compiled"]["lanes_dense_ratio"] == pytest.approx(float(ratio), abs=0.006)


@pytest.mark.parametrize("dense", [False, True], ids=["lanes", "dense"])
def test_the_compiled_estimate_sees_every_matmul_of_forward_and_backward(tiny, dense):
    """Inductor's kernels of one layer carry 2 x 3 x (layer weights) FLOPs per token in their matmuls
    (forward, input and weight gradients) and the flex kernel's FLOPs for attention."""
    import torch

    from plan import compiled

    recipe, config = tiny
    shape = P.Shape.of(recipe, 2, micro_batch=2, seq_len=64)
    layer = config.n_layers // 2
    kernels = compiled._layer_kernels(config, layer, shape, dense)
    with torch.device("meta"):
        block = config.layer_config(layer).build()
    weights = sum(p.numel() for name, p in block.named_parameters() if "norm" not in name)
    tokens = shape.micro_batch * shape.seq_len
    assert sum(k.flops for k in kernels if k.kind == "extern") == 6 * weights * tokens
    pairs = P._visible_pairs(shape.seq_len, config.window_of(layer) or 0)
    attention = 2 * 2 * shape.micro_batch * config.n_heads * config.head_dim * pairs
    assert sum(k.flops for k in kernels if k.kind == "attention") == attention * (1 + 5 / 2)
