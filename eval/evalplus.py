"""HumanEval+ and MBPP+ greedy pass@1, base and plus, scored by the ``evalplus`` package itself.

Every verdict comes from EvalPlus's own code (``evalplus==0.3.1``, pinned:
``make setup`` installs it without its model-provider dependencies):

- data: its loaders (``get_human_eval_plus``/``get_mbpp_plus``: MBPP+ inputs
  turned back into tuples, sets, complex numbers), pointed at the given
  release file through its own override (``HUMANEVAL_OVERRIDE_PATH`` /
  ``MBPP_OVERRIDE_PATH``, which it reads once at import: we set the module
  value it reads); with no file, its own cache, else its own download;
- sanitizing: ``evalplus.sanitize.sanitize`` (tree-sitter), on the prompt plus
  the completion for base models, on the answer for instruct ones, as its
  ``codegen`` does;
- expected outputs and checks: ``evalplus.evaluate.get_groundtruth`` and
  ``check_correctness`` (fast check: the first failing input ends a set;
  per input max(1 s, 4 x the canonical solution's time)), which run the code
  through ``untrusted_check``: a forked process with its reliability guard
  (``open`` disabled, no ``__main__`` blocks, 4 GiB), its comparison (type,
  length, atol rules, set-compared and ``is not None`` MBPP+ tasks) and its
  per-task oracles. That harness runs inside ``eval.sandbox`` (no network,
  nothing writable outside its directory, a wall-time limit), never in this
  process; "plus" passes when base and plus both pass, as in its report.

find_zero (HumanEval/32): 0.3.1's oracle ``continue``s before recording a
pass, so it fails every find_zero solution, the canonical one included;
upstream fixed it after the release (evalplus commit 6eb1e19, "fix(find_zero):
record results before continue", #241). ``find_zero="fixed"`` (the default)
applies that fix; ``"released"`` scores exactly as 0.3.1 does.

Prompts and stops are EvalPlus's too (``evalplus.provider.utility`` and the
instruction/response prefixes of its ``codegen``): base models continue
``prompt.strip() + "\\n"``; instruct models (``chat=True``) get the task in a
code block as the user turn and an answer started with "Below is a Python
script ...\\n```python\\n" (the chat template cut at EvalPlus's marker),
which stops at the code block's end; tabs become four spaces, as its HF and
vLLM providers do.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from .generate import code_benchmark
from .sandbox import run_program

EVALPLUS_VERSION = "0.3.1"
INSTALL = f"pip install --no-deps evalplus=={EVALPLUS_VERSION} (after pip install -e '.[eval]'), or make setup"
try:
    _installed = version("evalplus")
except PackageNotFoundError:
    _installed = None
if _installed != EVALPLUS_VERSION:
    raise ImportError(f"EvalPlus scoring runs evalplus=={EVALPLUS_VERSION}'s own code; "
                      f"{'found ' + _installed if _installed else 'it is not installed'}: {INSTALL}")

import evalplus.data.humaneval as _humaneval  # noqa: E402
import evalplus.data.mbpp as _mbpp  # noqa: E402
from evalplus.config import DEFAULT_GT_TIME_LIMIT_FACTOR, DEFAULT_MIN_TIME_LIMIT  # noqa: E402
from evalplus.data.utils import get_dataset_metadata, make_cache  # noqa: E402
from evalplus.provider.utility import _MAGIC_SPLITTER_, EOS, extra_eos_for_direct_completion  # noqa: E402
from evalplus.provider.utility import make_raw_chat_prompt  # noqa: E402
from evalplus.sanitize import sanitize  # noqa: E402

# dataset -> (release name, its data module, the override variable that module reads, release version)
RELEASES = {"humaneval": ("HumanEvalPlus", _humaneval, "HUMANEVAL_OVERRIDE_PATH", _humaneval.HUMANEVAL_PLUS_VERSION),
            "mbpp": ("MbppPlus", _mbpp, "MBPP_OVERRIDE_PATH", _mbpp.MBPP_PLUS_VERSION)}
REQUIRED = ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input", "atol")
MAX_NEW_TOKENS = 768  # EvalPlus's DecoderBase default
CHAT_STOP = "\n```\n"  # its HF and vLLM providers stop an instruct answer at the code block's end
# evalplus/codegen.py's run_codegen (plain strings there, not importable)
INSTRUCTION_PREFIX = ("Please provide a self-contained Python script that solves the following problem "
                      "in a markdown code block:")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem "
                   "and passes corresponding tests:")
FIND_ZERO = ("fixed", "released")


class EvalPlusDataError(FileNotFoundError):
    """The EvalPlus release file is missing or malformed."""


# ---------------------------------------------------------------- data

def release_file(dataset: str) -> Path:
    """EvalPlus's own file when none is given: its override variable, else its cache, else its download."""
    name, module, override, release = RELEASES[dataset]
    if getattr(module, override):
        return Path(getattr(module, override))
    url, cache = get_dataset_metadata(name, release, mini=False)
    try:
        make_cache(url, cache)
    except OSError as e:
        raise EvalPlusDataError(
            f"{dataset}: no --evalplus-data file given, none at {cache} (EvalPlus's cache), and {url} could not "
            f"be fetched ({e}). Download {name}.jsonl.gz ({release}) from {url} on a machine with network access "
            f"and pass it with --evalplus-data (or put it, decompressed, at {cache}).") from None
    return Path(cache)


