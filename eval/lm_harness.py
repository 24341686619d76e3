"""lm-eval (0.4.13) over a bare ``(ids) -> logits`` callable and the project tokenizer.

lm-eval's own HFLM only takes a transformers PreTrainedModel, so the training
model (or an exported folder loaded with transformers, see ``eval.load``) is
wrapped here. Importing this module imports lm-eval (an optional extra);
nothing else in ``eval`` imports it at module level.

Tokenization follows the project's framing: every sequence starts with BOS,
and BOS is also the context of an empty-context request. Loglikelihoods are
computed as HFLM does (context + continuation cropped from the left to
``max_seq_len + 1`` tokens). Tasks run offline: inline task dicts whose
``data_files`` are absolute paths, a ``TaskManager(include_defaults=False)``
(the default one indexes ~14k YAMLs) and ``bootstrap_iters=0``.

Distributed: lm-eval splits documents over ``rank``/``world_size`` and pads
request counts; forwards additionally run in lock step (``eval.dist``), so an
FSDP model never waits on a rank that generated fewer tokens. A task needs at
least ``world_size`` documents, or a rank gets no requests and lm-eval hangs.

lm-eval's own tasks (RULER's ``niah_single_1``, ``ruler_vt`` ...) are named by
their lm-eval name in a task file, or as a comma list in place of the file
(``load_task_file``); only the folders of lm-eval's task tree that mention them
are indexed. A task file's ``metadata`` is what lm-eval's ``--metadata`` gives
every task: RULER's ``max_seq_lengths`` (default: the checkpoint's
``max_seq_len``, the length it was trained at) and ``tokenizer``, the
``AutoTokenizer`` name RULER sizes its haystacks with (default: the
checkpoint's own tokenizer folder when it holds Hugging Face tokenizer files, else
such files made from its tokenizer.model).
Each length is one lm-eval evaluation, so ``limit`` counts documents per length
and each length's numbers are those of
``lm_eval --metadata '{"max_seq_lengths": [L], ...}'``.

RULER offline (lm_eval/tasks/ruler/, 0.4.13): ``niah_single_1``, ``niah_multikey_2``,
``niah_multikey_3``, ``ruler_vt``, ``ruler_cwe`` and ``ruler_fwe`` make their text from
nothing but the sizing tokenizer. The other seven read data from the network at run time:
the essay-haystack NIAH tasks (``niah_single_2``, ``niah_single_3``, ``niah_multikey_1``,
``niah_multiquery``, ``niah_multivalue``) the Hub dataset ``baber/paul_graham_essays``
(prepare_niah.get_haystack) split into sentences with NLTK's ``punkt_tab`` (downloaded when
missing, prepare_niah.download_nltk_resources: give a copy with ``NLTK_DATA``),
``ruler_qa_squad`` SQuAD 2.0's dev-v2.0.json and ``ruler_qa_hotpot`` HotpotQA's
hotpot_dev_distractor_v1.json (qa_utils.read_squad, read_hotpotqa: fixed URLs, through
requests). The task file's ``metadata: ruler_files: {essays: F, squad: F, hotpotqa: F}`` hands
them local copies (``local_ruler_files``; paths relative to the task file): the essays as a
json/jsonl/parquet/csv file of the dataset's ``text`` column, SQuAD's and HotpotQA's
files as published.
"""

from __future__ import annotations

import json
import re
import tempfile
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from rundir.progress import progress

from . import dist
from .core import pad_rows
from .generate import generate


