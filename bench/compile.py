"""Compiled vs eager training-step time of the tiny Laneformer.

Why: torchtitan compiles every block (apply_compile) and training recipes turn
it on; this shows what compiling buys (or costs) per step and how long the
first, compiling step takes, against eager timed in the same run (steps
interleaved). The flavor is used as defined (window layers included), with the
bench's attention kernel (dense-mask SDPA on CPU, flex on GPU).

    .venv/bin/python -m bench.compile [--flavor tiny] [--seq 256] [--batch 4] [--steps 5]
"""

from __future__ import annotations

import argparse

import torch

from bench import common


def main(argv: list[str] | None = None) -> dict:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    dev = common.device()
    config = common.laneformer_config(args.flavor)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    labels = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    fns = {}
    for mode in ("eager", "compiled"):
        model = common.build(config, dev)  # same seed: identical weights
        if mode == "compiled":
            torch._dynamo.reset()  # fresh graphs, whatever ran before in this process
            common.compile_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fns[mode] = common.train_step_fn(model, opt, common.lane_forward, tokens, labels, autocast=gpu)
    t = common.time_interleaved(fns, args.warmup, args.steps)
    tokens_per_step = args.batch * args.seq
    rows = [{"mode": m, "first step s": f"{times[0]:.2f}", "s/step": f"{common.fastest(times):.4f}",
             "tok/s": f"{tokens_per_step / common.fastest(times):,.0f}"} for m, times in t.items()]
    where = torch.cuda.get_device_name() + " bf16" if gpu else f"CPU fp32, {torch.get_num_threads()} threads"
    print(f"compiled vs eager, {args.flavor}: seq {args.seq}, batch {args.batch}, {where}, "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; s/step: fastest step; "
          "ratio: median of the per-round ratios")
    print(common.table(rows, ["mode", "first step s", "s/step", "tok/s"]))
    ratio = common.paired_ratio(t["compiled"], t["eager"])
    print(f"RATIO compiled/eager step time ({args.flavor}): {ratio:.2f}x (speed-up {1 / ratio:.2f}x; "
          f"compiling took {t['compiled'][0] - t['eager'][0]:.1f} s more on the first step)")
    return {"ratio": ratio, "rows": rows}


if __name__ == "__main__":
    main()
