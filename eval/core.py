"""The DCLM CORE score, computed as nanochat's ``core_eval`` computes it.

Per item (prompts and spans: ``eval.core_prompts``):
- multiple_choice and schema: one forward of all options; the prediction is
  the option with the lowest *mean* per-token cross-entropy over its scored
  span (not the sum: long answers are not penalised); ties go to the first;
- language_modeling: correct when greedy argmax reproduces every token of the
  continuation (exact match).
Per task: accuracy over the items, and centered accuracy
``(acc - b) / (1 - b)`` with the random baseline ``b`` of each version (v1:
nanochat's; v2: DCLM's corrected ones). CORE is the mean centered accuracy
over all 22 tasks; over fewer it is reported only as "partial CORE (n/22)"
with the missing tasks named.

Distributed: rank r scores items r, r + W, ...; per-item correctness is
summed with all_reduce, so every rank returns the same result. Forwards run
in lock step (``eval.dist.Lockstep``), so FSDP-sharded models do not hang.

Where nanochat and DCLM (llm-foundry's ICL evaluators) differ, this follows
nanochat, whose code is the reference here:
- whole prompts are tokenized and spans found by common token prefix/suffix
  (llm-foundry tokenizes context and continuation apart); so a word shared by
  all choices of a multiple-choice item is not scored;
- with ``max_per_task`` the few-shot examples come from the subsample, so a
  subsampled run differs from a full one in its prompts, not only its items;
- the baselines: v1 are the values nanochat uses, v2 DCLM's corrected ones
  (commonsense_qa, agi_eval_lsat_ar, bigbench_language_identification
  differ); every score names its version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from rundir.progress import progress

from . import dist
from .core_data import BASELINE_VERSIONS, CORE_LABELS, CoreTask, load_items, read_manifest
from .core_prompts import build


def centered(accuracy: float, baseline: float) -> float:
    return (accuracy - baseline) / (1.0 - baseline)


def pad_rows(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-pad rows into [B, S]; a causal model's scored positions never see the padding."""
    out = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def is_correct(task_type: str, logits: torch.Tensor, ids: torch.Tensor, starts, ends, gold: int | None) -> bool:
    """The decision for one item from the logits of its rows (position t predicts token t + 1)."""
    if task_type == "language_modeling":
        s, e = starts[0], ends[0]
        return bool(torch.equal(logits[0, s - 1 : e - 1].argmax(-1), ids[0, s:e]))
    mean_ce = [
        F.cross_entropy(logits[i, s - 1 : e - 1].float(), ids[i, s:e]).item()
        for i, (s, e) in enumerate(zip(starts, ends))
    ]
    return mean_ce.index(min(mean_ce)) == gold


def score_task(model_fn, tokenizer, task: CoreTask, items: list[dict], *, max_seq_len: int | None,
               device: torch.device | str = "cpu", show: str | None = None) -> float:
    """Accuracy of ``model_fn`` on ``items`` of one task, this rank scoring its strided share.
    ``show``: the label of a progress bar on stderr (items of all ranks: they run in lock step)."""
    correct = torch.zeros(len(items), dtype=torch.float32, device=device)
    world = dist.world_size()
    with dist.Lockstep(model_fn, device, tokenizer.bos_id) as forward, \
            progress(total=len(items), desc=show or "", unit="item", disable=show is None) as bar:
        for idx in range(dist.rank(), len(items), world):
            rows, starts, ends = build(task, items, idx, tokenizer, max_seq_len)
            ids = pad_rows(rows, tokenizer.bos_id).to(device)  # BOS as padding, as nanochat does
            correct[idx] = float(is_correct(task.type, forward(ids), ids, starts, ends, items[idx].get("gold")))
            bar.update(min(world, len(items) - idx))
    return dist.all_reduce_sum(correct).sum().item() / len(items)


@dataclasses.dataclass
class TaskScore:
    label: str
    accuracy: float
    n_items: int
    centered: dict[str, float]  # baseline version -> centered accuracy


@dataclasses.dataclass
class CoreResult:
    tasks: dict[str, TaskScore]
    missing: dict[str, str]  # label -> why it was not scored
    max_per_task: int | None = None

    @property
    def complete(self) -> bool:
        return not self.missing and len(self.tasks) == len(CORE_LABELS)

    def score(self, version: str) -> float | None:
        """Mean centered accuracy over the scored tasks (the CORE score when complete)."""
        if not self.tasks:
            return None
        return sum(t.centered[version] for t in self.tasks.values()) / len(self.tasks)

    def name(self) -> str:
        return "CORE" if self.complete else f"partial CORE ({len(self.tasks)}/{len(CORE_LABELS)})"

    def summary(self) -> str:
        scores = ", ".join(f"{v} {self.score(v):.4f}" for v in BASELINE_VERSIONS) if self.tasks else "no tasks"
        line = f"{self.name()}: {scores}"
        if self.max_per_task:
            line += f" (at most {self.max_per_task} items per task)"
        if self.missing:
            line += "; missing: " + ", ".join(self.missing)
        return line

    def metrics(self, prefix: str = "core") -> dict[str, float]:
        """Flat names -> values; the aggregate is ``CORE_<v>`` only when all 22 tasks were scored."""
        out = {}
        for t in self.tasks.values():
            out[f"{prefix}/{t.label}/acc"] = t.accuracy
            out.update({f"{prefix}/{t.label}/centered_{v}": c for v, c in t.centered.items()})
        if self.tasks:
            name = "CORE" if self.complete else "partial_CORE"
            out.update({f"{prefix}/{name}_{v}": self.score(v) for v in BASELINE_VERSIONS})
            out[f"{prefix}/n_tasks"] = len(self.tasks)
        return out


def evaluate_core(model_fn, tokenizer, bundle: str | Path, *, max_seq_len: int | None,
                  max_per_task: int | None = None, labels: Iterable[str] | None = None,
                  device: torch.device | str = "cpu", log: Callable[[str], None] | None = None) -> CoreResult:
    """Score the CORE tasks of ``bundle`` (``labels``: a subset; the rest count as missing).

    ``model_fn(ids [B, S]) -> logits [B, S, V]``; ``tokenizer`` has encode(text, bos=...) and
    bos_id; contexts are cropped from the left to ``max_seq_len``. Every rank must call this.
    ``log`` (rank 0's): a line per task, and each task's progress on stderr.
    """
    manifest = read_manifest(bundle)
    wanted = list(CORE_LABELS) if labels is None else list(labels)
    unknown = [label for label in wanted if label not in manifest]
    if unknown:
        raise ValueError(f"not CORE tasks: {unknown}")
    result = CoreResult(tasks={}, missing={}, max_per_task=max_per_task)
    for label in CORE_LABELS:
        task = manifest[label]
        if label not in wanted:
            result.missing[label] = "not selected"
            continue
        if not task.path(bundle).is_file():
            result.missing[label] = f"no file eval_data/{task.file}"
            continue
        t0 = time.time()
        items = load_items(bundle, task, max_per_task)
        if not items:
            raise ValueError(f"CORE task {label}: no items in eval_data/{task.file}")
        acc = score_task(model_fn, tokenizer, task, items, max_seq_len=max_seq_len, device=device,
                         show=f"CORE {label}" if log else None)
        result.tasks[label] = TaskScore(label, acc, len(items), {v: centered(acc, b) for v, b in task.baselines.items()})
        if log:
            log(f"{label:<34} acc {acc:.4f} ({len(items)} items, {task.shots}-shot {task.type}, {time.time() - t0:.1f}s)")
    return result