class LaneformerLM(TemplateLM):
    """An lm-eval model over ``model_fn(ids [B, S]) -> logits [B, S, V]``."""

    def __init__(self, model_fn, tokenizer, *, max_seq_len: int, device: torch.device | str = "cpu",
                 batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        self.model_fn = model_fn
        self.tokenizer = tokenizer
        self.max_length = max_seq_len
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self._device = torch.device(device)
        self._rank, self._world_size = dist.rank(), dist.world_size()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, bos=add_special_tokens is not False)

    def _lockstep(self) -> dist.Lockstep:
        return dist.Lockstep(self.model_fn, self._device, self.tokenizer.bos_id)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log-probs of the continuation, whether greedy decoding reproduces it) per request."""
        inputs = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_seq_len {self.max_length}")
            inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))  # similar lengths share a batch
        with self._lockstep() as forward, self._progress(len(requests), "loglikelihood", disable_tqdm) as bar:
            for b in range(0, len(order), self.batch_size):
                batch = order[b : b + self.batch_size]
                logits = forward(pad_rows([inputs[i] for i in batch], self.tokenizer.bos_id))
                for row, i in enumerate(batch):
                    key, _, continuation = requests[i]
                    end = len(inputs[i])
                    scored = logits[row, end - len(continuation) : end].float().log_softmax(-1)
                    target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
                    results[i] = (
                        scored.gather(-1, target[:, None]).sum().item(),
                        bool((scored.argmax(-1) == target).all()),
                    )
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, results[i])
                bar.update(len(batch))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole strings, in disjoint windows of at most ``max_seq_len`` (as HFLM)."""
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string, add_special_tokens=False)
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1,
            )):
                windows.append((None, context, continuation))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations that stop at ``until`` strings, EOS or ``max_gen_toks``; greedy unless do_sample."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str | None] = [None] * len(requests)
        with self._lockstep() as forward, self._progress(len(requests), "generate", disable_tqdm) as bar:
            for indices in groups.values():
                kwargs = dict(requests[indices[0]].args[1])
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
                for b in range(0, len(indices), self.batch_size):
                    batch = indices[b : b + self.batch_size]
                    keep = max(1, self.max_length - max_new)
                    prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in batch]
                    texts = generate(forward, self.tokenizer, prompts, max_new_tokens=max_new, stop=until,
                                     max_seq_len=self.max_length, temperature=temperature)
                    for i, text in zip(batch, texts):
                        results[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        return results

    def _progress(self, total: int, what: str, disable: bool):
        """Rank 0's progress on stderr over this rank's requests (lm-eval pools the tasks' requests by kind)."""
        return progress(total=total, desc=f"lm-eval {what}", unit="request", disable=disable or self._rank != 0)

    # Distributed hooks lm-eval's evaluator calls when world_size > 1.
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return dist.all_gather_cat(tensor)

    def gather_object(self, obj, dst: int = 0):
        return dist.gather_objects(obj, dst)

    def barrier(self) -> None:
        dist.barrier()


# RULER's metadata key for the lengths its samples are sized to (lm_eval/tasks/ruler/niah_utils.py:34,
# common_utils.py:17: default [4096]) and its placeholder score for "no sample at this length"
# (common_utils.py:101-108, 121-126).
LENGTHS = "max_seq_lengths"
NO_SAMPLE = -1
# A task file's metadata key for local copies of what RULER downloads (local_ruler_files): its own, never
# handed to lm-eval.
RULER_FILES = "ruler_files"
RULER_FILE_KINDS = ("essays", "squad", "hotpotqa")


class TaskFile(list):
    """A task file's entries (inline task dicts, lm-eval task names) and its ``metadata``: what lm-eval's
    ``--metadata`` gives every task (RULER reads ``max_seq_lengths`` and ``tokenizer`` from it)."""

    def __init__(self, tasks=(), metadata: dict | None = None):
        super().__init__(tasks)
        self.metadata = dict(metadata or {})

    @property
    def names(self) -> list[str]:
        """The entries that name lm-eval's own tasks (groups, tags)."""
        return [t for t in self if isinstance(t, str)]


NAMES = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")


def load_task_file(path: str | Path) -> TaskFile:
    """The tasks of a JSON or YAML file (a list, or ``{"tasks": [...], "metadata": {...}}``), data_files made
    absolute; an entry is an inline task dict or the name of one of lm-eval's own tasks. In place of a file, a
    comma list of lm-eval task names (``niah_single_1,ruler_vt``). Raises OSError, ValueError or KeyError."""
    text_path = str(path)
    path = Path(path)
    if not path.exists() and path.suffix not in (".json", ".yaml", ".yml") and NAMES.fullmatch(text_path):
        tasks = TaskFile(text_path.split(","))
    else:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
        metadata = raw.get("metadata") if isinstance(raw, dict) else None
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"metadata: expected a mapping, got {metadata!r}")
        entries = raw["tasks"] if isinstance(raw, dict) else raw
        if not isinstance(entries, list):
            raise ValueError(f"tasks: expected a list, got {type(entries).__name__}")
        tasks = TaskFile([t if isinstance(t, str) else absolute_data_files(t, path.parent) for t in entries],
                         metadata)
    for t in tasks:
        if not isinstance(t, (str, dict)):
            raise ValueError(f"a task is an inline task dict or an lm-eval task name, not {t!r}")
    lengths = tasks.metadata.get(LENGTHS)
    if lengths is not None and not (isinstance(lengths, list) and lengths
                                    and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths)):
        raise ValueError(f"metadata: {LENGTHS}: expected a list of positive token counts, got {lengths!r}")
    if (files := tasks.metadata.get(RULER_FILES)) is not None:
        if not isinstance(files, dict) or not set(files) <= set(RULER_FILE_KINDS):
            raise ValueError(f"metadata: {RULER_FILES}: expected a mapping of {', '.join(RULER_FILE_KINDS)} to "
                             f"files, got {files!r}")
        files = {k: Path(path.parent, v).resolve() for k, v in files.items()}  # relative: to the task file
        if missing := [f"{k}: {v}" for k, v in files.items() if not v.is_file()]:
            raise ValueError(f"metadata: {RULER_FILES}: no such file: {'; '.join(missing)}")
        tasks.metadata[RULER_FILES] = {k: str(v) for k, v in files.items()}
    if tasks.names:  # unknown names are bad input: said before a model loads
        try:
            builtin_task_dirs(tuple(tasks.names))
        except ValueError as e:
            raise ValueError(f"{e}{'' if path.exists() else ' (and no such task file)'}") from None
    return tasks


