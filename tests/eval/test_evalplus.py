"""EvalPlus scoring is EvalPlus's own: the project's verdicts equal the ``evalplus`` package's own
evaluation (its loader, sanitizer, ground truth, checks and oracles, run unsandboxed in a subprocess
as its ``evalplus.evaluate`` runs them) on completions that exercise each of its rules; then the
prompt -> generation -> score path for base and instruct prompts (on two ranks:
tests/e2e/test_eval_two_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error

import pytest
import torch

from eval import evalplus
from eval.evalplus import EvalPlusDataError, check_solutions, load_tasks
from tests.eval.conftest import ADD, scripted_evalplus
from tests.eval.evalplus_cases import COMPLETIONS, FIXED, HUMANEVAL, MBPP, write_release

# EvalPlus's own pipeline on the same files: evalplus.sanitize, then evalplus.evaluate.evaluate (its
# loader through its override variables, read at import: set in this subprocess's environment).
REFERENCE = r"""
import json, os, sys
from evalplus.data import get_human_eval_plus, get_mbpp_plus
from evalplus.evaluate import evaluate
from evalplus.sanitize import sanitize

out = sys.argv[1]
for dataset, get in (("humaneval", get_human_eval_plus), ("mbpp", get_mbpp_plus)):
    problems = get()
    raw = [json.loads(line) for line in open(f"{out}/{dataset}_raw.jsonl")]
    with open(f"{out}/{dataset}.jsonl", "w") as f:
        for r in raw:
            f.write(json.dumps({"task_id": r["task_id"],
                                "solution": sanitize(r["solution"], problems[r["task_id"]]["entry_point"])}) + "\n")
    evaluate(dataset, samples=f"{out}/{dataset}.jsonl", parallel=2)
os._exit(0)  # evaluate leaves a non-daemon watchdog thread sleeping for 20 s
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The test dataset's two release files."""
    out = tmp_path_factory.mktemp("evalplus_data")
    return {"humaneval": write_release(out / "HumanEvalPlus.jsonl", HUMANEVAL),
            "mbpp": write_release(out / "MbppPlus.jsonl", MBPP)}


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> dict[str, tuple[bool, bool]]:
    """EvalPlus's own (base, plus) verdict on every completion."""
    out = tmp_path_factory.mktemp("evalplus")
    for dataset in files:
        prefix = "HumanEval/" if dataset == "humaneval" else "Mbpp/"
        (out / f"{dataset}_raw.jsonl").write_text("".join(
            json.dumps({"task_id": t, "solution": raw}) + "\n" for t, _, raw, _ in COMPLETIONS if t.startswith(prefix)))
    env = {**os.environ, "HUMANEVAL_OVERRIDE_PATH": str(files["humaneval"]), "MBPP_OVERRIDE_PATH": str(files["mbpp"]),
           "XDG_CACHE_HOME": str(out / "cache")}
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(out)], env=env, cwd=out, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = {}
    for dataset in files:
        results = json.loads((out / f"{dataset}_eval_results.json").read_text())["eval"]
        seen: dict[str, int] = {}
        for t, name, _, _ in COMPLETIONS:
            if t in results:
                r = results[t][seen.setdefault(t, 0)]
                seen[t] += 1
                verdicts[name] = (r["base_status"] == "pass", r["base_status"] == r["plus_status"] == "pass")
    assert len(verdicts) == len(COMPLETIONS)
    return verdicts


def project_verdicts(files, find_zero: str) -> dict[str, tuple[bool, bool]]:
    """The project's path: its loader and sanitizer (EvalPlus's), its checks in the sandbox."""
    verdicts = {}
    for dataset, path in files.items():
        tasks = {t["task_id"]: t for t in load_tasks(dataset, path)}
        cases = [c for c in COMPLETIONS if c[0] in tasks]
        jobs = [(tasks[t], evalplus.sanitize(raw, entrypoint=tasks[t]["entry_point"])) for t, _, raw, _ in cases]
        for (_, name, _, _), v in zip(cases, check_solutions(dataset, jobs, find_zero=find_zero)):
            verdicts[name] = (v.base, v.plus)
    return verdicts


def test_every_verdict_equals_evalplus_own_evaluation(files, reference):
    """As released (0.3.1), completion by completion: right, base-only, wrong types, set-compared, regex,
    stubbed, decorated, open(), __main__, numpy, timeout, crashes, special oracles, find_zero."""
    expected = {name: want for _, name, _, want in COMPLETIONS}
    assert reference == expected  # what EvalPlus decides, as the cases say (so no rule goes unexercised)
    assert project_verdicts(files, "released") == reference


def test_find_zero_takes_upstreams_fix_by_default(files, reference):
    """0.3.1 fails every find_zero solution, its canonical one too; with upstream's fix (the default)
    a right one passes and a wrong one still fails (other tasks: the default everywhere else here)."""
    task = load_tasks("humaneval", files["humaneval"])[3]
    cases = [(name, raw) for t, name, raw, _ in COMPLETIONS if t == "HumanEval/32"]
    jobs = [(task, evalplus.sanitize(raw, entrypoint="find_zero")) for _, raw in cases]
    jobs.append((task, task["prompt"] + task["canonical_solution"]))
    fixed = [(v.base, v.plus) for v in check_solutions("humaneval", jobs)]
    names = [name for name, _ in cases]
    assert dict(zip(names, fixed)) == {name: FIXED.get(name, reference[name]) for name in names}
    assert fixed[-1] == (True, True)
    assert [(v.base, v.plus) for v in check_solutions("humaneval", jobs[-1:], find_zero="released")] == [(False, False)]
    with pytest.raises(ValueError, match="find_zero: 'upstream' is not one of"):
        check_solutions("humaneval", jobs, find_zero="upstream")


