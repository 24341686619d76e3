"""Text generation from a bare ``(ids) -> logits`` callable: greedy or sampled.

There is no KV cache (the callable has none): each step re-runs the batch's
sequences, cropped from the left to ``max_seq_len``. Rows stop at EOS, at a
stop string, or after ``max_new_tokens``; finished rows leave the batch.
The caller passes ``forward`` (an ``eval.dist.Lockstep``), so under FSDP a
rank whose rows finish early keeps stepping with the others.

``code_benchmark`` is the loop HumanEval and EvalPlus share: shard the
problems over ranks, generate in lock step, score the rank's own share (its
sandboxes), gather everything in problem order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from data.tokenizer import continuation_text

from . import dist
from .core import pad_rows


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens with mass >= top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def generate(forward: Callable[[torch.Tensor], torch.Tensor], tokenizer, prompts: list[list[int]], *,
             max_new_tokens: int, stop: Sequence[str] = (), max_seq_len: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None) -> list[str]:
    """The continuation text of each prompt (token ids, BOS included), cut before any stop string."""
    rows = [list(p) for p in prompts]
    texts = [""] * len(rows)
    active = list(range(len(rows)))
    for _ in range(max_new_tokens):
        if not active:
            break
        window = [rows[i][-max_seq_len:] if max_seq_len else rows[i] for i in active]
        logits = forward(pad_rows(window, tokenizer.eos_id))
        last = logits[torch.arange(len(window)), torch.tensor([len(w) - 1 for w in window])]
        tokens = _next_token(last, temperature, top_p, generator).tolist()
        still = []
        for i, token in zip(active, tokens):
            if token == tokenizer.eos_id:
                continue
            rows[i].append(token)
            texts[i], stopped = cut_at_stop(continuation_text(tokenizer, prompts[i], rows[i][len(prompts[i]):]), stop)
            if not stopped:
                still.append(i)
        active = still
    return texts


def code_benchmark(model_fn, tokenizer, problems: Sequence, *, prompt: Callable[[Any], list[int]],
                   score: Callable[[dict[int, list[str]]], dict[int, Any]], device: torch.device | str = "cpu",
                   samples: int = 1, batch_size: int = 16, seed: int = 0, **generation) -> list[tuple[list[str], Any]]:
    """(completions, verdict) of every problem, in order, on every rank. Every rank must call this.

    Rank r takes problems r, r + W, ...: ``samples`` completions of ``prompt(problem)`` each
    (``generate``'s keyword arguments; sampling seeded per problem, so any world size draws the
    same), then ``score({index: completions})`` of its own share gives each one's verdict.
    """
    mine = list(range(dist.rank(), len(problems), dist.world_size()))
    completions: dict[int, list[str]] = {}
    with dist.Lockstep(model_fn, device, tokenizer.bos_id) as forward:
        for i in mine:
            generator = torch.Generator(device=device).manual_seed(seed + i)
            ids = prompt(problems[i])
            completions[i] = []
            for b in range(0, samples, batch_size):
                completions[i] += generate(forward, tokenizer, [ids] * min(batch_size, samples - b),
                                           generator=generator, **generation)
    verdicts = score(completions)
    gathered = {i: v for part in dist.all_gather_objects({i: (completions[i], verdicts[i]) for i in mine})
                for i, v in part.items()}
    return [gathered[i] for i in range(len(problems))]
