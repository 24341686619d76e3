"""bench.gpu_check: the CPU exit, the planner's GPU kind, and its whole code path on CPU (--cpu-check)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from bench import gpu_check
from rundir import REPO
from tests.conftest import env

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")


def run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)


@cpu_only
def test_without_gpu_says_nothing_was_checked_and_exits_1(tmp_path, capsys):
    """Its main here (``python -m bench.gpu_check`` exits with what main returns): a process of its own
    would spend a minute under load importing what this one has imported already."""
    code = gpu_check.main(["--out", str(tmp_path / "g.json")])
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    assert "no CUDA GPU found, so nothing was checked" in err and "--cpu-check" in err
    assert not (tmp_path / "g.json").exists()


def test_names_the_planners_gpu_kind():
    assert gpu_check.gpu_kind("NVIDIA H200") == "h200"
    assert gpu_check.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_check.gpu_kind("Some Future GPU") == "h100"


@cpu_only
def test_context_parallel_check_is_skipped_not_passed_without_two_gpus():
    assert gpu_check.check_context_parallel(cpu=False) == {"result": "skipped: needs 2 GPUs, found 0", "ok": None}
    row = gpu_check.summary({"device": "x", "context_parallel": {"result": "skipped: needs 2 GPUs, found 1",
                                                                  "ok": None}})
    assert "5 context parallel 2 vs 1" in row and "skipped" in row


@pytest.mark.slow
def test_cpu_check_writes_every_field(tmp_path):
    out = tmp_path / "gpu_check.json"
    # Check 5 (CP 2 vs CP 1, the 2-rank script) through the same function: tests/models/test_context_parallel.py.
    result = run("--cpu-check", "--out", str(out), "--checks", "1,2,3,4")
    assert out.exists(), result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cpu_check"] is True
    # 1: the tiny flavor's two masks (window and full causal), forward only on CPU.
    assert {r["mask"] for r in report["attention"]} == {"window 32", "full causal"}
    assert all(r["ok"] and r["flex_err"] < 1e-4 for r in report["attention"])
    # 2: the loss falls and nothing recompiles after warm-up.
    (tiny,) = report["training"]
    assert tiny["loss_last5"] < tiny["loss_first5"] and tiny["graphs_after_warmup"] == 0
    # 3: measured throughput, and the planner's prediction beside it.
    big = report["big"]
    assert big["tokens_per_s"] > 0 and big["micro_batch"] >= 1 and big["ac"] in ("none", "selective", "full")
    assert big["predicted_peak_gib"] > 0, big.get("planner_output_tail")
    # 4: the lanes/dense ratio.
    assert math.isfinite(report["lanes_vs_dense"]["ratio"]) and report["lanes_vs_dense"]["ratio"] > 0
    assert "context_parallel" not in report  # not asked for
    # Every check above holds on CPU (the lanes/dense target is a GPU's), so the verdict is PASS.
    assert report["ok"] is True and result.returncode == 0, result.stdout[-2000:]
    assert "PASS" in result.stdout.splitlines()[-1]
