"""Train a Laneformer from a TOML recipe: ``torchrun train.py --recipe phase1.toml``.

A bare recipe name is looked up in ``recipes/``. Restarting the same command
resumes from the latest complete checkpoint in the run dir. With no
``--recipe`` the tiny CPU recipe on the bundled sample data runs.

    python train.py --recipe X --print-config   # the resolved recipe
    python train.py --recipe X --dry-run        # model on meta: size, steps, FLOPs, wall time

Exit codes: 0 done; 2 recipe error (nothing started); 75 (``PREEMPTED``)
checkpointed on SIGUSR1, run the same command again to resume.
"""

import argparse
import os
import sys

from train.cpu import use_cpu_if_no_gpu

use_cpu_if_no_gpu()  # before torchtitan builds anything

from train.preemption import PREEMPTED, Preempted, catch_signals, note_exit  # noqa: E402

catch_signals()  # as early as possible: an uncaught SIGUSR1 kills a rank without a checkpoint

import torch  # noqa: E402

from train import recipe as R  # noqa: E402

DEFAULT_RECIPE = "tiny.toml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe file, or a name in recipes/")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="override a recipe value (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--dry-run", action="store_true", help="validate and estimate, build nothing real")
    p.add_argument("--gpus", type=int, default=192, help="dry run: GPUs for the wall-time estimate")
    p.add_argument("--mfu", type=float, default=0.40, help="dry run: assumed model FLOPs utilization")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dry run: peak bf16 TFLOP/s per GPU (H100 SXM: 989)")
    return p.parse_args(argv)


def dry_run(recipe: R.Recipe, args) -> str:
    from train.build import check_data, model_config, source_specs

    config = model_config(recipe)
    with torch.device("meta"):
        model = config.build()
    t = recipe.training
    nparams, flops = config.get_nparams_and_flops(model, t.seq_len)
    seconds = t.total_tokens * flops / (args.mfu * args.peak_tflops * 1e12 * args.gpus)
    lines = [
        f"recipe: {recipe.path}",
        f"model: {recipe.model.flavor}, parameters: {nparams:,}",
        f"tokens per step: {recipe.tokens_per_step:,} ({t.global_batch} x {t.seq_len})",
        f"steps: {t.steps:,}  total tokens: {t.total_tokens:,}",
        f"FLOPs per token: {flops:,} ({flops / 1e9:.2f} GFLOP)",
        f"expected wall time: {seconds / 86400:.1f} days on {args.gpus} GPUs at {args.mfu:.0%} MFU "
        f"of {args.peak_tflops:g} TFLOP/s ({t.total_tokens / seconds / args.gpus:,.0f} tokens/s/GPU)",
        f"run dir: {recipe.output_dir}",
    ]
    missing = [s["path"] for s in source_specs(recipe) if not os.path.exists(s["path"])]
    if missing:
        lines.append(f"data: not checked, not on this machine: {', '.join(missing)}")
    else:
        lines.append(check_data(recipe, config).describe())
    return "\n".join(lines)


def check_before_start(recipe: R.Recipe, world_size: int):
    """Everything that can be wrong with a recipe, found before any process group or model exists."""
    from train.build import check_data, model_config

    R.check_world(recipe, world_size)
    config = model_config(recipe)
    if recipe.training.seq_len > config.max_seq_len:
        raise R.RecipeError(f"{recipe.path}: [training] seq_len {recipe.training.seq_len} exceeds "
                            f"the model's max_seq_len {config.max_seq_len}")
    if not recipe.data.sources:
        raise R.RecipeError(f"{recipe.path}: [data] needs at least one [[data.sources]]")
    check_data(recipe, config)
    return config


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        recipe = R.load(args.recipe, args.set)
        if args.print_config:
            print(R.to_toml(recipe), end="")
            return 0
        if args.dry_run:
            print(dry_run(recipe, args))
            return 0
        model_config = check_before_start(recipe, int(os.environ.get("WORLD_SIZE", 1)))
    except (R.RecipeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        note_exit(2, "recipe error", message=str(e))
        return 2

    from torchtitan.tools.logging import init_logger

    from train.build import trainer_config
    from train.run_dir import record_launch

    init_logger()
    if int(os.environ.get("RANK", 0)) == 0:
        record_launch(recipe, model_config)
    trainer = trainer_config(recipe).build()
    try:
        trainer.train()
    except Preempted as p:  # checkpointed; the launcher runs us again
        note_exit(PREEMPTED, "preempted", step=p.step)
        return PREEMPTED
    except Exception as e:
        note_exit(1, "error", message=f"{type(e).__name__}: {e}")
        raise
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    note_exit(0, "finished", step=trainer.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
