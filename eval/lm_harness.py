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
"""

from __future__ import annotations

import json
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


def load_task_file(path: str | Path) -> list[dict]:
    """Task dicts from a JSON or YAML file (a list, or ``{"tasks": [...]}``), data_files made absolute."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        raw = yaml.safe_load(text)
    else:
        raw = json.loads(text)
    tasks = raw["tasks"] if isinstance(raw, dict) else raw
    return [absolute_data_files(task, path.parent) for task in tasks]


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


def run_lm_eval(lm: LaneformerLM, tasks: list[dict], *, limit: int | float | None = None) -> dict | None:
    """lm-eval's results per task on rank 0 (None elsewhere); every rank must call it."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_defaults=False),
                          limit=limit, bootstrap_iters=0, log_samples=False)
    return out["results"] if out else None


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
