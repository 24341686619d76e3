"""HumanEval+ and MBPP+ by the EvalPlus protocol: greedy pass@1 on base and on plus tests.

What is mirrored from EvalPlus (github.com/evalplus/evalplus: codegen.py,
provider/utility.py, evaluate.py, eval/__init__.py, sanitize.py, config.py):

- data: the release files ``HumanEvalPlus.jsonl(.gz)`` v0.1.10 and
  ``MbppPlus.jsonl(.gz)`` v0.2.0 (task_id, prompt, entry_point,
  canonical_solution, base_input, plus_input, atol); MBPP+ inputs are
  turned back into tuples/sets/complex numbers as EvalPlus's loader does.
- prompts: ``prompt.strip() + "\\n"``. Base models continue it (the solution
  is prompt + completion), stopping at EvalPlus's EOS strings plus the
  per-dataset direct-completion stops, after at most 768 new tokens. Instruct models (``chat=True``) get
  the instruction "Please provide a self-contained Python script ..." with
  the task in a code block as the user turn, and the answer is started for
  them with "Below is a Python script ...\\n```python\\n" (the chat template,
  cut at a marker inside the assistant turn); the solution is the answer.
- sanitize: the longest syntactically valid run of lines, then only imports
  and the definitions the entry point reaches (an ``ast`` version of
  EvalPlus's tree-sitter one).
- tests: the expected outputs are the canonical solution's on the same
  inputs; each input gets max(1.0 s, 4 x the canonical solution's time)
  (EvalPlus's DEFAULT_MIN_TIME_LIMIT, DEFAULT_GT_TIME_LIMIT_FACTOR); outputs
  must be equal, or close with the task's atol (1e-6 for floats when atol is
  0; numpy's assert_allclose rule, in plain Python: the sandbox's guard
  leaves numpy unimportable), with EvalPlus's three special oracles; the
  first failing input fails the set (its fast check). "plus" passes when
  base and plus both pass.

Each check runs as one program in ``eval.sandbox`` (never in this process):
the canonical solution is timed there first, then the candidate runs.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import gzip
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import dist
from .generate import generate
from .sandbox import run_program

RELEASES = {"humaneval": ("HumanEvalPlus", "v0.1.10", "HUMANEVAL_OVERRIDE_PATH"),
            "mbpp": ("MbppPlus", "v0.2.0", "MBPP_OVERRIDE_PATH")}
RELEASE_URL = "https://github.com/evalplus/{repo}_release/releases/download/{version}/{name}.jsonl.gz"
MAX_NEW_TOKENS = 768  # EvalPlus's DecoderBase default
MIN_TIME_LIMIT = 1.0
GT_TIME_LIMIT_FACTOR = 4.0
EOS = ["<|endoftext|>", "<|endofmask|>", "</s>", "\nif __name__", "\ndef main(", "\nprint("]
DIRECT_COMPLETION_STOPS = {"humaneval": ["\ndef ", "\nclass ", "\nimport ", "\nfrom ", "\nassert "],
                           "mbpp": ['\n"""', "\nassert"]}
INSTRUCTION_PREFIX = ("Please provide a self-contained Python script that solves the following problem "
                      "in a markdown code block:")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem "
                   "and passes corresponding tests:")
_SPLIT = "-[[]]-this-is-really-our-highest-priority-[[]]-"  # EvalPlus's marker inside the answer


class EvalPlusDataError(FileNotFoundError):
    """The EvalPlus release file is missing or malformed."""


def cache_path(dataset: str) -> Path:
    """Where EvalPlus itself caches the release (so an existing EvalPlus install's copy is found)."""
    name, version, _ = RELEASES[dataset]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "evalplus"
    return root / f"{name}-{version}.jsonl"


def _fetch(dataset: str) -> Path:
    import urllib.request

    name, version, _ = RELEASES[dataset]
    url = RELEASE_URL.format(repo=name.lower(), version=version, name=name)
    dest = cache_path(dataset)
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            data = gzip.decompress(r.read())
    except OSError as e:
        raise EvalPlusDataError(
            f"{dataset}: no --evalplus-data file given, none at {dest}, and {url} could not be fetched ({e}). "
            f"Download {name}.jsonl.gz ({version}) from {url} on a machine with "
            f"network access and pass it with --evalplus-data (or put it, decompressed, at {dest}).") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return dest


