"""EvalPlus pass@N: pass@k is EvalPlus's unbiased estimator (checked against the formula by hand), the
samples and verdicts are EvalPlus's own files (its ``evalplus.evaluate`` reads them, scores them again
to the same verdicts and prints the same pass@1 and pass@10), a seed draws the same answers, and
the flags and ``[eval]`` fields reach the draw (eval.run, the training loop)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from data.tokenizer import TINY_TOKENIZER
from eval import evalplus
from eval.evalplus import EvalPlusResult, Sample, Verdict, pass_ks, sample_files, write_samples
from tests.conftest import metrics, short, train, write_tiny_run
from tests.eval.conftest import HUMANEVAL_TASKS, N, SAMPLED_ANSWERS
from tests.eval.conftest import sampled_evalplus as sampled
from tests.eval.evalplus_cases import HUMANEVAL, MBPP, write_release

@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("passn_data")
    return {"humaneval": write_release(out / "HumanEvalPlus.jsonl", HUMANEVAL_TASKS),
            "mbpp": write_release(out / "MbppPlus.jsonl", MBPP)}


@pytest.fixture(scope="module")
def results(releases) -> dict[str, EvalPlusResult]:
    return {"humaneval": sampled("humaneval", HUMANEVAL_TASKS), "mbpp": sampled("mbpp", MBPP)}


# --- pass@k -----------------------------------------------------------------------------------


def by_hand(n: int, c: int, k: int) -> float:
    """The unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_is_the_estimator_by_hand():
    """Three tasks of 5 samples: 2, 0 and 5 pass base; 1, 0 and 4 pass plus too."""
    def sample(base: bool, plus: bool) -> Sample:
        return Sample("", "", Verdict("pass" if base else "fail", "pass" if plus else "fail", [], []))

    counts = {"HumanEval/0": (2, 1), "HumanEval/1": (0, 0), "HumanEval/2": (5, 4)}
    result = EvalPlusResult("humaneval", False, {
        t: [sample(i < base, i < plus) for i in range(5)] for t, (base, plus) in counts.items()})
    expected = {}
    for name, which in (("humaneval", 0), ("humaneval+", 1)):
        for k in (1, 2, 4):
            expected[f"{name}/pass@{k}"] = sum(by_hand(5, c[which], k) for c in counts.values()) / 3
    assert result.metrics() == pytest.approx(expected, abs=1e-12)
    assert expected["humaneval/pass@2"] == pytest.approx((1 - 3 / 10 + 0 + 1) / 3)  # C(3,2)/C(5,2) = 3/10


def test_k_runs_over_powers_of_two_and_evalplus_own():
    assert pass_ks(1) == [1]
    assert pass_ks(10) == [1, 2, 4, 8, 10]
    assert pass_ks(16) == [1, 2, 4, 8, 10, 16]
    assert pass_ks(100) == [1, 2, 4, 8, 10, 16, 32, 64, 100]


# --- EvalPlus's own files and its own evaluate ------------------------------------------------


def evalplus_evaluate(dataset: str, samples, releases, cache) -> subprocess.Popen:
    """``python -m evalplus.evaluate`` as a user runs it, on the test's release file (its override variable)."""
    override = evalplus.RELEASES[dataset][2]
    env = {**os.environ, override: str(releases[dataset]), "XDG_CACHE_HOME": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "evalplus.evaluate", "--dataset", dataset, "--samples",
                             str(samples)], env=env, cwd=samples.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def printed(out: str, dataset: str) -> dict[str, str]:
    """The pass@k lines evaluate prints for base (``dataset``) and base + extra (``dataset+``) tests."""
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # termcolor, should it colour
    base, plus = out.split(f"{dataset} (base tests)\n", 1)[1].split(f"{dataset}+ (base + extra tests)\n")
    return {f"{name}/{k}": v for name, text in ((dataset, base), (f"{dataset}+", plus))
            for k, v in re.findall(r"^(pass@\d+):\s+([0-9.]+)$", text, re.M)}


def test_evalplus_own_evaluate_reads_the_files_and_agrees(results, releases, tmp_path):
    """The written samples, scored again from scratch by ``evalplus.evaluate`` (no results file beside
    them), get the very verdicts written beside them, and it prints the same pass@1 and pass@10; given
    the results file too, it reads it and prints the same."""
    runs = {}
    for dataset, result in results.items():
        assert [len(s) for s in result.samples.values()] == [N] * len(result.samples)
        ours = write_samples(result, tmp_path / "ours", releases[dataset])
        assert ours == tmp_path / "ours" / f"{dataset}.jsonl"
        assert all(p.is_file() for p in sample_files(ours.parent, dataset))
        fresh = tmp_path / "fresh" / ours.name
        fresh.parent.mkdir(exist_ok=True)
        shutil.copy(ours, fresh)  # the samples alone: evaluate scores them itself
        runs[dataset] = (evalplus_evaluate(dataset, fresh, releases, tmp_path / "cache"),
                         evalplus_evaluate(dataset, ours, releases, tmp_path / "cache"))
    for dataset, result in results.items():
        fresh_run, ours_run = (p.communicate(timeout=600) for p in runs[dataset])
        assert all(p.returncode == 0 for p in runs[dataset]), fresh_run[1][-3000:] + ours_run[1][-3000:]
        assert "Load from previous results" in ours_run[0] and "Reading samples" in fresh_run[0]
        ours = {k: f"{v:.3f}" for k, v in result.metrics().items() if k.endswith(("/pass@1", "/pass@10"))}
        assert len(ours) == 4 and printed(fresh_run[0], dataset) == printed(ours_run[0], dataset) == ours
        own, written = (json.loads(p.read_text())["eval"] for p in (
            sample_files(tmp_path / "fresh", dataset)[2], sample_files(tmp_path / "ours", dataset)[2]))
        assert own == written  # solution, statuses and failing inputs, sample by sample
        passed = [r["base_status"] == "pass" for rows in own.values() for r in rows]
        assert any(passed) and not all(passed)
    assert 0 < results["humaneval"].metrics()["humaneval+/pass@10"] < 1  # HumanEval/2 never passes plus


