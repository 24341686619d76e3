"""The CORE task manifest and a bundle's task files.

CORE (DCLM, arXiv:2406.11794; nanochat's ``core_eval``) is defined by 22
tasks. A bundle is a folder with ``tasks.csv`` (label, type, shots,
continuation delimiter, file, random baselines v1 and v2 in percent) and
``eval_data/<category>/<task>.jsonl``.
The manifest must list exactly the 22 CORE labels; a task whose file is
absent is reported missing, never silently dropped, because a mean over
fewer tasks is a different number (a "partial CORE").

``python -m eval.core_data fetch DIR`` makes such a folder from the real
bundle, ``eval_bundle.zip``: the one nanochat downloads (DCLM's CORE tasks
from the MosaicML eval gauntlet, with ``core.yaml`` and ``eval_meta_data.csv``
in place of tasks.csv). It needs a network; elsewhere copy a fetched folder.

Subsampling follows nanochat exactly: the items of a file are shuffled with
``random.Random(1337)`` and the first ``max_per_task`` kept, so a given
``max_per_task`` always scores the same items.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import random
import re
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from rundir import writable

CORE_LABELS = (
    "hellaswag_zeroshot", "jeopardy", "bigbench_qa_wikidata", "arc_easy", "arc_challenge", "copa",
    "commonsense_qa", "piqa", "openbook_qa", "lambada_openai", "hellaswag", "winograd", "winogrande",
    "bigbench_dyck_languages", "agi_eval_lsat_ar", "bigbench_cs_algorithms", "bigbench_operators",
    "bigbench_repeat_copy_logic", "squad", "coqa", "boolq", "bigbench_language_identification",
)
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
BASELINE_VERSIONS = ("v1", "v2")  # v1: nanochat's values; v2: DCLM's corrected values (Sept 2025)
SUBSAMPLE_SEED = 1337
BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's scripts/base_eval.py
# DCLM's corrected random baselines (percent) where they differ from eval_meta_data.csv's (v1).
V2_BASELINES = {"commonsense_qa": 40.3, "agi_eval_lsat_ar": 25.0, "bigbench_language_identification": 25.0}
TASKS_CSV_FIELDS = ("label", "type", "shots", "continuation_delimiter", "file", "baseline_v1", "baseline_v2")


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


def _escape(text: str) -> str:
    """The inverse of ``_unescape``."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace('"', '\\"')


def convert(eval_bundle: Path, dest: Path) -> dict[str, CoreTask]:
    """Turn an unpacked ``eval_bundle`` (core.yaml, eval_meta_data.csv, eval_data/) into a
    bundle folder (tasks.csv, eval_data/) at ``dest``; returns its manifest."""
    import yaml

    eval_bundle, dest = Path(eval_bundle), Path(dest)
    tasks = {t["label"]: t for t in yaml.safe_load((eval_bundle / "core.yaml").read_text())["icl_tasks"]}
    with open(eval_bundle / "eval_meta_data.csv", newline="", encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    missing = [label for label in CORE_LABELS if label not in tasks or label not in baselines]
    if missing:
        raise ValueError(f"{eval_bundle}: core.yaml / eval_meta_data.csv lack CORE tasks {missing}")
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "tasks.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(TASKS_CSV_FIELDS)
        for label in CORE_LABELS:
            t = tasks[label]
            writer.writerow([label, t["icl_task_type"], t["num_fewshot"][0],
                             _escape(t.get("continuation_delimiter", " ")), t["dataset_uri"],
                             f"{baselines[label]:g}", f"{V2_BASELINES.get(label, baselines[label]):g}"])
    shutil.rmtree(dest / "eval_data", ignore_errors=True)
    shutil.copytree(eval_bundle / "eval_data", dest / "eval_data")
    return read_manifest(dest)


def fetch(dest: str | Path, url: str = BUNDLE_URL) -> dict[str, CoreTask]:
    """Download ``url`` (eval_bundle.zip) and convert it into a bundle folder at ``dest``.
    Raises OSError (with the URL) where there is no network."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "eval_bundle.zip"
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise OSError(f"cannot download the CORE bundle from {url}: {getattr(e, 'reason', e)}. "
                          "Without a network, fetch it elsewhere and copy the folder over "
                          "(then pass it as --core, [eval] core_bundle or LANEFORMER_CORE_BUNDLE)") from None
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        unpacked = next((p.parent for p in Path(tmp).rglob("core.yaml")), None)
        if unpacked is None:
            raise ValueError(f"{url}: the archive holds no core.yaml")
        return convert(unpacked, Path(dest))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Get the CORE evaluation bundle (DCLM's tasks, as nanochat uses them).")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download eval_bundle.zip and write a bundle folder (tasks.csv, eval_data/)")
    f.add_argument("dir", type=Path)
    f.add_argument("--url", default=BUNDLE_URL)
    args = p.parse_args(argv)
    if not writable(args.dir):  # bad input, said before a download
        print(f"error: {args.dir} cannot be written", file=sys.stderr)
        return 2
    try:
        tasks = fetch(args.dir, args.url)
    except OSError as e:  # the network, not the input
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    present = sum(t.path(args.dir).is_file() for t in tasks.values())
    print(f"{args.dir}: {present} of {len(tasks)} CORE task files; use it with --core {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