def load_tasks(dataset: str, path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """The tasks of a release file (the first ``limit``), inputs deserialized as EvalPlus does."""
    if dataset not in RELEASES:
        raise ValueError(f"unknown EvalPlus dataset {dataset!r}: expected one of {sorted(RELEASES)}")
    path = path or os.environ.get(RELEASES[dataset][2])
    path = Path(path) if path else (cache_path(dataset) if cache_path(dataset).is_file() else _fetch(dataset))
    if not path.is_file():
        raise EvalPlusDataError(f"{path}: no such EvalPlus release file")
    opener = gzip.open if path.suffix == ".gz" else open
    tasks = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalPlusDataError(f"{path}: line {n}: not JSON ({e})") from None
            missing = [k for k in ("task_id", "prompt", "entry_point", "canonical_solution", "base_input",
                                   "plus_input", "atol") if k not in task]
            if missing:
                raise EvalPlusDataError(f"{path}: line {n}: missing {missing}")
            if dataset == "mbpp":
                task["base_input"] = mbpp_inputs(task["task_id"], task["base_input"])
                task["plus_input"] = mbpp_inputs(task["task_id"], task["plus_input"])
            tasks.append(task)
            if limit and len(tasks) == limit:
                break
    if not tasks:
        raise EvalPlusDataError(f"{path}: no tasks")
    return tasks


def _tuples(x):
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


# MBPP+ task numbers whose JSON inputs EvalPlus turns back into tuples (evalplus/data/mbpp.py).
_MBPP_ARGS_TUPLES = {2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630, 726,
                     740, 744, 809}
_MBPP_NESTED_TUPLES = {63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780}
_MBPP_FIRST_NESTED = {75, 413, 444, 753}
_MBPP_FIRST_TUPLE = {250, 405, 446, 617, 720, 763, 808}
_MBPP_DOUBLE_NESTED = {259, 401, 445}


def mbpp_inputs(task_id: str, inputs: list) -> list:
    """MBPP+ inputs as EvalPlus passes them (JSON has no tuples, sets or complex numbers)."""
    t = int(task_id.split("/")[-1])
    if t in _MBPP_ARGS_TUPLES:
        return [[tuple(a) for a in inp] for inp in inputs]
    if t in _MBPP_NESTED_TUPLES:
        return [[[tuple(x) for x in a] for a in inp] for inp in inputs]
    if t in _MBPP_FIRST_NESTED:
        return [[[tuple(x) for x in inp[0]], inp[1]] for inp in inputs]
    if t in (106, 750):
        return [[inp[0], tuple(inp[1])] for inp in inputs]
    if t == 115:
        return [[[set(x) if isinstance(x, list) and x else {} for x in inp[0]]] for inp in inputs]
    if t == 124:
        return [(float(inp[0]), complex(inp[1])) for inp in inputs]
    if t in _MBPP_FIRST_TUPLE:
        return [[tuple(inp[0]), inp[1]] for inp in inputs]
    if t in _MBPP_DOUBLE_NESTED:
        return [[tuple(tuple(x) for x in a) for a in inp] for inp in inputs]
    if t == 278:
        return [[tuple(tuple(x) if isinstance(x, list) else x for x in inp[0])] for inp in inputs]
    if t == 307:
        return [[tuple(inp[0]), inp[1], inp[2]] for inp in inputs]
    if t == 722:
        return [[{k: tuple(v) for k, v in inp[0].items()}, *inp[1:]] for inp in inputs]
    if t == 252:
        return [[complex(inp[0])] for inp in inputs]
    if t in (580, 615, 791):
        return [_tuples(inp) for inp in inputs]
    return inputs


# ---------------------------------------------------------------- prompts and sanitizing

def base_prompt(task: dict) -> str:
    return task["prompt"].strip() + "\n"


def chat_messages(task: dict) -> list[dict]:
    """The instruct prompt as a conversation; the answer holds the marker where generation starts."""
    user = f"{INSTRUCTION_PREFIX}\n```\n{task['prompt'].strip()}\n```\n"
    answer = f"{RESPONSE_PREFIX}\n```python\n{_SPLIT}\n```\n"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def chat_prompt_ids(task: dict, tokenizer, template: str | None = None) -> list[int]:
    """Ids of the instruct prompt: the chat template cut at the marker, as EvalPlus builds it."""
    messages = chat_messages(task)
    if hasattr(tokenizer, "hf"):  # an exported folder: its own tokenizer and template, as EvalPlus uses them
        if tokenizer.hf.chat_template is None:
            raise ValueError("--chat: the tokenizer has no chat_template")
        text = tokenizer.hf.apply_chat_template(messages, tokenize=False).split(_SPLIT)[0]
        return tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    from data.chat import prefix_ids

    return prefix_ids(messages, tokenizer, _SPLIT, template)


def extract_code(text: str) -> str:
    """The longest run of lines that parses (by non-blank lines), as EvalPlus's code_extract."""
    lines = text.split("\n")
    best, best_len = "", 0
    for i in range(len(lines)):
        for j in range(i + 1, len(lines) + 1):
            chunk = "\n".join(lines[i:j])
            size = sum(1 for line in lines[i:j] if line.strip())
            if size > best_len and _parses(chunk):
                best, best_len = chunk, size
    return best


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


def sanitize(text: str, entry_point: str | None = None) -> str:
    """Imports plus the functions, classes and top-level assignments the entry point needs."""
    code = extract_code(text)
    tree = ast.parse(code)
    imports, defs, order = [], {}, []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name not in defs:
                defs[node.name] = node
                order.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names and names[0] not in defs:
                defs[names[0]] = node
                order.append(names[0])
    keep = set(order)
    if entry_point and entry_point in defs:
        keep, todo = set(), [entry_point]
        while todo:
            name = todo.pop()
            if name in keep or name not in defs:
                continue
            keep.add(name)
            todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)]
    nodes = imports + [defs[name] for name in order if name in keep]
    return "\n".join(_segment(code, n) for n in sorted(nodes, key=lambda n: n.lineno)) + "\n"


