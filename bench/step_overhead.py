"""The project's training step over torchtitan's bare step: same model, batch and optimizer.

Why: everything train/ adds to a step (the on-device step guard and its
skip-through-``found_inf`` AdamW, the loss all-reduce, the callbacks, the metrics
file) must cost close to nothing. Both trainers are built in this process from
the same recipe; the bare one is torchtitan's own ``Trainer`` with the plain
``OptimizersContainer`` (fused AdamW, the same clipping) and nothing else. Steps
are interleaved and are not logging steps. This is the one benchmark of
train/'s own code, so unlike the others it imports train/.

    .venv/bin/python -m bench.step_overhead [--seq 128] [--batch 8] [--steps 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tempfile

from bench import common


def _one_rank_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(k, v)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny.toml")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)

    _one_rank_env()
    from train.cpu import use_cpu_if_no_gpu

    use_cpu_if_no_gpu()
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    from train import recipe as R
    from train.build import trainer_config

    init_logger()
    out = tempfile.mkdtemp(prefix="step_overhead-")
    total = args.warmup + args.steps + 2  # never reached: no last-step save, eval or export
    recipe = R.load(args.recipe, [
        f"run.output_dir={out}", f"training.steps={total}", f"training.seq_len={args.seq}",
        f"training.global_batch={args.batch}", f"training.micro_batch={args.batch}",
        f"logging.interval={total}", "logging.tensorboard=false", 'logging.wandb_mode="disabled"',
        "schedule.warmup_steps=1", "schedule.decay_fraction=0.1", f"checkpoint.interval={total}",
        "eval.at_end=false"])
    ours = trainer_config(recipe)
    bare = Trainer.Config(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(Trainer.Config) if f.init})
    bare.optimizer = OptimizersContainer.Config(param_groups=ours.optimizer.param_groups,
                                                implementation=ours.optimizer.implementation)
    bare.checkpoint = CheckpointManager.Config(enable=False)
    bare.dump_folder = os.path.join(out, "bare")

    def stepper(trainer):
        batches = trainer.batch_generator(trainer.dataloader)

        def step():
            trainer.step += 1
            trainer.train_step(batches)

        return step

    trainers = {"project": ours.build(), "torchtitan": bare.build()}
    t = common.time_interleaved({k: stepper(v) for k, v in trainers.items()}, args.warmup, args.steps)
    for trainer in trainers.values():
        trainer.close()
    tokens = args.batch * args.seq
    rows = [{"step": k, "s/step": f"{common.fastest(v):.4f}", "tok/s": f"{tokens / common.fastest(v):,.0f}"}
            for k, v in t.items()]
    print(f"project step vs bare torchtitan step, {args.recipe} model: seq {args.seq}, batch {args.batch}, "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; s/step: fastest step; "
          "ratio: median of the per-round ratios")
    print(common.table(rows, ["step", "s/step", "tok/s"]))
    ratio = common.paired_ratio(t["project"], t["torchtitan"])
    print(f"RATIO project/torchtitan step time: {ratio:.3f}x")
    return {"ratio": ratio, "rows": rows}


if __name__ == "__main__":
    main()
