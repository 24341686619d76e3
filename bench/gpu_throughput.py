"""Tokens/s/GPU and MFU of the 100M and 2B flavors on one GPU, swept over micro batch and AC.

Why: the recipe's micro batch and activation-checkpointing choice should be
the fastest that fits; this measures them on the production path: the model
is built on the meta device and goes through parallelize_laneformer
(activation checkpointing, torch.compile per block, FSDP2 with bf16 params
and fp32 reductions) on a 1-rank process group, then trained on synthetic
tokens (pure causal attention, no document masks) with fused AdamW.

MFU = FLOPs/token (models.laneformer.flops, 6N + attention, AC recompute not
counted) x tokens/s / peak, peak = the bf16 datasheet peak of ``plan/gpus.py``
(989 TFLOP/s for an H100 or H200: the H200 has the H100's compute and more memory). Each setting is compiled from
scratch (dynamo reset), so the sweep takes a few minutes per setting; a
micro batch that runs out of memory ends that AC setting's sweep.

On a machine without a GPU it prints why and exits 0 (the same code path
runs on CPU in training: tests/train/test_train.py).

    .venv/bin/python -m bench.gpu_throughput [--flavors 100M,2B] [--ac none,selective,full]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch

from bench import common

DEFAULT_MICRO_BATCHES = {"100M": "8,16,32", "2B": "2,4,8", "tiny": "2"}


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the hardware peak."""
    return flops_per_token * tokens_per_s / peak


def peak_flops(device_name: str) -> float | None:
    """bf16 peak FLOP/s of a CUDA device name, from the planner's GPU table (None: not in it)."""
    from plan.gpus import GPUS, gpu_for_device

    kind = gpu_for_device(device_name)
    return None if kind is None else GPUS[kind].peak_flops("bfloat16")


def ac_config(name: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[name]


def build_parallel(flavor: str, micro_batch: int, seq: int, ac: str):
    """The flavor through parallelize_laneformer on a 1-rank mesh: (model, FLOPs/token, vocab)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from models.laneformer import laneformer_configs, parallelize_laneformer
    from models.laneformer.flops import nparams_and_flops_per_token

    config = laneformer_configs[flavor]()
    with torch.device("meta"):
        model = config.build()
    _, flops_per_token = nparams_and_flops_per_token(config, model, seq)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                        spmd_backend="partial_dtensor")
    model = parallelize_laneformer(
        model,
        parallel_dims=dims,
        training=TrainingConfig(local_batch_size=micro_batch, seq_len=seq,
                                mixed_precision_param="bfloat16",
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=True, components=["model"]),
        ac_config=ac_config(ac),
        dump_folder=tempfile.gettempdir(),
    )
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()
    model.train()
    return model, flops_per_token, config.vocab_size


def run_setting(flavor, micro_batch, seq, ac, warmup, steps) -> dict:
    """tokens/s of one setting, or {'error': 'OOM'}."""
    import torch.nn.functional as F

    torch._dynamo.reset()
    model = opt = None
    try:
        model, flops_per_token, vocab = build_parallel(flavor, micro_batch, seq, ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        dev = "cuda"
        tokens = torch.randint(0, vocab, (micro_batch, seq), device=dev)
        labels = torch.randint(0, vocab, (micro_batch, seq), device=dev)

        def step():
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        common.sync()
        warm_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        common.sync()
        tps = micro_batch * seq * steps / (time.perf_counter() - t0)
        mem = torch.cuda.max_memory_allocated() / 2**30
        return {"tokens_per_s": tps, "flops_per_token": flops_per_token, "warmup_s": warm_s, "mem_gib": mem}
    except RuntimeError as e:  # torch.OutOfMemoryError, or OOM raised from inside compiled code
        if "out of memory" not in str(e).lower():
            raise
        return {"error": "OOM"}
    finally:
        model = opt = None  # free the GPU memory before the next setting
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="100M,2B")
    p.add_argument("--ac", default="none,selective,full")
    p.add_argument("--micro-batches", default=None, help="e.g. 1,2,4 (default: per flavor)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak, for GPUs not in plan/gpus.py")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA GPU found; this benchmark measures GPU throughput and MFU, "
              "so there is nothing to measure here. Run it on an H100 or H200 node.")
        return []
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(name)
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        torch.cuda.set_device(0)
        store = tempfile.mkdtemp(prefix="bench-pg-")
        dist.init_process_group("nccl", init_method=f"file://{store}/pg", rank=0, world_size=1)
    rows = []
    try:
        for flavor in args.flavors.split(","):
            for ac in args.ac.split(","):
                mbs = args.micro_batches or DEFAULT_MICRO_BATCHES.get(flavor, "1,2,4")
                for mb in [int(m) for m in mbs.split(",")]:
                    r = run_setting(flavor, mb, args.seq, ac, args.warmup, args.steps)
                    row = {"flavor": flavor, "ac": ac, "micro batch": mb}
                    if "error" in r:
                        rows.append({**row, "tokens/s/GPU": r["error"]})
                        print(f"  {flavor} ac={ac} mb={mb}: {r['error']}", flush=True)
                        break  # larger micro batches will not fit either
                    m = mfu(r["flops_per_token"], r["tokens_per_s"], peak) if peak else None
                    rows.append({**row, "tokens/s/GPU": f"{r['tokens_per_s']:,.0f}",
                                 "MFU": f"{100 * m:.1f}%" if m is not None else "n/a",
                                 "peak GiB": f"{r['mem_gib']:.1f}", "warm-up s": f"{r['warmup_s']:.0f}",
                                 "tps": r["tokens_per_s"], "mfu": m})
                    print(f"  {flavor} ac={ac} mb={mb}: {rows[-1]['tokens/s/GPU']} tokens/s, MFU {rows[-1]['MFU']}",
                          flush=True)
    finally:
        if own_group:
            dist.destroy_process_group()
    print(f"one-GPU throughput, seq {args.seq}, {name}, peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s, "
          f"{args.steps} steps after {args.warmup} warm-up (compile) steps")
    print(common.table(rows, ["flavor", "ac", "micro batch", "tokens/s/GPU", "MFU", "peak GiB", "warm-up s"]))
    for flavor in dict.fromkeys(r["flavor"] for r in rows):
        ok = [r for r in rows if r["flavor"] == flavor and "tps" in r]
        if ok:
            best = max(ok, key=lambda r: r["tps"])
            print(f"BEST {flavor}: ac={best['ac']} micro batch {best['micro batch']}: "
                  f"{best['tokens/s/GPU']} tokens/s/GPU, MFU {best['MFU']}")
    return rows


if __name__ == "__main__":
    main()