def _segment(code: str, node: ast.stmt) -> str:
    """A top-level statement's lines, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(code.split("\n")[first - 1 : node.end_lineno])


# ---------------------------------------------------------------- running the tests

_CHECK = r'''
import base64, contextlib, copy, io, math, pickle, signal, sys, time

INPUTS = pickle.loads(base64.b64decode({inputs!r}))
ENTRY, ATOL, MIN_T, FACTOR = {entry!r}, {atol!r}, {min_t!r}, {factor!r}

class _Timeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _Timeout()

signal.signal(signal.SIGALRM, _alarm)

def _call(fn, inp, limit):
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        return fn(*copy.deepcopy(inp))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def _is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    return False

def _flat(x):
    return [v for i in x for v in _flat(i)] if isinstance(x, (list, tuple)) else [x]

def _allclose(out, exp, atol):  # numpy.testing.assert_allclose(out, exp, atol=atol), rtol 1e-7
    o, e = _flat(out), _flat(exp)
    assert len(o) == len(e)
    for a, b in zip(o, e):
        a, b = complex(a), complex(b)
        if a == b or (a != a and b != b):
            continue
        assert abs(a - b) <= atol + 1e-7 * abs(b)

def _poly(xs, x):
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))

def _sticky(value):  # EvalPlus's oracle for tasks accepting "always <value>" (MBPP 164, 295)
    state = {{"same": True, "const": True}}
    def check(out, exp):
        state["same"] = state["same"] and out == exp
        state["const"] = state["const"] and out == value
        return state["same"] or state["const"]
    return check

_SPECIAL = {{"are_equivalent": _sticky(True), "sum_div": _sticky(0)}}
quiet = io.StringIO()
with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
    ref = {{}}
    exec(compile({reference!r}, "reference.py", "exec"), ref)
    expected, times = [], []
    for inp in INPUTS:
        t = time.perf_counter()
        expected.append(ref[ENTRY](*copy.deepcopy(inp)))
        times.append(time.perf_counter() - t)
    cand = {{"__name__": "__main__"}}
    exec(compile({solution!r}, "solution.py", "exec"), cand)
    fn = cand[ENTRY]
    for i, (inp, exp) in enumerate(zip(INPUTS, expected)):
        atol = ATOL
        try:
            out = _call(fn, inp, max(MIN_T, FACTOR * times[i]))
            ok = out == exp
            if ENTRY in _SPECIAL:
                ok = _SPECIAL[ENTRY](out, exp)
            elif ENTRY == "find_zero":
                ok = abs(_poly(inp[0], out)) <= atol
            if atol == 0 and _is_floats(exp):
                atol = 1e-6
            if not ok and atol != 0:
                _allclose(out, exp, atol)
            else:
                assert ok
        except BaseException as e:
            sys.__stderr__.write(f"input {{i}}: {{type(e).__name__}}\n")
            raise SystemExit(1)
raise SystemExit(0)
'''


def check_program(task: dict, solution: str, which: str, *, min_time_limit: float = MIN_TIME_LIMIT,
                  factor: float = GT_TIME_LIMIT_FACTOR) -> str:
    """The program that exits 0 when ``solution`` passes the task's ``which`` ("base"/"plus") inputs."""
    inputs = base64.b64encode(pickle.dumps(task[f"{which}_input"])).decode()
    return _CHECK.format(inputs=inputs, entry=task["entry_point"], atol=float(task["atol"] or 0),
                         min_t=min_time_limit, factor=factor,
                         reference=task["prompt"] + task["canonical_solution"], solution=solution)


