"""Issue 45's "one place per stage" and "one pass over the recipe": a process resolves its recipe once
and hands the resolved object on; whether a run is a preference run is asked in train/preference/
alone (and the recipe's schema, which declares the table); a preference run's trainer has no
cross-entropy; a pair source is checked in one place; no product file is over 600 lines."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
from pathlib import Path

import pytest

from rundir import REPO
from train import recipe as R
from train.recipe import loading

# train.py is a script beside the train/ package: load it under another name (as test_run_summary does).
_spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
train_entry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_entry)


@pytest.fixture
def resolutions(monkeypatch) -> list[str]:
    """The recipes ``train.recipe.load`` resolves from now on, by path."""
    seen, resolve = [], loading.resolve

    def counted(recipe):
        seen.append(recipe.path)
        return resolve(recipe)

    monkeypatch.setattr(loading, "resolve", counted)
    return seen


@pytest.mark.parametrize("name", ["tiny", "tiny-dpo"])
def test_train_py_resolves_its_recipe_once(name, resolutions, tmp_path):
    """A dry run goes through everything a launch checks (preflight) and plans (the data, the model):
    all of it reads the one resolved recipe (tiny-dpo's is refused at the end: no runs/tiny-sft here)."""
    train_entry.main(["--recipe", name, "--dry-run", "--set", f"run.output_dir={tmp_path / 'run'}"])
    assert resolutions == [str(R.find(name))]


def test_launch_local_resolves_its_recipe_once(resolutions, tmp_path, monkeypatch):
    """launch.local's own process: the recipe, the preflight, the claim of the run dir (refused here,
    before torchrun would start the ranks, each a process resolving its own)."""
    import launch.local

    monkeypatch.setattr(launch.local, "claim", lambda *args, **kwargs: "held by another launch (test)")
    assert launch.local.main(["--recipe", "tiny", "--set", f"run.output_dir={tmp_path / 'run'}"]) == 2
    assert resolutions == [str(R.find("tiny"))]


def test_validation_sets_are_resolved_with_the_recipe_and_a_clash_names_file_table_key(tmp_path):
    recipe = R.load("tiny", [f"run.output_dir={tmp_path}"])
    assert recipe.validation_sets == {s.name: f"{s.path}/held_out" for s in recipe.data.sources}
    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[eval\] val_sources\[0\]: .*/prose would be named "
                                            r"'prose', as another held-out set is: rename its folder"):
        R.load("tiny", ['eval.val_sources=["assets/sample_data/prose"]'])


def preference_askers(root: Path) -> list[str]:
    """``file:line`` of every ``<x>.preference.loss`` in train/ and train.py outside train/preference/ and
    the recipe's schema (which declares the table and checks what it asks of [training])."""
    allowed = (root / "train" / "preference", root / "train" / "recipe" / "schema.py")
    found = []
    for path in sorted([*(root / "train").rglob("*.py"), *(root / "plan").rglob("*.py"), root / "train.py"]):
        if any(path == a or a in path.parents for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "loss" and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "preference"):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_only_train_preference_asks_whether_a_run_is_a_preference_run(tmp_path):
    assert preference_askers(REPO) == []
    planted = tmp_path / "train" / "build" / "config.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f(recipe):\n    return recipe.preference.loss is not None\n")
    (tmp_path / "train" / "preference").mkdir()
    (tmp_path / "train" / "preference" / "build.py").write_text("x = recipe.preference.loss\n")
    (tmp_path / "train.py").write_text("")
    assert preference_askers(tmp_path) == ["train/build/config.py:2"]


def test_a_preference_run_gets_its_trainer_pairs_and_no_cross_entropy(tmp_path):
    """train.preference.build.configure: the preference trainer, its pair loader, the recipe's [preference]
    values (their only defaults), the held-out pairs in the eval callback, and a loss slot that refuses
    a call rather than a cross-entropy over pairs."""
    from torchtitan.components.loss import CrossEntropyLoss

    from data.pairs_loader import PairDataLoader
    from train.build import trainer_config
    from train.callbacks.eval import Eval
    from train.preference.build import TrainerLoss
    from train.preference.trainer import PreferenceTrainer

    init = tmp_path / "sft" / "checkpoints" / "step-1"
    init.mkdir(parents=True)
    (init / ".metadata").write_bytes(b"")
    recipe = R.load("tiny-dpo", [f"run.output_dir={tmp_path / 'run'}", f"checkpoint.init_from={tmp_path / 'sft'}"])
    config = trainer_config(recipe)
    assert type(config) is PreferenceTrainer.Config and type(config.dataloader) is PairDataLoader.Config
    assert type(config.loss) is TrainerLoss.Config
    with pytest.raises(RuntimeError, match="a preference run's loss is its trainer's"):
        config.loss.build()(None, None)
    pref = R.Preference(loss="dpo")  # the table's defaults: beta 0.1, label_smoothing 0, gamma 0.3 x beta
    assert config.preference is recipe.preference  # the table itself: its defaults are the only ones
    got = config.preference
    assert (got.loss, got.beta, got.label_smoothing, got.gamma) == (
        "dpo", pref.beta, pref.label_smoothing, pytest.approx(0.3 * pref.beta))
    assert [c.pairs for c in config.callbacks if isinstance(c, Eval.Config)] == [True]
    plain = trainer_config(R.load("tiny", [f"run.output_dir={tmp_path / 'run'}"]))
    assert type(plain.loss) is CrossEntropyLoss.Config
    assert [c.pairs for c in plain.callbacks if isinstance(c, Eval.Config)] == [False]


def test_a_pair_source_is_checked_in_one_place(tmp_path):
    """data.pairs.open_pairs: the loader's PairSet and the plain reader pairs_of refuse alike."""
    from data.pairs import PairError, pairs_of
    from data.pairs_loader import PairSet

    not_pairs = REPO / "assets" / "chat" / "held_out"
    with pytest.raises(PairError) as by_reader:
        next(pairs_of(not_pairs))
    with pytest.raises(PairError) as by_loader:
        PairSet([not_pairs], seq_len=128)
    assert str(by_reader.value) == str(by_loader.value) == (
        f"{not_pairs / 'manifest.json'}: no 'pairs' entry: not a pair source (tokenize it with "
        "`python -m data.tokenize --pairs`)")


def test_no_product_file_is_over_600_lines():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    long = {f: n for f in tracked if not f.startswith("tests/") and (REPO / f).is_file()
            and (n := len((REPO / f).read_text().splitlines())) > 600}
    assert long == {}
