"""``python -m models.laneformer.inspect --flavor 2B``: parameters, windows, weight shapes.

Builds the model on the meta device, so even the 2B costs no memory.
"""

import argparse

import torch

from . import laneformer_configs


def describe(flavor: str, seq_len: int | None = None) -> str:
    config = laneformer_configs[flavor]()
    with torch.device("meta"):
        model = config.build()
    seq_len = seq_len or config.max_seq_len
    nparams, flops = config.get_nparams_and_flops(model, seq_len)
    lines = [
        f"flavor: {flavor}",
        f"parameters: {nparams:,}",
        f"lanes: {config.n_lanes}  delay: {config.delay}  heads: {config.n_heads}/{config.n_kv_heads}"
        f"  head_dim: {config.head_dim}",
        f"flops per token at seq {seq_len}: {flops:,}",
        "attention windows:",
    ]
    for i in range(config.n_layers):
        window = config.window_of(i)
        reduce, sends = config.exchange_of(i)
        lines.append(
            f"  layer {i:2d}: {'window ' + str(window) if window else 'full causal'}"
            f"  (adds own outputs: {reduce}, sends forward: {sends})"
        )
    lines.append("weights:")
    lines += [f"  {name} {list(p.shape)}" for name, p in model.named_parameters()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flavor", default="2B", choices=sorted(laneformer_configs))
    parser.add_argument("--seq-len", type=int, default=None)
    args = parser.parse_args()
    print(describe(args.flavor, args.seq_len))


if __name__ == "__main__":
    main()
