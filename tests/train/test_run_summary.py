"""The end-of-run summary (train.py's run_summary): its "next" commands do something.

Each suggested ``eval.run`` command is parsed by eval.run itself: it names a task
(so it gets past "nothing to evaluate") and then stops at its missing data (the CORE bundle or
the EvalPlus releases), which is checked before the checkpoint.
"""

import importlib.util
import shlex

import pytest

from eval.run import main as eval_main
from rundir import REPO
from train import recipe as R

# train.py is a script beside the train/ package: load it under another name.
_spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
train_entry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_entry)
run_summary = train_entry.run_summary


def next_commands(summary: str) -> dict[str, str]:
    lines = summary.split("\n")
    return {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
            for line in lines[lines.index("next:") + 1:] if ":" in line and not line.lstrip().startswith("(")}


@pytest.mark.parametrize("name, sets, tasks", [
    ("tiny.toml", [], ["--core", "core_bundle", "--max-per-task", "100"]),
    ("sft.toml", ["checkpoint.init_from=null"], ["--evalplus", "humaneval,mbpp", "--chat"]),
])
def test_the_suggested_eval_command_scores_the_export(tmp_path, capsys, name, sets, tasks):
    recipe = R.load(name, [f"run.output_dir={tmp_path / 'run'}", *sets])
    summary = run_summary(recipe, name, [])
    assert summary.startswith(f"run dir: {tmp_path / 'run'}\nfinal loss: not logged\nnext:\n")
    commands = next_commands(summary)
    export = tmp_path / "run" / "hf"
    if recipe.checkpoint.export_hf:
        assert commands["export"] == f"written to {export}"
    else:
        assert commands["export"] == f"python -m models.laneformer.convert to-hf {tmp_path / 'run'} {export}"
    argv = shlex.split(commands["evaluate"])
    assert argv[:5] == ["python", "-m", "eval.run", "--checkpoint", str(export)] and argv[5:] == tasks
    assert ("eval.core_data fetch core_bundle" in summary) == ("--core" in tasks)

    if "--evalplus" in tasks:  # no release files here (no network): the data comes first, then the model
        argv += ["--evalplus-data", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        eval_main(argv[3:])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "nothing to evaluate" not in err
    # the inputs are checked before the checkpoint is opened: the missing data says so first
    assert (f"{tmp_path}: --evalplus-data: no HumanEvalPlus.jsonl.gz" if "--evalplus" in tasks
            else "CORE bundle core_bundle: no tasks.csv (no such folder); get the bundle with "
                 "python -m eval.core_data fetch DIR") in err
