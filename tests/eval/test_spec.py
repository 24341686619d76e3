"""eval.spec.EvalSpec: one description of what to evaluate, for the recipe, the trainer's hook and eval.run."""

from __future__ import annotations

import dataclasses

import pytest

from eval.spec import EVALPLUS_DATASETS, EvalSpec, EvalSpecError
from train import recipe as R


def spec_from_flags(monkeypatch, argv: list[str]) -> EvalSpec:
    """The EvalSpec eval.run builds from ``argv`` (stopped before it loads anything)."""
    import eval.run as run

    seen, spec_of = {}, run.spec_of

    def stop(args):
        seen["spec"] = spec_of(args)
        raise SystemExit(0)

    monkeypatch.setattr(run, "spec_of", stop)
    with pytest.raises(SystemExit):
        run.main(["--checkpoint", "x", *argv])
    return seen["spec"]


def test_flag_defaults_are_the_spec_defaults(monkeypatch):
    """eval.run with only a task flag asks for exactly EvalSpec's defaults (nothing restated in the CLI)."""
    assert spec_from_flags(monkeypatch, ["--core", "bundle"]) == EvalSpec(core_bundle="bundle")


def test_flags_reach_the_spec(monkeypatch):
    spec = spec_from_flags(monkeypatch, [
        "--core", "b", "--max-per-task", "3", "--core-tasks", "a,c", "--humaneval", "--limit", "7", "--samples", "2",
        "--temperature", "0.5", "--max-new-tokens", "9", "--evalplus", "mbpp,humaneval", "--chat",
        "--evalplus-find-zero", "released", "--top-p", "0.8", "--seed", "5"])
    assert spec == EvalSpec(core_bundle="b", core_max_per_task=3, core_tasks=["a", "c"], lm_eval_limit=7,
                            humaneval=True, humaneval_limit=7, humaneval_samples=2, humaneval_temperature=0.5,
                            humaneval_max_new_tokens=9, evalplus="mbpp,humaneval", evalplus_limit=7,
                            evalplus_chat=True, evalplus_max_new_tokens=9, evalplus_find_zero="released",
                            evalplus_samples=2, evalplus_temperature=0.5, evalplus_top_p=0.8, evalplus_seed=5)
    assert spec.evalplus_datasets == ["mbpp", "humaneval"]


@pytest.mark.parametrize("values, message", [
    ({"evalplus": "humaneval,apps"}, "evalplus: 'humaneval,apps': expected a comma list"),
    ({"evalplus": "mbpp,mbpp"}, "evalplus: 'mbpp,mbpp': expected a comma list"),
    ({"evalplus_limit": 0}, r"evalplus_limit: must be > 0 \(got 0\)"),
    ({"val_samples": -1}, r"val_samples: must be > 0 \(got -1\)"),
    ({"humaneval_temperature": -0.1}, r"humaneval_temperature: must be >= 0"),
    ({"evalplus_samples": 0}, r"evalplus_samples: must be > 0 \(got 0\)"),
    ({"evalplus_temperature": -1.0}, r"evalplus_temperature: must be >= 0"),
    ({"evalplus_top_p": 0.0}, r"evalplus_top_p: must be in \(0, 1\] \(got 0.0\)"),
    ({"evalplus_top_p": 1.5}, r"evalplus_top_p: must be in \(0, 1\]"),
    ({"evalplus": "mbpp", "evalplus_samples": 4}, r"^evalplus_samples: 4 answers a task at evalplus_temperature 0 "
                                                  r"would all be the greedy one: set evalplus_temperature > 0 "
                                                  r"\(or evalplus_samples 1\)$"),
    ({"humaneval": True, "humaneval_samples": 4}, r"^humaneval_samples: 4 answers a task at humaneval_temperature 0 "
                                                  r"would all be the greedy one: set humaneval_temperature > 0 "
                                                  r"\(or humaneval_samples 1\)$"),
])
def test_bad_values_name_the_field(values, message):
    with pytest.raises(EvalSpecError, match=message):
        EvalSpec(**values)


def test_recipe_eval_is_the_spec_plus_when(tmp_path):
    """[eval] parses into EvalSpec's checks (errors name file, table and key), adds every/at_end and a
    quicker in-training size; the hook gets the plain spec; the resolved TOML reads back the same."""
    assert issubclass(R.Eval, EvalSpec)
    assert {f.name for f in dataclasses.fields(R.Eval)} - {f.name for f in dataclasses.fields(EvalSpec)} == {
        "every", "at_end"}
    assert (R.Eval().core_max_per_task, R.Eval().evalplus_limit) == (50, 20)
    assert (EvalSpec().core_max_per_task, EvalSpec().evalplus_limit) == (None, None)  # eval.run: all

    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[eval\] evalplus: 'apps': expected a comma list"):
        R.load("tiny.toml", ['eval.evalplus="apps"'])
    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[eval\] core_max_per_task: must be > 0 \(got 0\)"):
        R.load("tiny.toml", ["eval.core_max_per_task=0"])
    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[eval\] every: must be >= 0 \(got -1\)"):
        R.load("tiny.toml", ["eval.every=-1"])
    with pytest.raises(R.RecipeError, match=r"\[eval\] evalplus_find_zero: must be one of \['fixed', 'released'\]"):
        R.load("tiny.toml", ['eval.evalplus_find_zero="x"'])
    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[eval\] humaneval_samples: 3 answers a task at "
                                            r"humaneval_temperature 0 would all be the greedy one"):
        R.load("tiny.toml", ["eval.humaneval=true", "eval.humaneval_samples=3"])

    data = tmp_path / "HumanEvalPlus.jsonl"
    r = R.load("tiny.toml", ['eval.evalplus="humaneval,mbpp"', f'eval.evalplus_data="{data},rel/MbppPlus.jsonl"',
                             "eval.humaneval=true", "eval.humaneval_samples=3", "eval.humaneval_temperature=0.8"])
    assert r.eval.evalplus_data == f"{data},{R.absolute('rel/MbppPlus.jsonl')}"  # each file made absolute
    spec = r.eval.spec()
    assert type(spec) is EvalSpec and spec.humaneval_samples == 3 and spec.evalplus_datasets == ["humaneval", "mbpp"]
    assert {f.name: getattr(r.eval, f.name) for f in dataclasses.fields(EvalSpec)} == dataclasses.asdict(spec)
    (tmp_path / "resolved.toml").write_text(R.to_toml(r))
    assert R.load(str(tmp_path / "resolved.toml")).eval == r.eval


def test_benchmarks_run_apart():
    """The trainer runs each benchmark on its own (one failing leaves the others): each part has only its own on."""
    spec = EvalSpec(val_sources=["v"], core_bundle="b", humaneval=True, evalplus="mbpp", evalplus_limit=3)
    parts = spec.benchmarks()
    assert list(parts) == ["core", "humaneval", "evalplus"]
    assert parts["core"] == dataclasses.replace(spec, humaneval=False, evalplus=None)
    assert parts["evalplus"] == dataclasses.replace(spec, core_bundle=None, humaneval=False)
    assert EvalSpec().benchmarks() == {}


def test_dataset_names_are_evalplus_releases():
    from eval.evalplus import RELEASES

    assert set(EVALPLUS_DATASETS) == set(RELEASES)