def absolute_data_files(task: dict, base: Path) -> dict:
    """A copy of ``task`` whose ``dataset_kwargs.data_files`` are absolute (relative to ``base``)."""
    kwargs = dict(task.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        return dict(task)

    def fix(f):
        return [fix(x) for x in f] if isinstance(f, list) else str((base / f).resolve())

    kwargs["data_files"] = {k: fix(v) for k, v in files.items()} if isinstance(files, dict) else fix(files)
    return {**task, "dataset_kwargs": kwargs}


@cache
def builtin_task_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
    """The folders of lm-eval's task tree that define ``names`` (tasks, groups or tags).

    lm-eval's default TaskManager parses all of its ~14k YAMLs (~17 s here); a name is defined in a YAML
    that spells it, so only the folders whose YAMLs mention a name are handed to lm-eval's own index
    (``TaskManager(include_path=...)``), which decides. Raises ValueError for a name lm-eval does not have.
    """
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.tasks.__file__).parent
    word = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    dirs = sorted({str(f.parent) for f in root.rglob("*.yaml") if word.search(f.read_text(errors="replace"))})
    known = set(TaskManager(include_defaults=False, include_path=dirs).all_tasks) if dirs else set()
    if missing := [n for n in names if n not in known]:
        raise ValueError(f"not a task, group or tag of lm-eval {lm_eval.__version__}: {', '.join(missing)}")
    return tuple(dirs)


