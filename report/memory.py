"""The memory plan, drawn and recorded: the stacked bar of ``train.py --plan --plot FILE``,
and ``<run>/plan.json``, the plan's peak that the report's memory figure draws against.

The plan traces one step on fake tensors (``plan.memory``): seconds for a tiny
model, minutes for the 2B. So the report never traces by itself: ``python -m
report RUN --plan-gpu KIND --gpus N`` does it once and leaves ``plan.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from rundir import PLAN_FILE, RECIPE_FILE

GIB = 1024**3
# The bar's parts, from FSDPMemTracker's kinds at the peak.
PARTS = {
    "parameters": ("Sharded Param", "Unsharded Param"),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "optimizer": ("OptState",),
    "activations": ("Activation",),
    "temporaries": ("Temp",),
    "communication buffers, inputs": ("All Gather", "Reduce Scatter", "Inputs", "Buffer"),
}


def plan_parts(memory) -> dict[str, float]:
    """GiB per part of a ``plan.Memory`` at its peak."""
    return {name: sum(memory.parts.get(k, 0) for k in kinds) / GIB for name, kinds in PARTS.items()}


def plot_memory(memory, path: Path, title: str = "") -> Figure:
    """A stacked bar of the plan's peak per GPU by part (``PARTS``), against the GPU's memory
    and the fraction a plan may use, saved to ``path``."""
    from plan import FIT_FRACTION

    parts = plan_parts(memory)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    bottom = 0.0
    for i, (name, gib) in enumerate(parts.items()):
        ax.bar([0], [gib], bottom=bottom, width=0.5, label=f"{name} {gib:.2f} GiB", color=f"C{i}")
        bottom += gib
    total = memory.gpu.memory_gib
    ax.axhline(total, color="black", linewidth=1.5, label=f"{memory.gpu.label}: {total:.1f} GiB")
    ax.axhline(FIT_FRACTION * total, color="black", linestyle="--", linewidth=1,
               label=f"fits below {FIT_FRACTION:.0%}")
    ax.set_xticks([0], [f"peak {memory.peak / GIB:.2f} GiB ({'fits' if memory.fits else 'does not fit'})"])
    ax.set_xlim(-1, 1)
    ax.set_ylabel("GiB per GPU")
    ax.set_ylim(0, max(total, memory.peak / GIB) * 1.08)
    fig.legend(fontsize=8, loc="outside right upper")
    ax.set_title(title or "memory per GPU at the peak of one training step", fontsize=9)
    fig.savefig(path, dpi=90)
    return fig


def record_plan(run: Path, gpu: str, gpus: int) -> dict:
    """Trace the run's recipe on ``gpus`` GPUs of kind ``gpu`` and write ``<run>/plan.json``."""
    from train import recipe as R
    from train.recipe import model_config
    from plan import GPUS, Shape, memory_plan
    from plan.comm import Layout

    recipe = R.load(str(Path(run) / RECIPE_FILE))
    R.check_world(recipe, gpus)
    memory = memory_plan(model_config(recipe), Shape.of(recipe, Layout.of(recipe, gpus).shard), GPUS[gpu])
    out = {"gpu": GPUS[gpu].label, "gpus": gpus, "memory": memory.to_json()}
    (Path(run) / PLAN_FILE).write_text(json.dumps(out, indent=2) + "\n")
    return out
