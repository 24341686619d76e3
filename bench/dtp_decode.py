"""Lane-parallel decode latency: the delayed exchange (DTP) against a synchronous all-reduce per sub-block (TP).

Why: Laneformer's reason to exist is that, with lanes on different GPUs, the
exchange started after a sub-block is waited on only ``delay`` layers later,
hidden behind compute. This measures it with the open reference decoder
(``models.laneformer.generate``): the same random weights decoded on P ranks
with the model's own exchange (delay 2 for the 2B) and with ``delay=0``, a
synchronous all-reduce after every sub-block, i.e. standard tensor parallelism
(a different model: only its timing is compared). Each side decodes
``--tokens`` greedy tokens after a ``--prompt-len`` prompt, after one warm-up
decode; per-token latency is the median decode step. The wait/compute split
is each rank's time blocked on the exchange (on CUDA from a second,
synchronised pass).

    .venv/bin/python -m bench.dtp_decode [--ranks 8] [--flavor 2B] [--tokens 32]

It starts torchrun itself (NCCL on GPUs, gloo on CPU). On CPU with gloo the
ranks share a few cores and a collective costs ~1 ms, so the numbers check the
mechanism only (the output says so); measure on a node with >= P GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import torch


def rows_of(label: str, runs) -> dict:
    """One table row from every rank's (latency pass, wait/compute pass)."""
    latency = runs[0][0]
    waits = [split.wait_per_token_s for _, split in runs]
    computes = [split.compute_per_token_s for _, split in runs]
    return {"mode": label, "ms/token": f"{1e3 * latency.per_token_s:.2f}", "tokens/s": f"{1 / latency.per_token_s:,.0f}",
            "wait ms/token (min-max over ranks)": f"{1e3 * min(waits):.2f}-{1e3 * max(waits):.2f}",
            "compute ms/token (min-max)": f"{1e3 * min(computes):.2f}-{1e3 * max(computes):.2f}",
            "latency": latency.per_token_s}


def worker(args) -> None:
    import torch.distributed as dist

    from bench.common import table
    from models.laneformer import laneformer_configs
    from models.laneformer.generate import LaneDecoder, gather, lane_range, random_weights, timed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    config = laneformer_configs[args.flavor]()
    if args.layers:
        config = dataclasses.replace(config, n_layers=args.layers)
    lanes = lane_range(config.n_lanes, rank, world)
    weights = random_weights(config, lanes, seed=0)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    rows = []
    for label, cfg in ((f"DTP (delay {config.delay})", config),
                       ("TP (delay 0, synchronous)", dataclasses.replace(config, delay=0, delayed_exchange=True))):
        decoder = LaneDecoder(cfg, weights, lanes, device, dtype, dist.group.WORLD)
        timed(decoder, prompt, min(args.tokens, 4))  # warm-up
        rows.append(rows_of(label, gather(timed(decoder, prompt, args.tokens), dist.group.WORLD)))
        del decoder
    if rank == 0:
        where = (f"{world} x {torch.cuda.get_device_name()} NCCL" if cuda
                 else f"{world} CPU ranks, gloo, {os.cpu_count()} cores")
        print(f"lane-parallel decode: {args.flavor}" + (f" ({config.n_layers} layers)" if args.layers else "")
              + f", {args.dtype}, {where}, prompt {args.prompt_len}, {args.tokens} tokens, "
              f"{config.n_lanes // world} lanes per rank")
        print(table(rows, ["mode", "ms/token", "tokens/s", "wait ms/token (min-max over ranks)",
                           "compute ms/token (min-max)"]))
        if not cuda:
            print("CPU + gloo: this checks the mechanism only (ranks share the cores; a collective costs ~1 ms); "
                  "measure on GPUs with NCCL")
        print(f"RATIO TP/DTP per-token latency ({args.flavor}, {world} ranks): "
              f"{rows[1]['latency'] / rows[0]['latency']:.2f}x")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=min(gpus, 8) if gpus > 1 else 4, help="ranks (divides n_lanes)")
    p.add_argument("--flavor", default="2B" if gpus > 1 else "tiny")
    p.add_argument("--layers", type=int, default=None, help="override n_layers (e.g. a smaller 2B-shaped model)")
    p.add_argument("--tokens", type=int, default=32 if gpus > 1 else 8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16" if gpus > 1 else "float32")
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           "-m", "bench.dtp_decode", *(argv if argv is not None else sys.argv[1:])]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}).returncode


if __name__ == "__main__":
    sys.exit(main())