def sizing_tokenizer(tokenizer) -> str | None:
    """The name RULER's ``AutoTokenizer.from_pretrained`` can open for the project tokenizer
    (lm_eval/tasks/ruler/common_utils.py:44-55): an export's folder, the folder of a tokenizer.model
    that also holds Hugging Face tokenizer files, else the files made from the tokenizer.model
    (``hf_tokenizer_files``); None if there is none."""
    hf = getattr(tokenizer, "hf", None)  # data.tokenizer.HFTokenizer: an export's or an import's
    if hf is not None:
        return getattr(hf, "name_or_path", None) or None
    path = getattr(tokenizer, "path", None)  # data.tokenizer.Tokenizer: a tokenizer.model
    if path is None:
        return None
    folder = (Path(path) if Path(path).is_dir() else Path(path).parent).resolve()
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
        return str(folder)
    model = folder / "tokenizer.model" if Path(path).is_dir() else Path(path)
    try:
        return str(hf_tokenizer_files(model))
    except ValueError:  # not a BPE SentencePiece model: data.hf_tokenizer cannot convert it
        return None


_HF_FILES: dict[str, tempfile.TemporaryDirectory] = {}


def hf_tokenizer_files(model: Path) -> Path:
    """A folder of Hugging Face tokenizer files made from ``model`` (a tokenizer.model, e.g. a run's
    Llama-2 one, fetched alone) by data.hf_tokenizer.save_hf_tokenizer, which encodes as SentencePiece
    does: RULER sizes its samples with the very tokenizer the model reads them with. Made once a
    process, removed when it ends."""
    key = str(model.resolve())
    if key not in _HF_FILES:
        from data.hf_tokenizer import save_hf_tokenizer

        folder = tempfile.TemporaryDirectory(prefix="laneformer-tokenizer-")
        save_hf_tokenizer(model, folder.name)
        _HF_FILES[key] = folder
    return Path(_HF_FILES[key].name)


def task_metadata(tasks: list, max_seq_len: int, tokenizer=None) -> dict:
    """lm-eval's metadata for ``tasks``: the file's own, RULER's lengths defaulting to ``[max_seq_len]`` and,
    when lm-eval's own tasks are named, its sizing tokenizer to the checkpoint's (``sizing_tokenizer``)."""
    metadata = {LENGTHS: [max_seq_len], **getattr(tasks, "metadata", {})}
    named = any(isinstance(t, str) for t in tasks)
    if named and "tokenizer" not in metadata and (name := sizing_tokenizer(tokenizer)):
        metadata["tokenizer"] = name
    return metadata


def check_lengths(tasks: list, max_seq_len: int) -> list[str]:
    """What is wrong with the task file's lengths for a model of ``max_seq_len`` tokens: a RULER sample
    longer than the model is cropped from the left (its instructions, then its needles) and scores nothing."""
    lengths = getattr(tasks, "metadata", {}).get(LENGTHS) or []
    if too_long := [n for n in lengths if n > max_seq_len]:
        return [f"metadata: {LENGTHS}: {too_long} exceed the checkpoint's max_seq_len {max_seq_len} (a longer "
                f"context for a DCP checkpoint: --set max_seq_len=N)"]
    return []


@contextmanager
def local_ruler_files(files: dict[str, str] | None):
    """While open, RULER's tasks read ``files`` (``{"essays" | "squad" | "hotpotqa": path}``) instead
    of downloading them: the essays that niah_utils.get_haystack loads with
    ``datasets.load_dataset("baber/paul_graham_essays")``, and the SQuAD / HotpotQA files that
    qa_utils.download_json would get from the URLs read_squad and read_hotpotqa name. What RULER makes
    of them is its own code. The modules patched are the ones lm-eval's task loader runs (it loads a
    task's ``!function`` file itself, keyed by its mtime: lm_eval/tasks/_yaml_loader.py)."""
    if not files:
        yield
        return
    import inspect

    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import _load_module_with_cache

    ruler = Path(lm_eval.tasks.__file__).parent / "ruler"
    patched = []  # (module, name, original)
    if "essays" in files:
        niah = _load_module_with_cache(ruler / "niah_utils.py")
        get_haystack = niah.get_haystack

        def local_haystack(type_haystack):
            if type_haystack != "essay":
                return get_haystack(type_haystack)
            import datasets

            path = Path(files["essays"])
            kind = {".jsonl": "json", ".txt": "text"}.get(path.suffix, path.suffix.lstrip("."))
            essay = " ".join(datasets.load_dataset(kind, data_files=str(path), split="train")["text"])
            return re.sub(r"\s+", " ", essay).split(" ")  # as get_haystack makes it of the Hub's copy

        patched.append((niah, "get_haystack", get_haystack))
        niah.get_haystack = local_haystack
    if qa_files := {k: v for k, v in files.items() if k in ("squad", "hotpotqa")}:
        qa = _load_module_with_cache(ruler / "qa_utils.py")
        readers = {"squad": qa.read_squad, "hotpotqa": qa.read_hotpotqa}
        urls = {inspect.signature(readers[k]).parameters["url"].default: v for k, v in qa_files.items()}
        download_json = qa.download_json

        def local_json(url):
            return json.loads(Path(urls[url]).read_text()) if url in urls else download_json(url)

        for reader in readers.values():  # cached once read: neither the Hub's copy before, nor ours after
            reader.cache_clear()
        patched.append((qa, "download_json", download_json))
        qa.download_json = local_json
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
            if name == "download_json":
                module.read_squad.cache_clear()
                module.read_hotpotqa.cache_clear()


