"""The project's training step over torchtitan's bare step: same model, batch and optimizer.

Why: everything train/ adds to a step (the on-device step guard and its
skip-through-``found_inf`` AdamW, the loss all-reduce, the callbacks, the metrics
file) must cost close to nothing. Both trainers are built in this process from
the same recipe; the bare one is torchtitan's own ``Trainer`` with the plain
``OptimizersContainer`` (fused AdamW, the same clipping) and nothing else. Each
round runs both loops (``train()``, the project's own and torchtitan's) for the
same steps, none a logging step, from freshly built trainers, in alternating
order; the ratio is the median over rounds of the two runs' times. torchtitan's
loop ends with a 2 s sleep on rank 0 (its ``Trainer.train``), which the project's
replaces by a barrier: the ratio counts it, so use enough steps. This is the
one benchmark of train/'s own code, so unlike the others it imports train/.

    .venv/bin/python -m bench.step_overhead [--seq 128] [--batch 8] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import tempfile
import time

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
    p.add_argument("--steps", type=int, default=10, help="steps of each run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each loop, alternating")
    args = p.parse_args(argv)

    _one_rank_env()
    from train.titan import use_cpu_if_no_gpu

    use_cpu_if_no_gpu()
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    from train import recipe as R
    from train.build import trainer_config

    init_logger()
    out = tempfile.mkdtemp(prefix="step_overhead-")
    total = args.steps  # the last step saves nothing: checkpoints are off in both
    recipe = R.load(args.recipe, [
        f"run.output_dir={out}", f"training.steps={total}", f"training.seq_len={args.seq}",
        f"training.global_batch={args.batch}", f"training.micro_batch={args.batch}",
        f"logging.interval={total}", "logging.tensorboard=false", 'logging.wandb_mode="disabled"',
        "schedule.warmup_steps=1", "schedule.decay_fraction=0.1", f"checkpoint.interval={total}",
        "eval.at_end=false"])
    ours = trainer_config(recipe, 1)  # one rank (_one_rank_env)
    ours.checkpoint = dataclasses.replace(ours.checkpoint, enable=False)
    bare = Trainer.Config(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(Trainer.Config) if f.init})
    bare.optimizer = OptimizersContainer.Config(param_groups=ours.optimizer.param_groups,
                                                implementation=ours.optimizer.implementation)
    bare.checkpoint = CheckpointManager.Config(enable=False)
    bare.loss = CrossEntropyLoss.Config(global_vocab_size=ours.model_spec.model.vocab_size)  # torchtitan's own
    bare.dump_folder = os.path.join(out, "bare")

    def run(config) -> float:
        """Seconds of one whole loop of a freshly built trainer (the build not counted)."""
        trainer = config.build()
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        trainer.close()
        return seconds

    configs = {"project": ours, "torchtitan": bare}
    t: dict[str, list[float]] = {k: [] for k in configs}
    for i in range(args.rounds):
        for k in (list(configs) if i % 2 == 0 else list(configs)[::-1]):
            t[k].append(run(configs[k]))
    tokens = args.batch * args.seq * args.steps
    rows = [{"loop": k, "s/run": f"{min(v):.3f}", "tok/s": f"{tokens / min(v):,.0f}"} for k, v in t.items()]
    print(f"project loop vs bare torchtitan loop, {args.recipe} model: seq {args.seq}, batch {args.batch}, "
          f"{args.steps} steps a run, {args.rounds} rounds; s/run: the fastest run; "
          "ratio: median of the per-round ratios")
    print(common.table(rows, ["loop", "s/run", "tok/s"]))
    ratio = statistics.median(a / b for a, b in zip(t["project"], t["torchtitan"], strict=True))
    print(f"RATIO project/torchtitan step time: {ratio:.3f}x")
    return {"ratio": ratio, "rows": rows}


if __name__ == "__main__":
    main()