def check_solution(task: dict, solution: str, *, min_time_limit: float = MIN_TIME_LIMIT,
                   factor: float = GT_TIME_LIMIT_FACTOR, memory_mb: int = 4096) -> dict[str, bool]:
    """{"base": passed base tests, "plus": passed base and plus tests}, each run in the sandbox."""
    result = {}
    for which in ("base", "plus"):
        n = len(task[f"{which}_input"])
        # The outer limit is a backstop: the program enforces each input's own limit.
        program = check_program(task, solution, which, min_time_limit=min_time_limit, factor=factor)
        result[which] = run_program(program, timeout_s=20 + n * min_time_limit, memory_mb=memory_mb).passed
    result["plus"] = result["plus"] and result["base"]
    return result


@dataclasses.dataclass
class EvalPlusResult:
    dataset: str
    chat: bool
    passed: dict[str, dict[str, bool]]  # task_id -> {"base": ..., "plus": ...}
    solutions: dict[str, str]  # task_id -> the sanitized program that was run

    def metrics(self) -> dict[str, float]:
        n = len(self.passed)
        return {f"{self.dataset}/pass@1": sum(p["base"] for p in self.passed.values()) / n,
                f"{self.dataset}+/pass@1": sum(p["plus"] for p in self.passed.values()) / n}


def score(tasks: list[dict], solutions: dict[str, str], dataset: str = "humaneval", chat: bool = False,
          workers: int = 4, **limits) -> EvalPlusResult:
    """Score ready-made solutions (complete programs, sanitized here) against their tasks."""
    clean = {t["task_id"]: sanitize(solutions[t["task_id"]], t["entry_point"]) for t in tasks}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = list(pool.map(lambda t: check_solution(t, clean[t["task_id"]], **limits), tasks))
    return EvalPlusResult(dataset, chat, {t["task_id"]: p for t, p in zip(tasks, passed)}, clean)


def evaluate_evalplus(model_fn, tokenizer, dataset: str, *, max_seq_len: int, device: torch.device | str = "cpu",
                      tasks: list[dict] | None = None, data_path: str | Path | None = None,
                      limit: int | None = None, chat: bool = False, chat_template: str | None = None,
                      max_new_tokens: int = MAX_NEW_TOKENS, workers: int = 4, **limits) -> EvalPlusResult:
    """Greedy pass@1 of ``model_fn`` on base and plus tests. Every rank must call this."""
    tasks = tasks if tasks is not None else load_tasks(dataset, data_path, limit)
    stops = EOS if chat else EOS + DIRECT_COMPLETION_STOPS[dataset]
    mine = list(range(dist.rank(), len(tasks), dist.world_size()))
    solutions = {}
    with dist.Lockstep(model_fn, device, tokenizer.bos_id) as forward:
        for i in mine:
            task = tasks[i]
            ids = chat_prompt_ids(task, tokenizer, chat_template) if chat else \
                tokenizer.encode(base_prompt(task), bos=True)
            out = generate(forward, tokenizer, [ids], max_new_tokens=max_new_tokens, stop=stops,
                           max_seq_len=max_seq_len)[0]
            solutions[task["task_id"]] = out if chat else base_prompt(task) + out
    # Each rank runs the sandboxes for its own tasks only, then the verdicts are gathered.
    mine_scored = score([tasks[i] for i in mine], solutions, dataset, chat, workers, **limits)
    passed, clean = {}, {}
    for part_passed, part_clean in dist.all_gather_objects((mine_scored.passed, mine_scored.solutions)):
        passed.update(part_passed)
        clean.update(part_clean)
    order = [t["task_id"] for t in tasks]
    return EvalPlusResult(dataset, chat, {k: passed[k] for k in order}, {k: clean[k] for k in order})