def _length_metric(key: str) -> str | None:
    """``"4096,none"`` / ``"4096_stderr,none"`` -> ``"4096"``: RULER's metrics are named by length."""
    name = key.partition(",")[0].removesuffix("_stderr")
    return name if name.isdigit() else None


def run_lm_eval(lm: LaneformerLM, tasks: list, *, limit: int | float | None = None,
                samples: dict | None = None) -> dict | None:
    """lm-eval's results per task on rank 0 (None elsewhere); every rank must call it.

    ``tasks``: inline task dicts and lm-eval task names, with a ``TaskFile``'s metadata (``task_metadata``).
    One lm-eval evaluation per RULER length: the first runs every task, later ones only the tasks whose
    metrics are named by length; a task keeps each length's metrics from that length's run, and RULER's
    placeholder (-1) for the lengths a run had no sample of is dropped. The metadata's ``ruler_files``
    are read in place of RULER's downloads (``local_ruler_files``). ``samples``: filled on rank 0
    with lm-eval's logged samples per task (documents, arguments, responses, filtered responses).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    metadata = task_metadata(tasks, lm.max_length, lm.tokenizer)
    files = metadata.pop(RULER_FILES, None)
    names = [t for t in tasks if isinstance(t, str)]
    dirs = list(builtin_task_dirs(tuple(names))) if names else None
    results: dict = {}
    todo = list(tasks)
    for length in metadata[LENGTHS]:
        manager = TaskManager(include_defaults=False, include_path=dirs, metadata={**metadata, LENGTHS: [length]})
        with local_ruler_files(files):
            out = simple_evaluate(model=lm, tasks=todo, task_manager=manager, limit=limit, bootstrap_iters=0,
                                  log_samples=samples is not None)
        if out:
            for task, metrics in out["results"].items():
                mine = results.setdefault(task, {})
                for key, value in metrics.items():
                    at = _length_metric(key)
                    if key == "sample_len" and key in mine:  # documents scored: every length's
                        mine[key] += value
                    elif at is None:
                        mine.setdefault(key, value)
                    elif at == str(length) or value not in (NO_SAMPLE, "N/A"):
                        mine[key] = value
            for task, logged in (out.get("samples") or {}).items() if samples is not None else ():
                samples.setdefault(task, []).extend(logged)
            by_length = {t for t, m in out["results"].items() if any(_length_metric(k) for k in m)}
            todo = [t for t in todo if isinstance(t, str) and t in by_length]
        todo = dist.broadcast_object(todo)
        if not todo:
            break
    return results if dist.rank() == 0 else None


def flat_metrics(results: dict, prefix: str = "lm_eval") -> dict[str, float]:
    """``{task: {"acc,none": v, "acc_stderr,none": ...}}`` -> ``{"lm_eval/task/acc": v}`` (no stderr)."""
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if "_stderr" in name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            out[f"{prefix}/{task}/{name if filt in ('', 'none') else f'{name}_{filt}'}"] = float(value)
    return out
