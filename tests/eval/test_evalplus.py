"""EvalPlus protocol: release files in its format, sanitizing, base vs plus tests, time limits,
and the prompt -> generation -> score path for base and instruct prompts (on two ranks:
tests/e2e/test_eval_two_ranks.py)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from eval import evalplus
from eval.evalplus import EvalPlusDataError, check_solution, load_tasks, sanitize, score
from tests.helpers import ADD, MEAN, scripted_evalplus

# MBPP+ task 2 gets tuples back from JSON lists (EvalPlus's loader does the same).
SIMILAR = {
    "task_id": "Mbpp/2",
    "prompt": '"""\nWrite a function to find the shared elements from the given two lists.\n'
              'assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"""\n',
    "entry_point": "similar_elements",
    "canonical_solution": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
    "base_input": [[[3, 4, 5, 6], [5, 7, 4, 10]]],
    "plus_input": [[[1, 2], [2, 3]]],
    "atol": 0,
}


def write_release(path, tasks):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt") as f:
        for t in tasks:
            f.write(json.dumps(t) + "\n")
    return path


def test_load_release_files_and_mbpp_tuples(tmp_path):
    tasks = load_tasks("humaneval", write_release(tmp_path / "HumanEvalPlus.jsonl.gz", [ADD, MEAN]))
    assert [t["task_id"] for t in tasks] == ["HumanEval/0", "HumanEval/1"]
    assert load_tasks("humaneval", write_release(tmp_path / "h.jsonl", [ADD, MEAN]), limit=1)[0] == ADD
    mbpp = load_tasks("mbpp", write_release(tmp_path / "MbppPlus.jsonl", [SIMILAR]))
    assert mbpp[0]["base_input"] == [[(3, 4, 5, 6), (5, 7, 4, 10)]]


def test_missing_data_says_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached copy; this machine is offline
    monkeypatch.delenv("HUMANEVAL_OVERRIDE_PATH", raising=False)
    with pytest.raises(EvalPlusDataError, match=r"download/v0\.1\.10/HumanEvalPlus\.jsonl\.gz.*--evalplus-data"):
        load_tasks("humaneval")
    with pytest.raises(EvalPlusDataError, match="nope.jsonl"):
        load_tasks("mbpp", tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "HumanEval/0"}) + "\n")
    with pytest.raises(EvalPlusDataError, match="bad.jsonl: line 1: missing"):
        load_tasks("humaneval", bad)


def test_sanitize_keeps_what_the_entry_point_needs():
    raw = ("Here is the code:\n```python\nimport math\n\n@staticmethod\ndef helper(x):\n    return math.floor(x)\n\n"
           "def unused():\n    return 0\n\ndef f(x):\n    return helper(x) + K\n\nK = 1\nprint(f(2.5))\n\n"
           "if __name__ == '__main__':\n    f(1)\n```\nThat's all.")
    out = sanitize(raw, "f")
    assert out == ("import math\n@staticmethod\ndef helper(x):\n    return math.floor(x)\n"
                   "def f(x):\n    return helper(x) + K\nK = 1\n")


def test_scorer_tells_correct_wrong_and_base_only_apart():
    tasks = [ADD, MEAN]
    cases = {  # solution for ADD, solution for MEAN -> expected (base, plus) for each
        "correct": (ADD["prompt"] + "    return b + a\n", "import math\ndef mean(xs):\n    return math.fsum(xs) / len(xs)\n",
                    (True, True), (True, True)),
        "wrong": (ADD["prompt"] + "    return a - b\n", "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n",
                  (False, False), (False, False)),
        # passes the base tests (positive ints; short lists), fails plus (negatives; a 1-element list)
        "base_only": (ADD["prompt"] + "    return abs(a) + abs(b)\n",
                      "def mean(xs):\n    return sum(xs) / len(xs) if len(xs) > 1 else 0.0\n",
                      (True, False), (True, False)),
    }
    for name, (add, mean, want_add, want_mean) in cases.items():
        result = score(tasks, {"HumanEval/0": add, "HumanEval/1": mean})
        got = [(result.passed[t]["base"], result.passed[t]["plus"]) for t in ("HumanEval/0", "HumanEval/1")]
        assert got == [want_add, want_mean], name
    m = score(tasks, {"HumanEval/0": cases["base_only"][0], "HumanEval/1": cases["correct"][1]}).metrics()
    assert m == {"humaneval/pass@1": 1.0, "humaneval+/pass@1": 0.5}


def test_per_input_time_limit_and_mbpp_inputs(tmp_path):
    slow = ADD["prompt"] + "    import time\n    if a < 0:\n        time.sleep(3)\n    return a + b\n"
    assert check_solution(ADD, slow, min_time_limit=0.5) == {"base": True, "plus": False}
    task = load_tasks("mbpp", write_release(tmp_path / "MbppPlus.jsonl", [SIMILAR]))[0]
    needs_tuples = "def similar_elements(a, b):\n    assert type(a) is tuple\n    return tuple(set(a) & set(b))\n"
    assert check_solution(task, needs_tuples) == {"base": True, "plus": True}
    assert check_solution(task, "def similar_elements(a, b):\n    return a\n") == {"base": False, "plus": False}


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
    assert result.passed == {"HumanEval/0": {"base": True, "plus": True}}
    assert "junk" not in result.solutions["HumanEval/0"] and "It adds" not in result.solutions["HumanEval/0"]


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
    assert result.passed == {"HumanEval/0": {"base": True, "plus": True}, "HumanEval/1": {"base": True, "plus": False},
                             "HumanEval/2": {"base": False, "plus": False}}
    assert result.metrics() == {"humaneval/pass@1": pytest.approx(2 / 3), "humaneval+/pass@1": pytest.approx(1 / 3)}
