"""HumanEval+ and MBPP+ pass@k, base and plus, scored by the ``evalplus`` package itself.

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

pass@N: greedy decoding gives one answer a task and pass@1. Sampling
(``temperature`` > 0, nucleus ``top_p``: by default 0.95, as its HF and vLLM
providers sample) gives ``samples`` answers a task, seeded per task (``seed``: the same
seed draws the same answers on any number of ranks), and pass@k by its own
unbiased estimator (``evalplus.eval.estimate_pass_at_k``) for k = 1, 2, 4, ...
(Kog's curve) and its own 1, 10, 100, up to ``samples`` (``pass_ks``).
``write_samples`` writes them as its ``codegen`` and ``evaluate`` do (the
samples, their raw text, the verdicts), so that ``python -m evalplus.evaluate
--dataset D --samples FILE`` reads them and prints the same pass@1 and pass@10.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gzip
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from .generate import code_benchmark
from .sandbox import run_program
from .spec import default

EVALPLUS_VERSION = "0.3.1"
INSTALL = f"pip install --no-deps evalplus=={EVALPLUS_VERSION} (after pip install -e '.[eval]'), or make setup"
try:
    _installed = version("evalplus")
except PackageNotFoundError:
    _installed = None
if _installed != EVALPLUS_VERSION:
    raise ImportError(f"EvalPlus scoring runs evalplus=={EVALPLUS_VERSION}'s own code; "
                      f"{'found ' + _installed if _installed else 'it is not installed'}: {INSTALL}")

import evalplus.data.humaneval as _humaneval
import evalplus.data.mbpp as _mbpp
from evalplus.config import DEFAULT_GT_TIME_LIMIT_FACTOR, DEFAULT_MIN_TIME_LIMIT
from evalplus.data.utils import get_dataset_metadata, make_cache
from evalplus.eval import PASS, estimate_pass_at_k
from evalplus.provider.utility import _MAGIC_SPLITTER_, EOS, extra_eos_for_direct_completion
from evalplus.provider.utility import make_raw_chat_prompt
from evalplus.sanitize import sanitize

from data.decontaminate import EVALPLUS_RELEASES

# dataset -> (release name, its data module, the override variable that module reads, release version)
# (the release names are the data layer's too: data.decontaminate reads the same files)
RELEASES = {"humaneval": (EVALPLUS_RELEASES["humaneval"], _humaneval, "HUMANEVAL_OVERRIDE_PATH",
                          _humaneval.HUMANEVAL_PLUS_VERSION),
            "mbpp": (EVALPLUS_RELEASES["mbpp"], _mbpp, "MBPP_OVERRIDE_PATH", _mbpp.MBPP_PLUS_VERSION)}
REQUIRED = ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input", "atol")
MAX_NEW_TOKENS = 768  # EvalPlus's DecoderBase default
EVALPLUS_KS = (1, 10, 100)  # evalplus/evaluate.py prints pass@k for these k, where every task has k samples
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


@contextlib.contextmanager
def _release_at(dataset: str, path: str | Path | None):
    """EvalPlus's data module of ``dataset``, pointed at ``path`` (None: its own file) while inside."""
    if dataset not in RELEASES:
        raise ValueError(f"unknown EvalPlus dataset {dataset!r}: expected one of {sorted(RELEASES)}")
    _, module, override, _ = RELEASES[dataset]
    path = Path(path) if path is not None else release_file(dataset)
    _check_file(path)
    # The loader reads the module value its import took from the environment: point it at this file.
    saved = getattr(module, override)
    setattr(module, override, str(path))
    try:
        yield module
    finally:
        setattr(module, override, saved)


