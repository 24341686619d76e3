"""Sampling with the KV-cache decoder (``LaneDecoder``: window layers as rings), for RL rollouts.

A batch is the G samples of one prompt, so every row has the prompt's length and the cache needs no padding.
Each row draws from its own ``torch.Generator`` (``sample_seed``: from the run's seed, the step, the task and the
sample's index), so a row's completion depends on nothing else: a resume after kill -9 samples the same ones,
whatever was sampled before it in the process. Per step: the policy's logits, then temperature, top-k and top-p
(nucleus, as eval.generate's) shape the distribution a token is drawn from; temperature 0 is greedy
(``greedy()``'s argmax: tests/train/test_rl_sampler.py). A row stops at EOS (kept: the policy learns to stop),
when ``stop(ids)`` says so (a stop string), or after ``max_new_tokens`` (truncated).

``logprobs`` are the policy's own log-probabilities of the drawn tokens, ``log_softmax`` of the raw logits
(temperature 1, no truncation): the "old policy" of the PPO ratio, which the trainer's forward reproduces on
the same weights (``generator_logprobs`` of torchtitan's DAPOLoss).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .generate import LaneDecoder


def sample_seed(*parts: object) -> int:
    """A generator seed from ``parts`` (run seed, step, task id, sample index): 63 bits of BLAKE2b of their JSON."""
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Sample:
    ids: list[int]  # the completion, EOS included when drawn
    logprobs: list[float]  # the policy's log-prob of each id
    truncated: bool  # stopped by max_new_tokens, not by EOS or a stop


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: argmax at temperature 0, else drawn with row i's generator."""
    if temperature <= 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:  # the smallest set of tokens with mass >= top_p
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


@torch.no_grad()
def sample(decoder: LaneDecoder, prompt: list[int], generators: list[torch.Generator], max_new_tokens: int,
           eos_id: int | None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           stop: Callable[[list[int]], bool] | None = None) -> list[Sample]:
    """One completion of ``prompt`` per generator (the module's docstring)."""
    B = len(generators)
    decoder.reset(B, len(prompt) + max_new_tokens)
    logits = decoder.forward(torch.tensor([prompt] * B, device=decoder.device), 0)
    out = [Sample([], [], True) for _ in range(B)]
    live = list(range(B))
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = next_tokens(logits, temperature, top_k, top_p, generators)
        for i in list(live):
            token = int(tokens[i])
            out[i].ids.append(token)
            out[i].logprobs.append(float(logp[i, token]))
            if token == eos_id or (stop is not None and stop(out[i].ids)):
                out[i].truncated = False
                live.remove(i)
        if not live or t == max_new_tokens - 1:
            break
        logits = decoder.forward(tokens.unsqueeze(1).to(decoder.device), len(prompt) + t)
    return out
