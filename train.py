"""Train a Laneformer from a TOML recipe: ``torchrun train.py --recipe phase1.toml``.

A bare recipe name is looked up in ``recipes/``. Restarting the same command
resumes from the latest complete checkpoint in the run dir. With no
``--recipe`` the tiny CPU recipe on the bundled sample data runs.

    python train.py --recipe X --print-config   # the resolved recipe
    python train.py --recipe X --dry-run        # model on meta: size, steps, FLOPs, wall time, data
    python train.py --recipe X --plan [--gpus N --gpu h100 --sweep --ops --json --plot FILE]   # memory per GPU, rooflines

Before anything is written, every check runs (``train.build.preflight``): the
recipe's types and values, ``[model]`` overrides against the model, the
tokenizer, the data, ``checkpoint.init_from``, writable run and export dirs.
``--dry-run`` runs the same checks after printing the plan, and exits as a
launch would.

Exit codes (``health.exits.Exit``): 0 done; 2 recipe error (nothing started,
nothing written; also a run dir that another launch's live ranks hold: ``health.holder``); 75 (``PREEMPTED``) checkpointed on SIGUSR1, run the same
command again to resume; 3 training complete but the export failed (the retry
command is printed); 4 too many consecutive skipped steps; 5 no space for a
checkpoint in the run dir; 6 replica mismatch (HSDP copies of a shard differ:
nothing saved; requeued from the latest verified checkpoint). 3, 4 and 5 are
final: not requeued.
"""

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path

from health.holder import claim, die_with_parent

die_with_parent()  # first: under torchrun, a rank dies with its agent (a SIGKILLed torchrun leaves no orphan training)

from health.exits import Exit, StopRun, note_exit
from health.preemption import Preempted, catch_signals

catch_signals()  # as early as possible: an uncaught SIGUSR1 kills a rank without a checkpoint

from train.titan import use_cpu_if_no_gpu  # torchtitan's import: seconds, after the signals

use_cpu_if_no_gpu()  # before torchtitan builds anything

import torch

import rundir
from train import recipe as R
from plan.gpus import GPUS

DEFAULT_RECIPE = "tiny.toml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe file, or a name in recipes/")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="override a recipe value (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--dry-run", action="store_true", help="validate and estimate, build nothing real")
    p.add_argument("--run", type=Path, help="dry run: the run dir whose realized data mix to show "
                   "(default: the recipe's)")
    p.add_argument("--plan", action="store_true",
                   help="memory per GPU, eager and compiled roofline speed on --gpus GPUs of kind --gpu (plan/)")
    p.add_argument("--gpu", default="h100", choices=list(GPUS), help="plan: the GPU kind")
    p.add_argument("--sweep", action="store_true", help="plan: also micro batch x activation checkpointing")
    p.add_argument("--ops", action="store_true", help="plan: also one layer's per-op roofline, lanes vs dense")
    p.add_argument("--compiled", action="store_true", help="plan --ops: also the compiled estimate's per-kernel table, lanes vs dense")
    p.add_argument("--json", action="store_true", help="plan: print the numbers as one JSON object")
    p.add_argument("--plot", type=Path, metavar="FILE", help="plan: also draw the memory per GPU as a stacked bar "
                   "(parameters, gradients, optimizer, activations, temporaries against the GPU's memory), a PNG")
    p.add_argument("--gpus", type=int, help="dry run and plan: GPUs for the estimates and the layout and batch checks "
                   "(default: the recipe's [parallel] gpus, 192 for phase 1; a CPU recipe's dry run checks this "
                   "launch's ranks)")
    p.add_argument("--cluster", help="plan: the cluster preset for communication, h100-ib400 or a100-ib200 "
                   "(default: the --gpu kind's; plan/comm.py)")
    p.add_argument("--gpus-per-node", type=int, help="plan: GPUs per node (default: the cluster's)")
    p.add_argument("--intra-node-gbs", type=float, help="plan: NCCL bus bandwidth inside a node, GB/s")
    p.add_argument("--network-gbs", type=float, help="plan: NCCL bus bandwidth per GPU across nodes, GB/s")
    p.add_argument("--mfu", type=float, default=0.40, help="dry run: assumed model FLOPs utilization "
                   "(Kog reported ~28%% for the 2B on 192 H100s)")
    p.add_argument("--peak-tflops", type=float, default=GPUS["h100"].tflops["bfloat16"],
                   help="dry run: peak bf16 TFLOP/s per GPU (default: the H100's, plan/gpus.py)")
    return p.parse_args(argv)


def run_summary(recipe: R.Recipe, recipe_arg: str, sets: list[str]) -> str:
    """What a finished run prints (``make train``): where the run is, how it ended, what next."""
    run = Path(recipe.output_dir)
    out = recipe.export_dir
    loss = rundir.last_logged(run, "loss_metrics/global_avg_loss")
    from train.metric_names import VAL_LOSS

    val = (rundir.latest_evals(run) or {}).get(VAL_LOSS)
    again = shlex.join(["python", "train.py", "--recipe", recipe_arg, *(f"--set={s}" for s in sets)])
    e, fetch = recipe.eval, []
    if e.evalplus:  # an SFT run: Kog's two code benchmarks
        tasks = ["--evalplus", "humaneval,mbpp", *(["--chat"] if e.evalplus_chat else [])]
    else:
        tasks = ["--core", e.core_bundle or "core_bundle", "--max-per-task", "100"]
        if not e.core_bundle:
            fetch = ["  (get the CORE bundle once: python -m eval.core_data fetch core_bundle)"]
    return "\n".join([
        f"run dir: {run}",
        f"final loss: {loss[1]:.4f} at step {loss[0]}" if loss else "final loss: not logged",
        *([f"validation loss: {val:.4f}"] if val is not None else []),
        "next:",
        f"  export:   written to {out}" if recipe.checkpoint.export_hf else
        f"  export:   python -m models.laneformer.convert to-hf {shlex.quote(str(run))} {shlex.quote(str(out))}",
        f"  evaluate: {shlex.join(['python', '-m', 'eval.run', '--checkpoint', str(out), *tasks])}",
        *fetch,
        f"  resume (after a stop) or train longer: {again} [--set training.steps=N]",
        report_line(run, recipe.logging.report),
    ])


