"""DCP checkpoint save/load speed (seconds per GB) and how long async save stalls training.

Why: a checkpoint interval is only cheap if saving is; torchtitan saves with
torch.distributed.checkpoint (DCP), synchronously or with ``dcp.async_save``,
which stages a copy of the state in memory, returns, and writes in a thread.
The ratio that matters for async is the stall the training loop sees against
a synchronous save of the same state, measured in the same run.

The state is what a training checkpoint holds: model weights plus AdamW
moments (after one optimizer step), fp32, of the ~100M flavor. Single
process, gloo process group of size 1. Loads read files just written, so
they come from the page cache: an upper bound for a cold read.

    .venv/bin/python -m bench.checkpoint [--flavor 100M] [--repeats 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from bench import common


def training_state(flavor: str) -> dict:
    """Model + AdamW state after one step, as DCP state dicts."""
    config = common.laneformer_config(flavor)
    model = common.build(config, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": optim_sd}


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(state: dict, root: Path, repeats: int) -> dict[str, float]:
    t: dict[str, list[float]] = {"save": [], "load": [], "stall": [], "async total": []}
    for i in range(repeats):
        sync_dir, async_dir = root / f"sync-{i}", root / f"async-{i}"
        t["save"].append(timed(lambda: dcp.save(state, checkpoint_id=sync_dir)))
        t["load"].append(timed(lambda: dcp.load(state, checkpoint_id=sync_dir)))
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=async_dir)
        t["stall"].append(time.perf_counter() - t0)  # the loop could run its next step here
        future.result()
        t["async total"].append(time.perf_counter() - t0)
        shutil.rmtree(sync_dir)
        shutil.rmtree(async_dir)
    return {k: min(v) for k, v in t.items()}  # other load only adds time


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="100M")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        state = training_state(args.flavor)
        gb = nbytes(state) / 1e9
        t = measure(state, root, args.repeats)
    finally:
        if own_group:
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        {"what": "sync save", "s": f"{t['save']:.2f}", "s/GB": f"{t['save'] / gb:.2f}"},
        {"what": "load", "s": f"{t['load']:.2f}", "s/GB": f"{t['load'] / gb:.2f}"},
        {"what": "async save: stall", "s": f"{t['stall']:.2f}", "s/GB": f"{t['stall'] / gb:.2f}"},
        {"what": "async save: total", "s": f"{t['async total']:.2f}", "s/GB": f"{t['async total'] / gb:.2f}"},
    ]
    print(f"DCP checkpoint of {args.flavor} (model + AdamW, fp32): {gb:.3f} GB, {args.dir or tempfile.gettempdir()}, "
          f"best of {args.repeats}")
    print(common.table(rows, ["what", "s", "s/GB"]))
    ratio = t["stall"] / t["save"]
    print(f"RATIO async stall / sync save: {ratio:.2f}x (stall {t['stall']:.2f} s of {t['async total']:.2f} s "
          f"total; sync save {t['save'] / gb:.2f} s/GB, load {t['load'] / gb:.2f} s/GB)")
    return {"gb": gb, "ratio": ratio, **t}


if __name__ == "__main__":
    main()
