"""CORE prompts and the token spans that are scored, as nanochat builds them.

Prompt text (nanochat's Jinja templates, written out):
- few-shot block: each example as ``<context><delimiter><answer>\\n\\n``, then
  the item itself;
- multiple_choice: one prompt per choice, ``query + delimiter + choice``;
  the scored span of each is what follows the tokens common to all choices
  (so a first word shared by every choice is not scored);
- schema: one prompt per context option, ``option + delimiter + continuation``;
  the scored span is the token suffix common to all prompts;
- language_modeling: contexts are stripped of surrounding whitespace; the
  prompt without the continuation is stripped too, and the span is what the
  continuation adds.
Every prompt is tokenized on its own with BOS first.

Few-shot examples for item ``idx``: ``random.Random(1234 + idx).sample`` of
``shots`` indices among the other items of the (shuffled, subsampled) list.

Deviations, each only where nanochat would fail (assert or exception):
- fewer other items than ``shots`` (a tiny ``max_per_task``): all of them;
- a language-modeling prompt whose tokens are not a prefix of the prompt with
  the continuation (a merge across the boundary): the span starts after the
  common token prefix;
- a continuation longer than ``max_seq_len - 1``: after cropping from the left
  (as nanochat does) the span starts at position 1, so one context token stays.
"""

from __future__ import annotations

import random

from .core_data import CoreTask

FEWSHOT_SEED = 1234


def fewshot_examples(items: list[dict], idx: int, shots: int) -> list[dict]:
    if shots <= 0:
        return []
    others = [i for i in range(len(items)) if i != idx]
    rng = random.Random(FEWSHOT_SEED + idx)
    return [items[i] for i in rng.sample(others, min(shots, len(others)))]


def render(task_type: str, item: dict, delimiter: str, examples: list[dict]) -> list[str]:
    """The prompts of one item (for language_modeling: without and with the continuation)."""
    if task_type == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in examples)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in examples)
        return [f"{shots}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if task_type == "language_modeling":
        shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in examples)
        prompt = f"{shots}{item['context'].strip()}{delimiter}"
        return [prompt.strip(), prompt + item["continuation"]]
    raise ValueError(f"unknown CORE task type {task_type!r}")


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(map(len, rows))
    return next((i for i in range(n) if any(r[i] != rows[0][i] for r in rows)), n)


def spans(task_type: str, rows: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """(rows to forward, span starts, span ends): tokens ``row[start:end]`` are scored."""
    if task_type == "multiple_choice":
        start = _common_prefix(rows)
        return rows, [start] * len(rows), [len(r) for r in rows]
    if task_type == "schema":
        suffix = _common_prefix([r[::-1] for r in rows])
        return rows, [len(r) - suffix for r in rows], [len(r) for r in rows]
    without, with_continuation = rows
    start = _common_prefix(rows)  # == len(without) when it is a token prefix, as nanochat asserts
    if start >= len(with_continuation):
        raise ValueError("a language-modeling continuation adds no tokens")
    return [with_continuation], [start], [len(with_continuation)]


def crop_left(rows, starts, ends, max_len: int):
    """Keep the last ``max_len`` tokens of each row and shift its span (nanochat's truncation)."""
    out = ([], [], [])
    for row, s, e in zip(rows, starts, ends):
        cut = max(0, len(row) - max_len)
        for lst, value in zip(out, (row[cut:], max(s - cut, 1), e - cut)):
            lst.append(value)
    return out


def build(task: CoreTask, items: list[dict], idx: int, tokenizer, max_seq_len: int | None):
    """Token rows and scored spans of item ``idx``, cropped to ``max_seq_len``."""
    prompts = render(task.type, items[idx], task.delimiter, fewshot_examples(items, idx, task.shots))
    rows = [tokenizer.encode(p, bos=True) for p in prompts]
    rows, starts, ends = spans(task.type, rows)
    if max_seq_len:
        rows, starts, ends = crop_left(rows, starts, ends, max_seq_len)
    return rows, starts, ends
