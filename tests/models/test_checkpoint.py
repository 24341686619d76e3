"""models.laneformer.checkpoint: the one rule for what is at a path (no weights are read here)."""

import pytest

import rundir
from models.laneformer.checkpoint import open_checkpoint


def step(run, n, complete=True):
    folder = rundir.step_dir(run, n)
    folder.mkdir(parents=True)
    if complete:
        (folder / ".metadata").write_bytes(b"")
    return folder


def test_each_kind_names_its_step_and_run(tmp_path):
    run = tmp_path / "run"
    step(run, 2), step(run, 10), step(run, 12, complete=False)  # 12 is half-written
    assert open_checkpoint(run) == open_checkpoint(str(run))
    got = open_checkpoint(run)
    assert (got.kind, got.step_dir, got.run_dir, got.folder) == ("run", run / "checkpoints/step-10", run,
                                                                   run / "checkpoints/step-10")
    got = open_checkpoint(run / "checkpoints/step-2")
    assert (got.kind, got.step_dir, got.run_dir) == ("step", run / "checkpoints/step-2", run)

    imported = tmp_path / "imported"  # convert from-hf: a step dir outside any run
    imported.mkdir()
    (imported / ".metadata").write_bytes(b"")
    got = open_checkpoint(imported)
    assert (got.kind, got.step_dir, got.run_dir) == ("step", imported, None)

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    got = open_checkpoint(hf)
    assert (got.kind, got.step_dir, got.run_dir, got.folder) == ("hf", None, None, hf)


@pytest.mark.parametrize("files", [(), ("config.json",), ("model.safetensors",)])
def test_a_folder_with_no_checkpoint_is_refused_naming_what_was_looked_for(tmp_path, files):
    for name in files:  # config.json without weights is no export (nor is a lone weights file)
        (tmp_path / name).write_text("{}")
    step(tmp_path, 3, complete=False)
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path}: neither a DCP checkpoint \(\.metadata\) nor a run "
                                                r"with complete checkpoints/step-<N> nor an HF export \(config\.json "
                                                r"and \*\.safetensors\)$"):
        open_checkpoint(tmp_path)


def test_the_chat_template_of_a_step_is_its_runs_recorded_one(tmp_path):
    run = tmp_path / "run"
    step(run, 1)
    (run / rundir.RECIPE_FILE).write_text('[data]\nchat_template = "recipes/chat/x.jinja"\n')
    assert open_checkpoint(run / "checkpoints/step-1").chat_template() == str(rundir.REPO / "recipes/chat/x.jinja")
    assert open_checkpoint(run).chat_template() == str(rundir.REPO / "recipes/chat/x.jinja")
    (run / rundir.RECIPE_FILE).write_text('[data]\nchat_template = "llama2"\n')
    assert open_checkpoint(run).chat_template() == "llama2"
    (run / rundir.RECIPE_FILE).unlink()
    assert open_checkpoint(run).chat_template() is None
