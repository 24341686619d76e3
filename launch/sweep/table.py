"""What a sweep prints about its variants: the grid, and for a dry run with ``--gpus`` each variant's plan
(memory, roofline, GPU-hours) as ``train.py --plan`` computes it."""

from __future__ import annotations

from launch.sweep.spec import Sweep, Variant, value_text
from rundir.table import text_table
from train import recipe as R
from plan.gpus import GPUS


def grid_lines(sweep: Sweep, found: list[Variant]) -> list[str]:
    """A row per variant: its name and the value of every axis, as the run resolves it."""
    return text_table(["variant", *sweep.axes], [[v.name, *(value_text(v.values[k]) for k in sweep.axes)]
                                                 for v in found])


def plan_lines(found: list[Variant], sweep: Sweep, gpus: int, gpu: str) -> list[str]:
    """Per variant: plan's memory and roofline (with communication) on ``gpus`` x ``gpu``, as
    ``train.py --plan`` computes them; GPU-hours = tokens / (tokens/s/GPU) / 3600 per run."""
    from plan import GIB, make_plan

    rows, total, planned = [], 0.0, 0
    for v in found:
        try:
            if v.config is None:  # the model's own checks failed: nothing to trace
                raise R.RecipeError("its model does not build")
            p = make_plan(v.recipe, gpus=gpus, gpu=gpu, with_compiled=False, with_dense=False)
        except (R.RecipeError, ValueError) as e:
            rows.append([v.name, *"------", f"not planned: {str(e).splitlines()[0][:200]}"])
            continue
        tps, tokens = p.comm.tokens_per_s, v.recipe.training.total_tokens
        hours = tokens / tps / 3600
        total, planned = total + hours * len(sweep.seeds), planned + len(sweep.seeds)
        rows.append([v.name, f"{p.nparams:,}", f"{p.memory.peak / GIB:.1f}", "yes" if p.fits else "NO",
                     f"{tps:,.0f}", f"{p.comm.mfu:.1%}", f"{tokens:,}", f"{hours:,.2f}"])
    label = GPUS[gpu].label
    return [f"plan per run on {gpus} x {label} (plan, as train.py --plan: one step traced on fake tensors; "
            "eager roofline with communication):",
            *text_table(["variant", "parameters", "peak GiB", "fits", "tokens/s/GPU", "MFU", "tokens", "GPU-hours"],
                        rows),
            f"sweep total: {planned} runs, {total:,.1f} GPU-hours at the roofline ({total / gpus:,.1f} h on {gpus} x "
            f"{label}, a run at a time). The roofline bounds speed from above: Kog measured ~17k tokens/s/H100 on "
            "the 2B where the plan says 32.6k (README), so budget about twice this"]
