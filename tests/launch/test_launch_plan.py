"""``launch.slurm submit`` plans a GPU job's memory first and refuses one that does not fit.

No SLURM needed: the refusal comes before anything is written or submitted.
"""

from __future__ import annotations

import re

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
