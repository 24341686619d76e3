"""Issue 45's "one place per stage" and "one pass over the recipe", and issue 58's "one objective per run":
a process resolves its recipe once and hands the resolved object on; what kind of run it is
(``Recipe.objective``) is asked under that one name, its rule in train.recipe.objective; each objective is
one file, the build puts it in torchtitan's loss slot; a pair source is checked in one place; no product
file is over 600 lines."""

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


@pytest.mark.parametrize("name, objective", [("tiny", "cross_entropy"), ("tiny-dpo", "preference")])
def test_train_py_resolves_its_recipe_once(name, objective, resolutions, tmp_path, capsys):
    """A dry run goes through everything a launch checks (preflight) and plans (the data, the model):
    all of it reads the one resolved recipe (tiny-dpo's is refused at the end: no runs/tiny-sft here). It
    says which objective the run trains, and the file that holds its loss."""
    train_entry.main(["--recipe", name, "--dry-run", "--set", f"run.output_dir={tmp_path / 'run'}"])
    assert resolutions == [str(R.find(name))]
    assert f"objective: {objective} (train/objectives/{objective}.py)\n" in capsys.readouterr().out
    assert (REPO / "train" / "objectives" / f"{objective}.py").is_file()


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


PRODUCT = ("train", "plan", "report", "launch", "eval", "data", "models", "health", "rundir", "bench")
# The rule (train.recipe.objective), the table it reads (the schema, which declares [preference] and hands
# Recipe.objective its values), the objective itself and the preference package.
OWNERS = ("train/recipe/objective.py", "train/recipe/schema.py", "train/objectives/preference.py", "train/preference")


def _spelling(node: ast.AST) -> str | None:
    """Which spelling of "is this a preference run?" ``node`` is, if any."""
    if isinstance(node, ast.Attribute) and node.attr == "loss" and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "preference":
        return ".preference.loss"
    if isinstance(node, ast.Name) and node.id == "is_preference" or \
            isinstance(node, ast.Attribute) and node.attr == "is_preference" or \
            isinstance(node, ast.FunctionDef) and node.name == "is_preference":
        return "is_preference"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("any", "all") \
            and any(isinstance(n, ast.Attribute) and n.attr == "pairs" for a in node.args for n in ast.walk(a)):
        return f"{node.func.id}(... .pairs ...)"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "preference":
        return '.get("preference")'
    configures = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
        "Config", "replace")  # a callback's config (the eval's once had a flag for a preference run)
    if configures and any(k.arg == "pairs" for k in node.keywords) or isinstance(node, ast.Attribute) \
            and node.attr == "pairs" and isinstance(node.value, ast.Attribute) and node.value.attr == "config":
        return "a pairs flag"
    return None


def run_kind_askers(root: Path) -> list[str]:
    """``file:line: spelling`` of every way of asking whether a run is a preference run, in the product's code
    (train.py and its packages) outside the objective's owners: ``.preference.loss``, ``is_preference``,
    ``any(s.pairs ...)`` over the sources, ``recipe.get("preference")``, a ``pairs`` flag on a config. The one
    question is ``Recipe.objective`` (train.recipe.objective.objective_of on a recipe.toml)."""
    found = []
    paths = [p for d in PRODUCT for p in (root / d).rglob("*.py")] + [root / "train.py"]
    for path in sorted(p for p in paths if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if any(rel == o or rel.startswith(o + "/") for o in OWNERS):
            continue
        found += sorted({f"{rel}:{node.lineno}: {spelling}" for node in ast.walk(ast.parse(path.read_text(), rel))
                         if (spelling := _spelling(node))})
    return found


PLANTED = {
    "train/build/config.py": "def f(recipe):\n    return recipe.preference.loss is not None\n",
    "train/recipe/checks.py": "def f(recipe):\n    return any(s.pairs for s in recipe.data.sources)\n",
    "report/comparable.py": "def is_preference(recipe):\n    return bool(recipe.get('preference', {}).get('loss'))\n",
    "plan/data.py": "def f(recipe):\n    return any(source.pairs for source in recipe.data.sources)\n",
    "train/build/eval.py": "def f(Eval):\n    return Eval.Config(every=1, pairs=True)\n",
    "train/callbacks/eval.py": "def f(self):\n    return self.config.pairs\n",
    "train/objectives/preference.py": "x = recipe.preference.loss\n",  # the owner
}


def test_only_the_objective_asks_what_kind_of_run_this_is(tmp_path):
    assert run_kind_askers(REPO) == []
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "train.py").write_text("")
    assert run_kind_askers(tmp_path) == [
        "plan/data.py:2: any(... .pairs ...)",
        "report/comparable.py:1: is_preference",
        'report/comparable.py:2: .get("preference")',
        "train/build/config.py:2: .preference.loss",
        "train/build/eval.py:2: a pairs flag",
        "train/callbacks/eval.py:2: a pairs flag",
        "train/recipe/checks.py:2: any(... .pairs ...)",
    ]


def test_each_objective_is_one_file_and_the_build_gives_each_its_loss_slot_and_loader(tmp_path):
    """train.build: the run's objective (Recipe.objective) is torchtitan's loss slot, with its own loader; a
    preference run's objective holds the recipe's [preference] (its defaults are the only ones); the trainer
    is one class for every objective."""
    from data.loader import MixtureDataLoader
    from data.pairs_loader import PairDataLoader
    from train.build import trainer_config
    from train.objectives import OBJECTIVES
    from train.objectives.cross_entropy import CrossEntropy
    from train.objectives.preference import Preference
    from train.objectives.weighted_cross_entropy import WeightedCrossEntropy
    from train.recipe.objective import OBJECTIVE_NAMES
    from train.trainer import LaneformerTrainer

    assert tuple(OBJECTIVES) == OBJECTIVE_NAMES
    assert {o.__module__ for o in OBJECTIVES.values()} == {f"train.objectives.{n}" for n in OBJECTIVE_NAMES}
    init = tmp_path / "sft" / "checkpoints" / "step-1"
    init.mkdir(parents=True)
    (init / ".metadata").write_bytes(b"")
    out = f"run.output_dir={tmp_path / 'run'}"
    dpo = R.load("tiny-dpo", [out, f"checkpoint.init_from={tmp_path / 'sft'}"])
    weighted = R.load("tiny", [out, "data.sources.code.loss_weight=2"])
    built = {r.objective: trainer_config(r, 1) for r in (R.load("tiny", [out]), weighted, dpo)}
    assert {name: (type(c), type(c.loss), type(c.dataloader)) for name, c in built.items()} == {
        "cross_entropy": (LaneformerTrainer.Config, CrossEntropy.Config, MixtureDataLoader.Config),
        "weighted_cross_entropy": (LaneformerTrainer.Config, WeightedCrossEntropy.Config, MixtureDataLoader.Config),
        "preference": (LaneformerTrainer.Config, Preference.Config, PairDataLoader.Config),
    }
    pref = R.Preference(loss="dpo")  # the table's defaults: beta 0.1, label_smoothing 0, gamma 0.3 x beta
    got = built["preference"].loss.preference
    assert got is dpo.preference  # the table itself: its defaults are the only ones
    assert (got.loss, got.beta, got.label_smoothing, got.gamma) == (
        "dpo", pref.beta, pref.label_smoothing, pytest.approx(0.3 * pref.beta))


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