def test_the_raw_file_holds_the_program_before_the_sanitizer(results, releases, tmp_path):
    """As evalplus's codegen writes its .raw.jsonl for a base model: the prompt and the completion."""
    write_samples(results["humaneval"], tmp_path, releases["humaneval"])
    samples, raw, _ = sample_files(tmp_path, "humaneval")
    rows = [json.loads(line) for line in raw.read_text().splitlines()]
    assert len(rows) == len(samples.read_text().splitlines()) == 3 * N
    prompt = evalplus.base_prompt(HUMANEVAL[0])
    assert rows[0]["task_id"] == "HumanEval/0"
    assert rows[0]["solution"] in [prompt + answer for answer in SAMPLED_ANSWERS["HumanEval/0"]]


# --- the seed ---------------------------------------------------------------------------------


def test_the_same_seed_draws_the_same_answers(results):
    """Task i draws from seed + i, whatever else is drawn (so any number of ranks draws the same): the
    third task alone, with seed 2, gets the fixture's answers for it (seed 0, third of three); with the
    fixture's seed, others."""
    drawn = {t: [s.raw for s in ss] for t, ss in results["humaneval"].samples.items()}
    assert all(len(set(d)) > 1 for d in drawn.values())  # a real draw: each task got several answers
    assert [s.raw for s in sampled("humaneval", HUMANEVAL_TASKS[2:], seed=2).samples["HumanEval/2"]] == \
        drawn["HumanEval/2"]
    assert [s.raw for s in sampled("humaneval", HUMANEVAL_TASKS[2:], seed=0).samples["HumanEval/2"]] != \
        drawn["HumanEval/2"]


# --- the flags and the loop -------------------------------------------------------------------


def test_eval_run_reports_pass_at_k_and_writes_evalplus_files(tmp_path, capsys, releases):
    from eval.run import main

    step = write_tiny_run(tmp_path / "run", TINY_TOKENIZER)
    data = f"{releases['humaneval']},{releases['mbpp']}"
    common = ["--checkpoint", str(step.parent.parent), "--evalplus", "humaneval,mbpp", "--evalplus-data", data,
              "--limit", "1", "--max-new-tokens", "3", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        main([*common, "--samples", "3"])
    assert e.value.code == 2
    assert "--samples: 3 answers a task at --temperature 0" in capsys.readouterr().err
    out = main([*common, "--samples", "3", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7",
                "--evalplus-out", str(tmp_path / "out")])
    assert set(out["metrics"]) == {f"{d}/pass@{k}" for d in ("humaneval", "humaneval+", "mbpp", "mbpp+")
                                   for k in (1, 2)}
    assert [len(v) for v in out["evalplus"]["raw"].values()] == [3, 3]
    printed_out = capsys.readouterr().out
    for dataset in ("humaneval", "mbpp"):
        samples, raw, verdicts = sample_files(tmp_path / "out", dataset)
        assert len(samples.read_text().splitlines()) == len(raw.read_text().splitlines()) == 3
        assert f"--dataset {dataset} --samples {samples}" in printed_out
        assert json.loads(verdicts.read_text())["hash"] == evalplus.release_hash(dataset, releases[dataset])
    assert f"HUMANEVAL_OVERRIDE_PATH={releases['humaneval']} python -m evalplus.evaluate" in printed_out


def test_the_loop_draws_as_its_eval_table_says(tmp_path, releases):
    """``[eval] evalplus_samples`` / ``evalplus_temperature``: pass@1 and pass@2 in metrics.jsonl and
    evals/step-N.json, without errors."""
    result = train("tiny.toml", *short(tmp_path, 2, "schedule.warmup_steps=1", "eval.every=0", "eval.val_sources=[]",
                                       "eval.evalplus=humaneval",
                                       f"eval.evalplus_data={releases['humaneval']}", "eval.evalplus_limit=1",
                                       "eval.evalplus_max_new_tokens=3", "eval.evalplus_samples=2",
                                       "eval.evalplus_temperature=1.0"))
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "run" / "evals" / "step-2.json").read_text())
    keys = {f"{d}/pass@{k}" for d in ("humaneval", "humaneval+") for k in (1, 2)}
    assert written["errors"] == [] and keys <= set(written["metrics"])
    assert {k: metrics(tmp_path / "run")[2][k] for k in keys} == {k: written["metrics"][k] for k in keys}
