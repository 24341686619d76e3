"""``launch.slurm submit`` runs train.py's checks and plans a GPU job's memory first: it
refuses a recipe with a problem or one that does not fit, and ``--dry-run`` shows the verdict.

No SLURM needed: all of it comes before anything is written or submitted.
"""

from __future__ import annotations

import re
import subprocess

from launch.slurm import main


def test_submit_refuses_a_recipe_that_does_not_fit_and_writes_nothing(tmp_path, capsys):
    # tiny with a 8M-wide MLP: ~12.9e9 parameters, 16 B each over 2 GPUs > 90% of an H100
    code = main(["submit", "--recipe", "tiny.toml", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "h100",
                 "--set", "model.ffn_hidden_dim=8388608", "--set", f"run.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"^peak memory per GPU: [\d.]+ GiB of 79.6 GiB \(does not fit\)$", err, re.M)
    assert re.search(r"^sharded params\+grads\+optimizer per GPU: (\d+\.\d+) GiB$", err, re.M)
    assert "does not fit 2 x h100" in err and "--no-plan submits anyway" in err
    assert not (tmp_path / "run").exists()


def test_submit_refuses_missing_data_naming_it_and_writes_nothing(tmp_path, capsys):
    code = main(["submit", "--recipe", "tiny.toml", "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
                 "--set", 'data.sources=[{name = "code", path = "assets/sample_data/nope", weight = 1.0}]',
                 "--set", f"run.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"^error: .*\[data.sources\[0\]\] path: .*assets/sample_data/nope not found", err, re.M), err
    assert not (tmp_path / "run").exists()


def test_a_dry_run_without_preflight_says_what_it_did_not_check(tmp_path, capsys):
    # the data and the tokenizer missing: --no-preflight does not look, and says so
    code = main(["submit", "--recipe", "tiny.toml", "--nodes", "1", "--gpus-per-node", "2", "--no-plan",
                 "--set", 'data.sources=[{name = "code", path = "assets/sample_data/nope", weight = 1.0}]',
                 "--set", 'data.tokenizer="assets/nope/tokenizer.model"',
                 "--set", f"run.output_dir={tmp_path / 'run'}", "--dry-run", "--no-preflight"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.rstrip().endswith("# checks: the model passed; skipped: tokenizer, data, init_from and writable dirs "
                                 "(--no-preflight: the job checks them); the memory plan (--no-plan); "
                                 "a submit would queue this job"), out[-500:]
    assert "all passed" not in out


def test_dry_run_is_a_valid_script_with_the_plan_and_the_verdict_as_comments(tmp_path, capsys):
    # 2 nodes x 2 GPUs, HSDP with one replica per node: the plan's communication crosses the network
    code = main(["submit", "--recipe", "tiny.toml", "--nodes", "2", "--gpus-per-node", "2", "--gpu", "h100",
                 "--set", "training.micro_batch=2", "--set", "parallel.shard=2", "--set", "parallel.replicate=-1",
                 "--set", f"run.output_dir={tmp_path / 'run'}", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("#!/bin/bash") and "#SBATCH --gpus-per-node=2" in out
    assert re.search(r"^# peak memory per GPU: [\d.]+ GiB of 79.6 GiB \(fits\)$", out, re.M)
    assert re.search(r"^# communication per GPU per step: HSDP 2 x 2 .* on 4 GPUs \(2 nodes; cluster h100-ib400 "
                     r"with gpus_per_node=2", out, re.M)
    network = re.search(r"^# network bytes per GPU per step: ([\d.e-]+) GB$", out, re.M)
    assert network and float(network.group(1)) > 0
    for line in (r"intra-node bytes per GPU per step: [\d.e-]+ GB",
                 r"exposed communication per step: [\d.e-]+ s \([\d.]+% of the step\)",
                 r"roofline with communication: [\d,]+ tokens/s/GPU, MFU [\d.]+%"):
        assert re.search(f"^# {line}$", out, re.M), line
    assert out.rstrip().endswith("# checks: all passed; a submit would queue this job")
    (tmp_path / "job.sbatch").write_text(out)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert not (tmp_path / "run").exists()