def _check_file(path: Path) -> None:
    """Name the file, line and field of a problem before EvalPlus's loader meets it."""
    if not path.is_file():
        raise EvalPlusDataError(f"{path}: no such EvalPlus release file")
    n_tasks = 0
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalPlusDataError(f"{path}: line {n}: not JSON ({e})") from None
            missing = [k for k in REQUIRED if k not in task]
            if missing:
                raise EvalPlusDataError(f"{path}: line {n}: missing {missing}")
            n_tasks += 1
    if not n_tasks:
        raise EvalPlusDataError(f"{path}: no tasks")


def load_tasks(dataset: str, path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The tasks of a release file (the first ``limit``), as EvalPlus's loader returns them."""
    if dataset not in RELEASES:
        raise ValueError(f"unknown EvalPlus dataset {dataset!r}: expected one of {sorted(RELEASES)}")
    _, module, override, _ = RELEASES[dataset]
    path = Path(path) if path is not None else release_file(dataset)
    _check_file(path)
    # The loader reads the module value its import took from the environment: point it at this file.
    saved = getattr(module, override)
    setattr(module, override, str(path))
    try:
        tasks = (module.get_human_eval_plus if dataset == "humaneval" else module.get_mbpp_plus)(err_incomplete=False)
    finally:
        setattr(module, override, saved)
    return list(tasks.values())[:limit] if limit else list(tasks.values())


# ---------------------------------------------------------------- prompts

def base_prompt(task: dict) -> str:
    return task["prompt"].strip() + "\n"


def chat_messages(task: dict) -> list[dict]:
    """The conversation ``make_raw_chat_prompt`` renders (the answer holds EvalPlus's marker)."""
    user = f"{INSTRUCTION_PREFIX}\n```\n{task['prompt'].strip()}\n```\n"
    answer = f"{RESPONSE_PREFIX}\n```python\n{_MAGIC_SPLITTER_}\n```\n"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def chat_prompt_ids(task: dict, tokenizer, template: str | None = None) -> list[int]:
    """Ids of the instruct prompt: the chat template cut at the marker, as EvalPlus builds it."""
    if hasattr(tokenizer, "hf"):  # an exported folder: its own tokenizer and template, through EvalPlus's code
        if tokenizer.hf.chat_template is None:
            raise ValueError("--chat: the tokenizer has no chat_template")
        text = make_raw_chat_prompt(task["prompt"], INSTRUCTION_PREFIX, RESPONSE_PREFIX, tokenizer.hf)
        return tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    from data.chat import prefix_ids

    return prefix_ids(chat_messages(task), tokenizer, _MAGIC_SPLITTER_, template)


def stops(dataset: str, chat: bool) -> list[str]:
    return EOS + ([CHAT_STOP] if chat else extra_eos_for_direct_completion(dataset))


# ---------------------------------------------------------------- checking

# The harness run in the sandbox: EvalPlus's ground truth and checks, with EvalPlus's own
# process structure (its untrusted_check forks the guarded process that runs the solution).
# Its last stdout line is the JSON list of [base status, plus status] per job.
_HARNESS = r'''
import base64, json, pickle
import evalplus.eval
from evalplus.eval._special_oracle import MBPP_OUTPUT_NOT_NONE_TASKS
from evalplus.evaluate import check_correctness, get_groundtruth

dataset, jobs, limits, find_zero = pickle.loads(base64.b64decode(PAYLOAD))
if find_zero == "fixed":
    # evalplus 6eb1e19 (after 0.3.1), "fix(find_zero): record results before continue": 0.3.1's
    # find_zero oracle skips recording a passed input, so every solution fails. Under fast_check
    # any failing input ends the run as failed, so a successful run passed every input: record
    # them as the fix does. Only untrusted_check's forked process runs this.
    released = evalplus.eval.unsafe_execute

    def fixed(dataset, entry_point, code, inputs, expected, time_limits, atol, fast_check, stat, details, progress):
        released(dataset, entry_point, code, inputs, expected, time_limits, atol, fast_check, stat, details,
                 progress)
        if dataset == "humaneval" and entry_point == "find_zero" and stat.value == evalplus.eval._SUCCESS:
            for i in range(len(inputs)):
                details[i] = True
            progress.value = len(inputs)

    evalplus.eval.unsafe_execute = fixed
problems = {task["task_id"]: task for task, _ in jobs}
expected = get_groundtruth(problems, "sandbox", MBPP_OUTPUT_NOT_NONE_TASKS if dataset == "mbpp" else [])
statuses = []
for n, (task, solution) in enumerate(jobs):
    result = check_correctness(dataset, n, task, solution, expected[task["task_id"]], fast_check=True, **limits)
    statuses.append([result["base"][0], result["plus"][0]])
print("\n" + json.dumps(statuses))
'''


def default_workers() -> int:
    """EvalPlus's own default (half the cores), shared by the ranks on this node."""
    return max(1, (os.cpu_count() or 2) // (2 * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _check_chunk(dataset: str, jobs: list[tuple[dict, str]], limits: dict, find_zero: str) -> list[dict]:
    payload = base64.b64encode(pickle.dumps((dataset, jobs, limits, find_zero))).decode()
    # The time limit is a backstop only: every check ends within its own limits (EvalPlus's 60 s per set,
    # plus a few s). get_groundtruth writes its cache of expected outputs in the sandbox's directory:
    # room for outputs well beyond the inputs' size.
    result = run_program(f"PAYLOAD = {payload!r}\n{_HARNESS}", timeout_s=120 + 130 * len(jobs),
                         fsize_mb=64 + 16 * (len(payload) >> 20), guard=False)
    try:
        statuses = json.loads(result.stdout_tail.strip().splitlines()[-1])
        assert len(statuses) == len(jobs)
    except (IndexError, ValueError, AssertionError):
        raise RuntimeError(f"the EvalPlus check harness did not finish ({result.status}, exit {result.returncode}): "
                           f"{result.stderr_tail}") from None
    return [{"base": base == "pass", "plus": base == plus == "pass"} for base, plus in statuses]


def check_solutions(dataset: str, jobs: list[tuple[dict, str]], *, find_zero: str = "fixed",
                    workers: int | None = None, min_time_limit: float = DEFAULT_MIN_TIME_LIMIT,
                    gt_time_limit_factor: float = DEFAULT_GT_TIME_LIMIT_FACTOR) -> list[dict[str, bool]]:
    """{"base": passed the base tests, "plus": passed base and plus} for each (task, sanitized solution),
    by EvalPlus's check in the sandbox; ``workers`` sandboxes at once, each taking its share of ``jobs``."""
    if dataset not in RELEASES:
        raise ValueError(f"unknown EvalPlus dataset {dataset!r}: expected one of {sorted(RELEASES)}")
    if find_zero not in FIND_ZERO:
        raise ValueError(f"find_zero: {find_zero!r} is not one of {FIND_ZERO}")
    if not jobs:
        return []
    limits = {"min_time_limit": min_time_limit, "gt_time_limit_factor": gt_time_limit_factor}
    n = min(workers or default_workers(), len(jobs))
    shares = [list(range(w, len(jobs), n)) for w in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        parts = list(pool.map(lambda share: _check_chunk(dataset, [jobs[i] for i in share], limits, find_zero),
                              shares))
    out: list[dict] = [{}] * len(jobs)
    for share, part in zip(shares, parts):
        for i, verdict in zip(share, part):
            out[i] = verdict
    return out


@dataclasses.dataclass
class EvalPlusResult:
    dataset: str
    chat: bool
    passed: dict[str, dict[str, bool]]  # task_id -> {"base": ..., "plus": ...}
    solutions: dict[str, str]  # task_id -> the sanitized program that was run
    raw: dict[str, str] = dataclasses.field(default_factory=dict)  # task_id -> the generated text, as it came

    def metrics(self) -> dict[str, float]:
        n = len(self.passed)
        return {f"{self.dataset}/pass@1": sum(p["base"] for p in self.passed.values()) / n,
                f"{self.dataset}+/pass@1": sum(p["plus"] for p in self.passed.values()) / n}


def evaluate_evalplus(model_fn, tokenizer, dataset: str, *, max_seq_len: int, device: torch.device | str = "cpu",
                      tasks: list[dict] | None = None, data_path: str | Path | None = None,
                      limit: int | None = None, chat: bool = False, chat_template: str | None = None,
                      max_new_tokens: int = MAX_NEW_TOKENS, **check) -> EvalPlusResult:
    """Greedy pass@1 of ``model_fn`` on base and plus tests. Every rank must call this."""
    tasks = tasks if tasks is not None else load_tasks(dataset, data_path, limit)

    def prompt(task: dict) -> list[int]:
        if chat:
            return chat_prompt_ids(task, tokenizer, chat_template)
        return tokenizer.encode(base_prompt(task), bos=True)

    def solution(task: dict, answer: str) -> str:  # as its codegen: the answer, or the prompt and its completion
        answer = answer.replace("\t", "    ")  # as its providers do
        return sanitize(answer if chat else base_prompt(task) + answer, entrypoint=task["entry_point"])

    def verdicts(answers: dict[int, list[str]]) -> dict[int, tuple[str, dict]]:
        clean = {i: solution(tasks[i], texts[0]) for i, texts in answers.items()}
        passed = check_solutions(dataset, [(tasks[i], clean[i]) for i in clean], **check)
        return {i: (clean[i], p) for i, p in zip(clean, passed)}

    results = code_benchmark(model_fn, tokenizer, tasks, prompt=prompt, score=verdicts, device=device,
                             max_new_tokens=max_new_tokens, stop=stops(dataset, chat), max_seq_len=max_seq_len)
    return EvalPlusResult(dataset, chat, {t["task_id"]: p for t, (_, (_, p)) in zip(tasks, results)},
                          {t["task_id"]: clean for t, (_, (clean, _)) in zip(tasks, results)},
                          {t["task_id"]: texts[0] for t, (texts, _) in zip(tasks, results)})
