"""Training-step time of a Laneformer against torchtitan's own llama3 at equal parameters.

Why: lanes keep the projection FLOPs of the dense model but make the residual
stream, norms and exchange L times wider. This measures what that costs per
training step (forward + cross-entropy + backward + AdamW step), as a ratio
against a dense twin timed in the same run (steps interleaved, so background
load hits both alike). Target: <= 1.25x at the ~100M flavor's shape.

Fairness: the dense twin (models.laneformer.dense_twin.llama3_twin) has the same depth, width,
heads, KV heads, head_dim, MLP size, vocab, RoPE and untied embeddings, hence
exactly the same parameter count (printed). The Laneformer runs without window
layers (all full causal) and both sides build one causal BlockMask per step
and use the same attention kernel: dense-mask SDPA on CPU (models.laneformer.attention's
DenseMaskFlexAttention; flex has no CPU backward), FlexAttention on GPU.
CPU runs in fp32, GPU under bf16 autocast. "compiled" compiles every block
with torch.compile(fullgraph=True), as torchtitan's apply_compile does.

    .venv/bin/python -m bench.lanes_vs_dense [--flavors 100M,tiny] [--seq 256] [--batch 2]
"""

from __future__ import annotations

import argparse

import torch

from bench import common

TARGET = 1.25


def row(flavor: str, mode: str, params: int, lanes: list[float], dense: list[float], tokens: int) -> dict:
    """A table row from both sides' step times (see common.time_interleaved)."""
    lane_s, dense_s, ratio = common.fastest(lanes), common.fastest(dense), common.paired_ratio(lanes, dense)
    return {
        "flavor": flavor, "mode": mode, "params": f"{params:,}",
        "lanes s/step": f"{lane_s:.3f}", "dense s/step": f"{dense_s:.3f}",
        "ratio": f"{ratio:.2f}x", "ratio_value": ratio,
        "lanes tok/s": f"{tokens / lane_s:,.0f}", "dense tok/s": f"{tokens / dense_s:,.0f}",
        "1st step lanes/dense s": f"{lanes[0]:.1f}/{dense[0]:.1f}",
    }


def measure(flavor: str, seq: int, batch: int, modes: list[str], warmup: int, steps: int) -> list[dict]:
    dev = common.device()
    lane_config = common.laneformer_config(flavor, full_causal=True)
    models = {
        "lanes": (common.build(lane_config, dev), common.lane_forward),
        "dense": (common.build(common.llama3_twin(lane_config), dev), common.dense_forward),
    }
    n_lane, n_dense = common.nparams(models["lanes"][0]), common.nparams(models["dense"][0])
    if n_lane != n_dense:
        raise AssertionError(f"{flavor}: parameter counts differ: lanes {n_lane:,} vs dense {n_dense:,}")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, lane_config.vocab_size, (batch, seq), generator=g).to(dev)
    labels = torch.randint(0, lane_config.vocab_size, (batch, seq), generator=g).to(dev)
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in models.items()}
    rows = []
    for mode in modes:
        if mode == "compiled":
            torch._dynamo.reset()  # one flavor's graphs at a time (dynamo's recompile limit)
            for model, _ in models.values():
                common.compile_blocks(model)
        fns = {
            k: common.train_step_fn(m, optimizers[k], fwd, tokens, labels, autocast=dev.type == "cuda")
            for k, (m, fwd) in models.items()
        }
        t = common.time_interleaved(fns, warmup, steps)
        rows.append(row(flavor, mode, n_lane, t["lanes"], t["dense"], batch * seq))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="100M,tiny,tiny-4lane")
    p.add_argument("--seq", type=int, default=2048 if gpu else 256)
    p.add_argument("--batch", type=int, default=4 if gpu else 2)
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--steps", type=int, default=10 if gpu else 5)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    where = torch.cuda.get_device_name() + " bf16" if gpu else f"CPU fp32, {torch.get_num_threads()} threads"
    print(f"lanes vs dense training step: seq {args.seq}, batch {args.batch}, {where}, "
          f"{args.steps} interleaved steps after {args.warmup} warm-up")
    print("s/step: fastest step; ratio: median over steps of lanes/dense step time in the same round")
    rows = []
    for flavor in args.flavors.split(","):
        rows += measure(flavor, args.seq, args.batch, modes, args.warmup, args.steps)
    columns = ["flavor", "mode", "params", "lanes s/step", "dense s/step", "ratio", "lanes tok/s",
               "dense tok/s", "1st step lanes/dense s"]
    print(common.table(rows, columns))
    head = [r for r in rows if r["flavor"] == rows[0]["flavor"]]
    verdicts = ", ".join(f"{r['mode']} {r['ratio_value']:.2f}x {'PASS' if r['ratio_value'] <= TARGET else 'FAIL'}"
                         for r in head)
    print(f"RATIO lanes/dense step time at {rows[0]['flavor']} (target <= {TARGET}x): {verdicts}")
    return rows


if __name__ == "__main__":
    main()
