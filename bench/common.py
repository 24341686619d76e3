"""Shared pieces of the benchmarks: models built the same way, one timing loop.

Why a shared helper: every ratio is only meaningful when both sides are built,
warmed up and timed identically, so the building and timing live in one place.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.laneformer import laneformer_configs
from models.laneformer.attention import attention_config
from models.laneformer.dense_twin import llama3_twin  # noqa: F401  (the bench's dense side)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def laneformer_config(flavor: str, full_causal: bool = False, **overrides):
    """A flavor's config with the device's attention kernel (flex on GPU, dense-mask SDPA
    on CPU, where flex has no backward), optionally with no window layers."""
    config = laneformer_configs[flavor]()
    if full_causal:
        overrides.setdefault("window_layers", [])
    return dataclasses.replace(config, inner_attention=attention_config(), **overrides)


def build(config, dev: torch.device | None = None, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(dev or device()):
        model = config.build()
        model.init_states()
    return model


def nparams(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile each block, as torchtitan's apply_compile does.

    A training process compiles one model; a benchmark compiling several
    shapes in one process must call torch._dynamo.reset() between them, or it
    hits dynamo's recompile limit (8 graphs per code object).
    """
    for block in model.layers.values():
        block.compile(fullgraph=True)
    return model


def train_step_fn(model, optimizer, forward: Callable, tokens, labels, autocast: bool) -> Callable[[], float]:
    """One training step: forward, cross-entropy, backward, AdamW step."""
    dev_type = tokens.device.type

    def step() -> float:
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=autocast):
            logits = forward(model, tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, steps: int) -> dict[str, list[float]]:
    """name -> seconds of each call: [first call, then ``steps`` calls after warm-up].

    Calls alternate between the functions, in reversed order every other
    round (a b, b a, a b, ...), so background load and cache or allocator state
    left by the previous call hit every side alike. Compare sides with
    ``paired_ratio``; ``fastest`` is the best estimate of a side's own time
    (on a shared machine other work only ever adds time).
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for i in range(max(warmup, 1) + steps):
        for name, fn in (items if i % 2 == 0 else items[::-1]):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    skip = max(warmup, 1) - 1
    return {name: t[:1] + t[1 + skip:] for name, t in times.items()}


def fastest(times: list[float]) -> float:
    return min(times[1:])


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a's call time / b's call time in the same round."""
    return statistics.median(x / y for x, y in zip(a[1:], b[1:]))


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def causal_mask(tokens: torch.Tensor):
    """The causal BlockMask, built as Laneformer builds its own (per step)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import create_attention_mask, get_causal_mask_mod

    B, S = tokens.shape
    build = create_attention_mask if tokens.is_cuda else create_block_mask
    return build(get_causal_mask_mod(), B, None, S, S, device=tokens.device)


def lane_forward(model, tokens):
    return model(tokens)


def dense_forward(model, tokens):
    return model(tokens, attention_masks=causal_mask(tokens))
