"""The evaluations on two gloo ranks equal one rank: CORE (real bundle), lm-eval (toy tasks) and
EvalPlus (known right, base-only and wrong answers; sampled answers). Each rank evaluates its share and every
rank runs the same number of forwards (eval.dist.Lockstep), so a rank with less work pads.

One torchrun launch runs this file's ``__main__`` for all three (a launch costs ~15 s here);
the one-rank references run in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rundir import REPO
from tests.conftest import tiny_random_model
from tests.eval.conftest import (
    BUNDLE, PROBS, WORDS, Bigram, WordTokenizer, needs_bundle, sampled_evalplus, scripted_evalplus, write_tasks,
)

pytestmark = pytest.mark.slow

CORE_TASKS = ["copa", "winograd", "bigbench_operators", "arc_easy"]  # MC, schema, LM (10-shot), MC


def core(model_fn):
    from data.tokenizer import Tokenizer
    from eval.core import evaluate_core

    return evaluate_core(model_fn, Tokenizer(), BUNDLE, max_seq_len=256, max_per_task=5, labels=CORE_TASKS)


def worker(out_dir: Path) -> None:
    """Every rank: CORE (when the bundle is here), lm-eval, EvalPlus; each writes what it got."""
    import torch.distributed as tdist

    from eval.lm_harness import LaneformerLM, load_task_file, run_lm_eval

    tdist.init_process_group("gloo")
    out: dict = {}
    if (BUNDLE / "tasks.csv").is_file():
        model, calls = tiny_random_model(), {"n": 0}

        def model_fn(ids):
            calls["n"] += 1
            return model(ids)

        out["core"] = {"metrics": core(model_fn).metrics(), "forwards": calls["n"]}
    tok = WordTokenizer(WORDS + ["<x>"])
    bigram = Bigram(tok, PROBS)
    results = run_lm_eval(LaneformerLM(bigram, tok, max_seq_len=16, batch_size=2), load_task_file(out_dir / "tasks.json"))
    out["lm_eval"] = {"results": results, "forwards": bigram.calls}
    evalplus = scripted_evalplus()
    out["evalplus"] = {"passed": evalplus.passed, "metrics": evalplus.metrics()}
    out["evalplus_sampled"] = {t: [s.raw for s in ss] for t, ss in sampled_evalplus().samples.items()}
    (out_dir / f"rank{tdist.get_rank()}.json").write_text(json.dumps(out))
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("eval_two_ranks")
    write_tasks(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), str(out)]
    env = {**os.environ, "HF_DATASETS_CACHE": str(out / "hf_datasets"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + "\n".join(
        line for line in proc.stderr.splitlines() if "Task:" not in line and "it/s]" not in line)[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@needs_bundle
def test_core_on_two_ranks_equals_one_rank(ranks):
    single = core(tiny_random_model()).metrics()
    assert ranks[0]["core"]["metrics"] == ranks[1]["core"]["metrics"] == single
    # 5 items on 2 ranks: 3 forwards each per task, rank 1 padding with one dummy forward
    assert ranks[0]["core"]["forwards"] == ranks[1]["core"]["forwards"] == 3 * len(CORE_TASKS)


def test_lm_eval_on_two_ranks_reports_once_with_the_one_rank_scores(ranks):
    from eval.lm_harness import flat_metrics

    assert ranks[1]["lm_eval"]["results"] is None  # lm-eval reports on rank 0
    assert ranks[0]["lm_eval"]["forwards"] == ranks[1]["lm_eval"]["forwards"]
    metrics = flat_metrics(ranks[0]["lm_eval"]["results"])
    assert metrics["lm_eval/toy_mc/acc"] == pytest.approx(4 / 5)  # as tests/eval/test_eval_harness.py on one
    assert metrics["lm_eval/toy_gen/exact_match"] == pytest.approx(3 / 5)


def test_evalplus_on_two_ranks_gathers_the_one_rank_verdicts_in_task_order(ranks):
    single = scripted_evalplus()
    assert ranks[0]["evalplus"] == ranks[1]["evalplus"] == {"passed": single.passed, "metrics": single.metrics()}
    assert list(ranks[0]["evalplus"]["passed"]) == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]



def test_evalplus_sampling_on_two_ranks_draws_the_one_rank_answers(ranks):
    """Task i draws from the seed + i wherever it runs: the same answers on two ranks as on one."""
    single = {t: [s.raw for s in ss] for t, ss in sampled_evalplus().samples.items()}
    assert ranks[0]["evalplus_sampled"] == ranks[1]["evalplus_sampled"] == single


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
