"""The CORE task manifest and a bundle's task files.

CORE (DCLM, arXiv:2406.11794; nanochat's ``core_eval``) is defined by 22
tasks. A bundle is a folder with ``tasks.csv`` (label, type, shots,
continuation delimiter, file, random baselines v1 and v2 in percent) and
``eval_data/<category>/<task>.jsonl`` (see /work/shared/core_eval_bundle).
The manifest must list exactly the 22 CORE labels; a task whose file is
absent is reported missing, never silently dropped, because a mean over
fewer tasks is a different number (a "partial CORE").

Subsampling follows nanochat exactly: the items of a file are shuffled with
``random.Random(1337)`` and the first ``max_per_task`` kept, so a given
``max_per_task`` always scores the same items.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import re
from pathlib import Path

CORE_LABELS = (
    "hellaswag_zeroshot", "jeopardy", "bigbench_qa_wikidata", "arc_easy", "arc_challenge", "copa",
    "commonsense_qa", "piqa", "openbook_qa", "lambada_openai", "hellaswag", "winograd", "winogrande",
    "bigbench_dyck_languages", "agi_eval_lsat_ar", "bigbench_cs_algorithms", "bigbench_operators",
    "bigbench_repeat_copy_logic", "squad", "coqa", "boolq", "bigbench_language_identification",
)
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
BASELINE_VERSIONS = ("v1", "v2")  # v1: nanochat's values; v2: DCLM's corrected values (Sept 2025)
SUBSAMPLE_SEED = 1337


@dataclasses.dataclass(frozen=True)
class CoreTask:
    label: str
    type: str
    shots: int
    delimiter: str
    file: str  # under eval_data/
    baselines: dict[str, float]  # version -> random-guess accuracy as a fraction

    def path(self, bundle: Path) -> Path:
        return Path(bundle) / "eval_data" / self.file


def _unescape(text: str) -> str:
    """A delimiter as written inside a YAML double-quoted string (``\\n`` is a newline)."""
    escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"'}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(0)), text)


def read_manifest(bundle: str | Path) -> dict[str, CoreTask]:
    """The 22 tasks of ``bundle/tasks.csv`` by label, in CORE order."""
    path = Path(bundle) / "tasks.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = {row["label"]: row for row in csv.DictReader(f)}
    if set(rows) != set(CORE_LABELS):
        raise ValueError(
            f"{path}: CORE has 22 tasks; missing rows {sorted(set(CORE_LABELS) - set(rows))}, "
            f"unknown rows {sorted(set(rows) - set(CORE_LABELS))}"
        )
    tasks = {}
    for label in CORE_LABELS:
        row = rows[label]
        if row["type"] not in TASK_TYPES:
            raise ValueError(f"{path}: task {label} has type {row['type']!r}, expected one of {TASK_TYPES}")
        tasks[label] = CoreTask(
            label=label, type=row["type"], shots=int(row["shots"]),
            delimiter=_unescape(row["continuation_delimiter"]), file=row["file"],
            baselines={v: float(row[f"baseline_{v}"]) / 100 for v in BASELINE_VERSIONS},
        )
    return tasks


def load_items(bundle: str | Path, task: CoreTask, max_per_task: int | None = None) -> list[dict]:
    """The task's items after nanochat's seeded shuffle, cut to ``max_per_task`` (None or <= 0: all)."""
    with open(task.path(bundle), encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    random.Random(SUBSAMPLE_SEED).shuffle(items)
    return items[:max_per_task] if max_per_task and max_per_task > 0 else items
