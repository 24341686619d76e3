"""``python -m eval.core_data fetch DIR``: nanochat's eval_bundle.zip layout (core.yaml,
eval_meta_data.csv, eval_data/) becomes a bundle folder that eval.core reads; offline it
fails with a clear message. The archive here is built in that layout and read through
a file:// URL (no network here)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import zipfile

import yaml

from eval.core_data import CORE_LABELS, V2_BASELINES, load_items, read_manifest
from rundir import REPO
from tests.eval.conftest import CORE_ROWS, TOY

DELIMITERS = {"arc_easy": "\nAnswer: ", "piqa": "\nAnswer: ", "jeopardy": "\nAnswer: "}


def nanochat_zip(path) -> None:
    icl_tasks = [{"label": label, "dataset_uri": file, "num_fewshot": [shots], "icl_task_type": kind,
                  **({"continuation_delimiter": DELIMITERS[label]} if label in DELIMITERS else {})}
                 for label, kind, shots, file, _, _ in CORE_ROWS]
    meta = io.StringIO()
    writer = csv.writer(meta)
    writer.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline"])
    for label, kind, shots, _, v1, _ in CORE_ROWS:
        writer.writerow([label, "x", kind, shots, 3, v1])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("eval_bundle/core.yaml", yaml.safe_dump({"icl_tasks": icl_tasks}))
        z.writestr("eval_bundle/eval_meta_data.csv", meta.getvalue())
        for file, kind in {file: kind for _, kind, _, file, _, _ in CORE_ROWS}.items():  # hellaswag: 2 tasks
            z.writestr(f"eval_bundle/eval_data/{file}", "".join(json.dumps(it) + "\n" for it in TOY[kind]))


def fetch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval.core_data", "fetch", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_fetch_converts_nanochats_bundle(tmp_path):
    nanochat_zip(tmp_path / "eval_bundle.zip")
    result = fetch(str(tmp_path / "core"), "--url", (tmp_path / "eval_bundle.zip").as_uri())
    assert result.returncode == 0, result.stderr
    assert "22 of 22 CORE task files" in result.stdout
    tasks = read_manifest(tmp_path / "core")
    assert list(tasks) == list(CORE_LABELS)
    for label, kind, shots, file, v1, v2 in CORE_ROWS:
        task = tasks[label]
        assert (task.type, task.shots, task.file) == (kind, shots, file)
        assert task.delimiter == DELIMITERS.get(label, " ")
        assert task.baselines == {"v1": v1 / 100, "v2": V2_BASELINES.get(label, v1) / 100}
        assert task.baselines["v2"] == v2 / 100  # DCLM's corrections, as in the real bundle
        assert load_items(tmp_path / "core", task) != []


def test_fetch_without_a_network_says_what_to_do(tmp_path):
    result = fetch(str(tmp_path / "core"), "--url", "http://127.0.0.1:9/eval_bundle.zip")
    assert result.returncode == 1
    assert "cannot download the CORE bundle from http://127.0.0.1:9/eval_bundle.zip" in result.stderr
    assert "LANEFORMER_CORE_BUNDLE" in result.stderr
    assert not (tmp_path / "core").exists()
