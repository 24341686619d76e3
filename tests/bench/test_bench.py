"""Smoke tests of the benchmarks in bench/ (tiny sizes), and the MFU arithmetic.

Timing goals live only in the benchmarks, as ratios against a baseline from
the same run; these tests only check that each benchmark runs end to end and
prints its final ratio line, never how fast anything is.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from bench import checkpoint, compile as compile_bench, dataloader, gpu_throughput, lanes_vs_dense
from models.laneformer import laneformer_configs
from models.laneformer.flops import nparams_and_flops_per_token
from rundir import REPO

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-size smoke test")


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


@cpu_only
def test_lanes_vs_dense_smoke(capsys):
    rows = lanes_vs_dense.main(["--flavors", "tiny", "--seq", "32", "--batch", "1", "--modes", "eager",
                                "--warmup", "1", "--steps", "1"])
    assert [r["mode"] for r in rows] == ["eager"]
    assert rows[0]["params"] == "2,098,304"  # the dense twin has exactly the Laneformer's parameters
    assert last_line(capsys).startswith("RATIO lanes/dense step time at tiny (target <= 1.25x): eager ")


@cpu_only
def test_compile_smoke(capsys):
    out = compile_bench.main(["--seq", "32", "--batch", "1", "--warmup", "1", "--steps", "1"])
    assert out["ratio"] > 0
    assert last_line(capsys).startswith("RATIO compiled/eager step time (tiny): ")


@cpu_only
def test_checkpoint_smoke(capsys, tmp_path):
    out = checkpoint.main(["--flavor", "tiny", "--repeats", "1", "--dir", str(tmp_path)])
    assert out["gb"] > 0
    assert last_line(capsys).startswith("RATIO async stall / sync save: ")
    assert list(tmp_path.iterdir()) == []  # cleaned up


@cpu_only
def test_dataloader_smoke(capsys):
    out = dataloader.main(["--seq", "256", "--batches", "2", "--synthetic-tokens", "200000"])
    assert len(out["rows"]) == 2
    assert last_line(capsys).startswith("RATIO loader tokens/s / GPU need: ")


def test_step_overhead_smoke():
    """In its own process: it builds two torchtitan trainers, each initializing torch.distributed."""
    r = subprocess.run([sys.executable, "-m", "bench.step_overhead", "--seq", "32", "--batch", "2",
                        "--steps", "2", "--rounds", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert any(line.split()[:1] == ["project"] for line in lines) and any(
        line.split()[:1] == ["torchtitan"] for line in lines)
    assert re.fullmatch(r"RATIO project/torchtitan step time: [\d.]+x", lines[-1])


def test_gpu_throughput_refuses_politely_without_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_throughput"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU found" in r.stdout


def test_mfu_formula():
    """MFU of the 2B's FLOPs per token (hand-computed in tests/models/test_model.py)."""
    config = laneformer_configs["2B"]()
    with torch.device("meta"):
        model = config.build()
    _, flops = nparams_and_flops_per_token(config, model, 4096)
    # MFU = FLOPs/token * tokens/s / peak; Kog's ~17k tokens/s/GPU on H100s -> ~25.5%.
    assert gpu_throughput.mfu(flops, 17_000, 989e12) == pytest.approx(14_840_543_232 * 17_000 / 989e12)
    assert gpu_throughput.mfu(flops, 17_000, 989e12) == pytest.approx(0.2551, abs=1e-4)
    assert gpu_throughput.peak_flops("NVIDIA H100 80GB HBM3") == gpu_throughput.peak_flops("NVIDIA H200") == 989e12
    # The loader's yardstick: tokens/s/GPU at 40% MFU, the inverse of the same formula.
    need = dataloader.gpu_tokens_per_s()
    assert need == pytest.approx(0.4 * 989e12 / 14_840_543_232)
    assert gpu_throughput.mfu(flops, need, 989e12) == pytest.approx(0.4)