def load_tasks(dataset: str, path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The tasks of a release file (the first ``limit``), as EvalPlus's loader returns them."""
    with _release_at(dataset, path) as module:
        tasks = (module.get_human_eval_plus if dataset == "humaneval" else module.get_mbpp_plus)(err_incomplete=False)
    return list(tasks.values())[:limit] if limit else list(tasks.values())


def release_hash(dataset: str, path: str | Path | None = None) -> str:
    """The release file's hash as EvalPlus's evaluate records it in its results (its own function)."""
    with _release_at(dataset, path) as module:
        return module.get_human_eval_plus_hash() if dataset == "humaneval" else module.get_mbpp_plus_hash()


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
# Its last stdout line is the JSON list of [base status, inputs run, plus status, inputs run] per job
# (the inputs run: how many its check ran before it ended; the last one is the failing one).
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
    statuses.append([result["base"][0], len(result["base"][1]), result["plus"][0], len(result["plus"][1])])
print("\n" + json.dumps(statuses))
'''


def default_workers() -> int:
    """EvalPlus's own default (half the cores), shared by the ranks on this node."""
    return max(1, (os.cpu_count() or 2) // (2 * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _check_chunk(dataset: str, jobs: list[tuple[dict, str]], limits: dict, find_zero: str) -> list[list]:
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
    return statuses


@dataclasses.dataclass(frozen=True)
class Verdict:
    """EvalPlus's verdict on one solution, the fields its evaluate records in ``_eval_results.json``:
    each test set's status ("pass", "fail", "timeout") and the input that failed it (none if it passed)."""

    base_status: str
    plus_status: str
    base_fail_tests: list
    plus_fail_tests: list

    @property
    def base(self) -> bool:
        return self.base_status == PASS

    @property
    def plus(self) -> bool:
        """Base and plus tests passed, as its report counts HumanEval+/MBPP+."""
        return self.base_status == self.plus_status == PASS


def _verdict(dataset: str, task: dict, base_status: str, base_ran: int, plus_status: str, plus_ran: int) -> Verdict:
    """As evalplus/evaluate.py's ``get_failed_tests`` (nested in its evaluate, so not importable) records
    a fast check's failure: its last input run, MBPP's re-serialized as its loader read them."""
    def failed(status: str, ran: int, inputs: list) -> list:
        tests = [] if status == PASS or not ran else [inputs[ran - 1]]
        return _mbpp.mbpp_serialize_inputs(task["task_id"], tests) if dataset == "mbpp" else tests

    return Verdict(base_status, plus_status, failed(base_status, base_ran, task["base_input"]),
                   failed(plus_status, plus_ran, task["plus_input"]))


def check_solutions(dataset: str, jobs: list[tuple[dict, str]], *, find_zero: str = "fixed",
                    workers: int | None = None, min_time_limit: float = DEFAULT_MIN_TIME_LIMIT,
                    gt_time_limit_factor: float = DEFAULT_GT_TIME_LIMIT_FACTOR) -> list[Verdict]:
    """EvalPlus's verdict on each (task, sanitized solution), by its check in the sandbox; ``workers``
    sandboxes at once, each taking its share of ``jobs``."""
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
    out: list[Verdict] = [None] * len(jobs)
    for share, part in zip(shares, parts):
        for i, statuses in zip(share, part):
            out[i] = _verdict(dataset, jobs[i][0], *statuses)
    return out


def pass_ks(samples: int) -> list[int]:
    """The k of pass@k for ``samples`` answers a task: 1, 2, 4, ... (the N of Kog's pass@N curve) and
    EvalPlus's own 1, 10, 100, each up to ``samples``."""
    return sorted({2**i for i in range(samples.bit_length())} | {k for k in EVALPLUS_KS if k <= samples})


@dataclasses.dataclass
class Sample:
    raw: str  # the program before the sanitizer (the answer, or the prompt and its completion): codegen's .raw.jsonl
    solution: str  # the sanitized program that was run
    verdict: Verdict


@dataclasses.dataclass
class EvalPlusResult:
    dataset: str
    chat: bool
    samples: dict[str, list[Sample]]  # task_id -> its answers, in the order drawn

    @property
    def passed(self) -> dict[str, list[dict[str, bool]]]:
        return {t: [{"base": s.verdict.base, "plus": s.verdict.plus} for s in ss] for t, ss in self.samples.items()}

    def metrics(self) -> dict[str, float]:
        """pass@k on base tests, then on base and plus, for every k of ``pass_ks``: EvalPlus's estimator."""
        total = np.array([len(ss) for ss in self.samples.values()])
        out = {}
        for name, passes in ((self.dataset, lambda v: v.base), (f"{self.dataset}+", lambda v: v.plus)):
            correct = np.array([sum(passes(s.verdict) for s in ss) for ss in self.samples.values()])
            out.update({f"{name}/pass@{k}": float(estimate_pass_at_k(total, correct, k).mean())
                        for k in pass_ks(int(total.min()))})
        return out


def sample_files(folder: str | Path, dataset: str) -> tuple[Path, Path, Path]:
    """(samples, raw, results) of ``dataset`` in ``folder``: the samples file ``evalplus.evaluate --samples``
    reads, its raw twin (named as evalplus/codegen.py names it) and the results file evaluate reads
    beside it (named as evaluate names it: it scores the samples again only when that file is absent)."""
    samples = str(Path(folder) / f"{dataset}.jsonl")
    return Path(samples), Path(samples.replace(".jsonl", ".raw.jsonl")), \
        Path(samples.replace(".jsonl", "_eval_results.json"))


def write_samples(result: EvalPlusResult, folder: str | Path, release: str | Path | None = None) -> Path:
    """``result`` in EvalPlus's files (``sample_files``); ``release``: the file its tasks came from (None:
    EvalPlus's own), whose hash the results record. Returns the samples file."""
    samples, raw, results = sample_files(folder, result.dataset)
    samples.parent.mkdir(parents=True, exist_ok=True)
    rows = [(task_id, s) for task_id, ss in result.samples.items() for s in ss]
    samples.write_text("".join(json.dumps({"task_id": t, "solution": s.solution}) + "\n" for t, s in rows))
    raw.write_text("".join(json.dumps({"task_id": t, "solution": s.raw}) + "\n" for t, s in rows))
    verdicts = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "hash": release_hash(result.dataset, release),
                "eval": {t: [{"task_id": t, "solution": s.solution, **dataclasses.asdict(s.verdict)} for s in ss]
                         for t, ss in result.samples.items()}}
    results.write_text(json.dumps(verdicts))
    return samples


def evaluate_evalplus(model_fn, tokenizer, dataset: str, *, max_seq_len: int, device: torch.device | str = "cpu",
                      tasks: list[dict] | None = None, data_path: str | Path | None = None,
                      limit: int | None = None, chat: bool = False, chat_template: str | None = None,
                      max_new_tokens: int = MAX_NEW_TOKENS, samples: int = 1, temperature: float = 0.0,
                      top_p: float = default("evalplus_top_p"), seed: int = 0, **check) -> EvalPlusResult:
    """pass@k of ``model_fn`` on base and plus tests: greedy (one answer a task), or ``samples`` answers
    a task drawn at ``temperature`` > 0 with nucleus ``top_p``, seeded by ``seed`` (eval.spec.EvalSpec refuses
    more than one greedy answer). Every rank must call this."""
    tasks = tasks if tasks is not None else load_tasks(dataset, data_path, limit)

    def prompt(task: dict) -> list[int]:
        if chat:
            return chat_prompt_ids(task, tokenizer, chat_template)
        return tokenizer.encode(base_prompt(task), bos=True)

    def program(task: dict, answer: str) -> str:  # as its codegen: the answer, or the prompt and its completion
        answer = answer.replace("\t", "    ")  # as its providers do
        return answer if chat else base_prompt(task) + answer

    def verdicts(answers: dict[int, list[str]]) -> dict[int, list[Sample]]:
        jobs = [(i, program(tasks[i], text)) for i, texts in answers.items() for text in texts]
        clean = [sanitize(raw, entrypoint=tasks[i]["entry_point"]) for i, raw in jobs]
        checked = check_solutions(dataset, [(tasks[i], c) for (i, _), c in zip(jobs, clean)], **check)
        out: dict[int, list[Sample]] = {i: [] for i in answers}
        for (i, raw), c, v in zip(jobs, clean, checked):
            out[i].append(Sample(raw, c, v))
        return out

    results = code_benchmark(model_fn, tokenizer, tasks, prompt=prompt, score=verdicts, device=device,
                             samples=samples, seed=seed, temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens, stop=stops(dataset, chat), max_seq_len=max_seq_len)
    return EvalPlusResult(dataset, chat, {t["task_id"]: drawn for t, (_, drawn) in zip(tasks, results)})