def report_line(run: Path, written: bool = True) -> str:
    """Where the run's report is (train.callbacks.report writes it at the end), or why it is not."""
    from rundir import REPORT_LOG, REPORT_PAGE, report_dir

    if not written:
        return f"report: off ([logging] report = false); draw it with python -m report {shlex.quote(str(run))}"
    page = report_dir(run) / REPORT_PAGE
    return f"report: {page}" if page.exists() else f"report: not written (see {report_dir(run) / REPORT_LOG})"


def as_one_rank() -> str | None:
    """Plain ``python train.py`` runs as the one rank of ``torchrun --nproc-per-node 1`` would: torchtitan
    needs torchrun's environment (LOCAL_RANK, a rendezvous address), so give it that, on a free port.
    Returns why it cannot: several SLURM tasks without torchrun would each train alone in one run dir."""
    if "RANK" in os.environ:  # started by torchrun (or SLURM through it): its world stands
        return None
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return (f"{os.environ['SLURM_NTASKS']} SLURM tasks started train.py without torchrun; each would train "
                "alone in the same run dir. Use python -m launch.slurm submit (a torchrun agent per node)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    recipe, checked, problems = None, None, []
    try:
        recipe = R.load(args.recipe, args.set)
        if args.print_config:
            print(R.to_toml(recipe), end="")
            return Exit.DONE
        gpus = args.gpus or recipe.parallel.gpus  # 0: a CPU recipe, no GPU estimate
        if args.plan:
            import json

            from plan import make_plan
            from plan.comm import cluster_for

            cluster = cluster_for(args.gpu, args.cluster, gpus_per_node=args.gpus_per_node,
                                  intra_node_gbs=args.intra_node_gbs, network_gbs=args.network_gbs)
            gpus = gpus or 1
            p = make_plan(recipe, gpus=gpus, gpu=args.gpu, with_sweep=args.sweep, with_ops=args.ops,
                          with_kernels=args.compiled, cluster=cluster)
            print(json.dumps(p.to_json(), indent=1) if args.json else "\n".join(p.lines()))
            if args.plot:
                from report.memory import plot_memory

                plot_memory(p.memory, args.plot, title=f"{recipe.model.flavor} on {gpus} x {p.gpu.label}, "
                            f"micro batch {p.shape.micro_batch}, AC {p.shape.ac}")
                print(f"memory plot: {args.plot}", file=sys.stderr)
            return Exit.DONE
        from train.build import preflight, world_size  # torchtitan's configs: seconds to import, not needed above

        # A launch checks its own world; a dry run outside torchrun, the GPUs it plans for.
        world = world_size() if "WORLD_SIZE" in os.environ or not args.dry_run else gpus or 1
        checked = preflight(recipe, world)
        problems = checked.problems
    except R.RecipeError as e:
        problems = str(e).splitlines()
    if args.dry_run and recipe is not None:
        from plan import dry_run

        try:  # the plan, as far as it can be made; then the same verdict as a launch
            print(dry_run(recipe, gpus=gpus, mfu=args.mfu, peak_tflops=args.peak_tflops, run_dir=args.run))
        except (R.RecipeError, ValueError, OSError) as e:
            problems = problems or [str(e)]  # preflight reports what stops the plan
    if problems:
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        full = checked is not None and checked.no_space and len(problems) == 1  # only the disk is wrong
        code = Exit.NO_SPACE if full else Exit.BAD_INPUT
        note_exit(code, message="\n".join(problems))
        return code
    if args.dry_run:
        print("checks: all passed; a launch would start")
        return Exit.DONE

    from torchtitan.tools.logging import init_logger

    from train.build import trainer_config, wandb_env
    from train.snapshot import record_launch

    if alone := as_one_rank():  # before anything is written
        print(f"error: {alone}", file=sys.stderr)
        return Exit.BAD_INPUT
    quiet = int(os.environ["RANK"]) != 0  # rank 0 says that it took a stale holder's run dir over
    if held := claim(recipe.output_dir, recipe.launch, say=(lambda _: None) if quiet else None):
        print(f"error: {held}", file=sys.stderr)  # every rank reads the same heartbeats: all exit alike
        return Exit.BAD_INPUT
    init_logger()
    for name, value in wandb_env(recipe).items():
        os.environ.setdefault(name, value)
    if int(os.environ.get("RANK", 0)) == 0:
        record_launch(recipe, checked.config)
    trainer = trainer_config(recipe, world).build()
    try:
        trainer.train()
    except Preempted as p:  # checkpointed; the launcher runs us again
        note_exit(Exit.PREEMPTED, step=p.step)
        return Exit.PREEMPTED
    except StopRun as s:  # export failed, too many skipped steps, no space: not requeued
        print(f"error: {s}", file=sys.stderr)
        note_exit(s.code, **s.details)
        return s.code
    except Exception as e:
        note_exit(Exit.CRASH, message=f"{type(e).__name__}: {e}")
        raise
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    note_exit(Exit.DONE, step=trainer.step)
    if int(os.environ.get("RANK", 0)) == 0:
        print(run_summary(recipe, args.recipe, args.set))
    return Exit.DONE


if __name__ == "__main__":
    sys.exit(main())