def test_release_files_load_as_evalplus_loads_them(files, monkeypatch):
    from evalplus.data import mbpp as ep_mbpp

    two = load_tasks("humaneval", files["humaneval"], limit=2)
    assert [t["task_id"] for t in two] == ["HumanEval/0", "HumanEval/1"]
    mbpp = load_tasks("mbpp", files["mbpp"])
    assert mbpp[0]["base_input"][0] == [(3, 4, 5, 6), (5, 7, 4, 10)]  # MBPP+ task 2 takes tuples
    assert ep_mbpp.MBPP_OVERRIDE_PATH == os.environ.get("MBPP_OVERRIDE_PATH")  # pointed at the file for the call only
    # With no file given, EvalPlus's own override (MBPP_OVERRIDE_PATH, read when it is imported) wins.
    monkeypatch.setattr(ep_mbpp, "MBPP_OVERRIDE_PATH", str(files["mbpp"]))
    assert load_tasks("mbpp") == mbpp


def test_missing_or_bad_data_says_where_to_get_it(tmp_path, monkeypatch):
    import wget
    from evalplus.data import humaneval as ep_humaneval
    from evalplus.data import utils as ep_utils

    def offline(url, out):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(ep_utils, "CACHE_DIR", str(tmp_path))  # no cached copy, and this machine is offline
    monkeypatch.setattr(wget, "download", offline)
    monkeypatch.setattr(ep_humaneval, "HUMANEVAL_OVERRIDE_PATH", None)
    with pytest.raises(EvalPlusDataError, match=r"download/v0\.1\.10/HumanEvalPlus\.jsonl\.gz.*--evalplus-data"):
        load_tasks("humaneval")
    with pytest.raises(EvalPlusDataError, match="nope.jsonl: no such EvalPlus release file"):
        load_tasks("mbpp", tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "HumanEval/0"}) + "\n")
    with pytest.raises(EvalPlusDataError, match="bad.jsonl: line 1: missing"):
        load_tasks("humaneval", bad)
    bad.write_text("{not json\n")
    with pytest.raises(EvalPlusDataError, match="bad.jsonl: line 1: not JSON"):
        load_tasks("humaneval", bad)


class Scripted:
    """A model that always predicts the next token of ``target`` (then EOS): a known generator."""

    def __init__(self, target: list[int], vocab: int, eos: int):
        self.target, self.vocab, self.eos = target, vocab, eos

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.vocab)
        for t in range(ids.shape[1]):
            nxt = self.target[t + 1] if t + 1 < len(self.target) else self.eos
            logits[:, t, nxt] = 1.0
        return logits


@pytest.mark.parametrize("chat", [False, True])
def test_generation_prompts_stops_and_scoring(chat):
    from data.tokenizer import Tokenizer

    tok = Tokenizer()
    if chat:  # the instruct answer: code in a fence, then prose; generation stops at </s>
        prompt = evalplus.chat_prompt_ids(ADD, tok)
        text = "def add(a, b):\n    return a + b\n```\nIt adds."
        assert tok.decode(prompt).endswith("tests:\n```python\n")
        target = tok.encode(tok.decode(prompt) + text, bos=True, eos=True)
    else:  # the base completion runs on into a new function: cut at "\ndef "
        prompt = tok.encode(evalplus.base_prompt(ADD), bos=True)
        target = tok.encode(evalplus.base_prompt(ADD) + "    return a + b\n\ndef junk():\n    pass", bos=True)
    assert target[: len(prompt)] == prompt
    result = evalplus.evaluate_evalplus(Scripted(target, tok.vocab_size, tok.eos_id), tok, "humaneval",
                                        max_seq_len=512, tasks=[ADD], chat=chat, max_new_tokens=64)
    assert result.passed == {"HumanEval/0": [{"base": True, "plus": True}]}
    (sample,) = result.samples["HumanEval/0"]
    assert "junk" not in sample.solution and "It adds" not in sample.solution


def test_eval_run_refuses_a_missing_release_file_before_loading_a_model(tmp_path, capsys):
    from eval import run as eval_run

    with pytest.raises(SystemExit) as e:
        eval_run.main(["--checkpoint", str(tmp_path / "no-model"), "--evalplus", "mbpp",
                       "--evalplus-data", str(tmp_path / "MbppPlus.jsonl")])
    assert e.value.code == 2 and "MbppPlus.jsonl: no such EvalPlus release file" in capsys.readouterr().err


def test_generation_and_scoring_of_three_known_answers():
    """Right, base-only and wrong answers through generation: the one-rank reference that
    tests/e2e/test_eval_two_ranks.py holds two ranks to."""
    result = scripted_evalplus()
    assert result.passed == {"HumanEval/0": [{"base": True, "plus": True}],
                             "HumanEval/1": [{"base": True, "plus": False}],
                             "HumanEval/2": [{"base": False, "plus": False}]}
    assert result.metrics() == {"humaneval/pass@1": pytest.approx(2 / 3), "humaneval+/pass@1": pytest.approx(1 / 3)}
