"""A resume goes on with the model and data order its checkpoints were trained with (train.build.resume):
a recipe edited between launches is refused before anything is written, naming the key, the value the
run was trained with and the file that says so; what a resume may change passes. Before, a model that
no longer fit failed inside the load and every checkpoint of the run was moved aside as damaged in turn,
and a changed mixture went on silently with another data order."""

from __future__ import annotations

import shutil

import pytest

import rundir
from tests.conftest import SHORT, reference_run, train
from train import recipe as R
from train.recipe import model_config
from train.build.resume import check_resume
from train.snapshot import record_launch


@pytest.fixture
def trained(tmp_path):
    """A run dir as a launch of tiny.toml leaves it: its recipe.toml and laneformer_config.json written by
    the launch's own writer, and a complete checkpoint (what the check looks for; it reads none of it)."""
    run = tmp_path / "run"
    recipe = R.load("tiny", [f"run.output_dir={run}"])
    record_launch(recipe, model_config(recipe))
    (rundir.step_dir(run, 100)).mkdir(parents=True)
    (rundir.step_dir(run, 100) / ".metadata").write_bytes(b"")
    return run


def problems(run, *sets):
    recipe = R.load("tiny", [f"run.output_dir={run}", *sets])
    return check_resume(recipe, model_config(recipe))


def test_what_a_resume_may_change_passes(trained):
    assert problems(trained) == []
    assert problems(trained, "training.steps=600", "optimizer.lr=1e-3", "training.global_batch=32",
                    "model.init_std=0.01", "data.sources.code.path=/elsewhere/code", "data.root=/elsewhere") == []
    shutil.rmtree(rundir.step_dir(trained, 100))  # no complete checkpoint: nothing to resume, anything goes
    assert problems(trained, "model.ffn_hidden_dim=256", "training.seq_len=64") == []


def test_a_changed_model_or_data_order_is_refused_naming_key_value_and_file(trained):
    then = f"but the checkpoints in {trained} were trained with"
    [weight] = problems(trained, "data.sources.code.weight=0.3")
    assert weight == (f"--set data.sources.code.weight=0.3 (over {R.RECIPES / 'tiny.toml'}): [data.sources[1]] weight: "
                      f"0.3, {then} 0.5 ({trained / 'recipe.toml'}). A resume goes on with their model and data "
                      "order: restore it, or train the change in another run dir ([run] name) from these weights "
                      f"([checkpoint] init_from = \"{trained}\")")
    found = problems(trained, "model.ffn_hidden_dim=256", "model.rope_theta_global=1e6", "training.seq_len=64",
                     "run.seed=7")
    assert [line.split(", but")[0].split(": ", 1)[1] for line in found] == [
        "[model] ffn_hidden_dim: 256", "[model] rope_theta_global: 1000000.0", "[training] seq_len: 64",
        "[run] seed: 7"]
    assert f"{then} 512 ({trained / 'laneformer_config.json'})" in found[0]
    assert f"{then} None" in found[1] and f"{then} 128 (" in found[2]
    [renamed] = problems(trained, "data.sources.code.name=kode")
    assert f"[data] sources: ['prose', 'kode'], {then} ['prose', 'code']" in renamed


@pytest.mark.slow
def test_a_launch_with_another_model_is_refused_and_its_checkpoints_stay(reference, tmp_path_factory, tmp_path):
    """For real, on a copy of the session's 2-rank reference run: exit 2, nothing written, no checkpoint moved
    aside (before: each one in turn, 'no complete checkpoint is left'). Without the run's records to compare
    with, a load that meets another data order is not taken for damage either."""
    run = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory), run)
    steps, launches = rundir.complete_steps(run), sorted((run / rundir.LAUNCHES_DIR).iterdir())
    result = train("tiny.toml", f"run.output_dir={run}", *SHORT, "model.ffn_hidden_dim=256")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "[model] ffn_hidden_dim: 256, but the checkpoints in" in result.stderr
    assert rundir.complete_steps(run) == steps and sorted((run / rundir.LAUNCHES_DIR).iterdir()) == launches

    (run / rundir.RECIPE_FILE).unlink()  # a run dir from before the records: the load itself meets the change
    result = train("tiny.toml", f"run.output_dir={run}", *SHORT, "training.seq_len=128")
    assert result.returncode == 1
    assert (f"checkpoint {rundir.step_dir(run, steps[-1])} does not fit this run's data (checkpoint was written "
            "with seq_len=64 seed=1234, this mixture has seq_len=128 seed=1234); it is left as it is") in result.stderr
    assert rundir.complete_steps(run) == steps and not list(rundir.checkpoints_dir(run).glob("*.damaged*"))


def test_a_record_that_cannot_be_read_is_named(trained):
    (trained / "laneformer_config.json").write_text("{")
    [problem] = problems(trained)
    assert problem.startswith(f"{trained / 'laneformer_config.json'}: cannot be read (Expecting property name")
