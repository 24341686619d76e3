"""Time to the first trained step of a restart, with the run's compile cache and without.

Why: every restart pays compilation again unless Inductor's FX-graph and
AOTAutograd caches are where the restarted ranks look (``[run] compile_cache``,
default ``<run>/compile_cache``: train.build.compile_cache). Three launches of
train.py on one rank, a compiled tiny recipe (``parallel.compile = true``):

1. a fresh run (cold cache) trains ``--steps`` steps;
2. the same run resumed for ``--steps`` more, its cache as the first left it;
3. the same resume from a copy of the run with the cache removed (cold): the
   control, so that page cache and resumed state are the same as in 2.

Each launch's time to its first step is the heartbeat's (health/heartbeat.py):
process start to the end of the first trained step, split as health.goodput
splits it.

    .venv/bin/python -m bench.compile_cache [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from health.goodput import startup_split
from rundir import COMPILE_CACHE_DIR, REPO, beat_file


def launch(run: Path, steps: int) -> dict[str, float]:
    """train.py on one rank (the environment torchrun would give it); the startup split of its first step."""
    sets = [f"run.output_dir={run}", f"training.steps={steps}", "parallel.compile=true", "training.seq_len=64",
            "training.global_batch=8", "training.micro_batch=8", "schedule.warmup_steps=1", "logging.interval=1",
            f"checkpoint.interval={steps}", "logging.report=false", 'logging.wandb_mode="disabled"',
            "logging.tensorboard=false", "eval.at_end=false"]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the run's own cache: <run>/compile_cache
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", "tiny.toml",
                             *(a for s in sets for a in ("--set", s))], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"train.py failed:\n{result.stderr[-3000:]}")
    beat = json.loads(beat_file(run, 0).read_bytes().strip())
    marks = beat["marks"]
    return startup_split(marks["process"], marks)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="steps per launch")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        first = launch(run, args.steps)
        control = Path(tmp) / "cold"
        shutil.copytree(run, control)
        shutil.rmtree(control / COMPILE_CACHE_DIR)
        warm = launch(run, 2 * args.steps)
        cold = launch(control, 2 * args.steps)
    rows = {"first launch (cold cache)": first, "restart, the run's cache": warm, "restart, cache removed": cold}
    names = list(first)
    print(f"{'launch':28s} {'to first step':>14s}  " + "  ".join(f"{n:>15s}" for n in names))
    for label, split in rows.items():
        print(f"{label:28s} {sum(split.values()):13.1f}s  " + "  ".join(f"{split.get(n, 0):14.1f}s" for n in names))
    ratio = sum(warm.values()) / sum(cold.values())
    print(f"RATIO restart time to first step, with / without the compile cache: {ratio:.2f}")
    return {"first": first, "warm": warm, "cold": cold, "ratio": ratio}


if __name__ == "__main__":
    main()
