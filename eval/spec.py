"""What to evaluate: one dataclass, parsed from a recipe's ``[eval]``, built by ``eval.run``'s flags.

Every choice of which evaluations run and how big they are lives here, with its default
written once. The defaults describe a full evaluation (every item, each benchmark's own
generation limit); a recipe's ``[eval]`` (train.recipe.Eval) narrows a few of them for a
quick look during training and adds when to run (scheduling is the trainer's, not the eval's).
What belongs to the model rather than to the choice (its sequence length, device, chat
template) is passed to ``eval.suite.run_evals`` beside the spec.

Torch-free, so the recipe can import it cheaply. Bad values raise ``EvalSpecError``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

EVALPLUS_DATASETS = ("humaneval", "mbpp")  # eval.evalplus.RELEASES's keys


class EvalSpecError(ValueError):
    """An impossible eval choice, naming the field."""


@dataclass(kw_only=True)
class EvalSpec:
    # Validation loss / bits per byte on held-out tokenized dirs: scored by the trainer
    # (train.callbacks.eval), which has the data pipeline; run_evals leaves them alone.
    val_sources: list[str] = field(default_factory=list)
    val_samples: int = 64  # sequences scored per held-out set: its first ones, the same on any number of ranks
    # Lengths to validate at besides the run's seq_len (each held-out set at each, on the same tokens:
    # the first val_samples x seq_len of its stream, cut into sequences of that length), e.g. [4096, 16384]
    # in a long-context phase: its short-context loss beside its long one. Names: train.metric_names.at_length.
    val_seq_lens: list[int] = field(default_factory=list)
    # Held-out loss by position in the document (eval.position_loss), in this many buckets (edges i x L // N) of the
    # longest validation length; 0: none.
    position_buckets: int = 0
    core_bundle: str | None = None  # a DCLM CORE bundle folder
    core_max_per_task: int | None = None  # None: every item
    core_tasks: list[str] | None = None  # CORE labels to score (the rest count as missing); None: all
    # a JSON/YAML file of lm-eval tasks (inline dicts, lm-eval's own names) and their metadata, or a comma
    # list of lm-eval task names (eval.lm_harness.load_task_file)
    lm_eval_tasks: str | None = None
    lm_eval_limit: int | None = None  # documents per task; None: all
    humaneval: bool = False  # HumanEval pass@k (runs model code in a sandbox)
    humaneval_limit: int | None = None  # problems; None: all
    humaneval_samples: int = 1  # samples per problem (above 1: needs humaneval_temperature > 0)
    humaneval_temperature: float = 0.0  # 0: greedy, one sample
    humaneval_max_new_tokens: int | None = None  # None: HumanEval's own (eval.humaneval)
    evalplus: str | None = None  # "humaneval", "mbpp" or "humaneval,mbpp": EvalPlus pass@k (greedy: pass@1)
    # A folder holding HumanEvalPlus.jsonl(.gz) / MbppPlus.jsonl(.gz), or one release file per
    # dataset, comma-separated, in order; None: EvalPlus's cache or download.
    evalplus_data: str | None = None
    evalplus_limit: int | None = None  # tasks per dataset; None: all
    evalplus_chat: bool = False  # instruct prompts through the chat template
    evalplus_max_new_tokens: int | None = None  # None: EvalPlus's own (eval.evalplus.MAX_NEW_TOKENS)
    # HumanEval/32: upstream's fix, or evalplus 0.3.1 as released (fails every find_zero solution)
    evalplus_find_zero: Literal["fixed", "released"] = "fixed"
    # pass@N: answers a task, drawn at this temperature (0: one greedy answer) with this nucleus (0.95: as
    # EvalPlus's providers sample, evalplus/provider/hf.py and vllm.py), seeded per task; eval.evalplus.pass_ks
    evalplus_samples: int = 1
    evalplus_temperature: float = 0.0
    evalplus_top_p: float = 0.95
    evalplus_seed: int = 0

    def __post_init__(self):
        for name in ("val_samples", "core_max_per_task", "lm_eval_limit", "humaneval_limit", "humaneval_samples",
                     "humaneval_max_new_tokens", "evalplus_limit", "evalplus_max_new_tokens", "evalplus_samples"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise EvalSpecError(f"{name}: must be > 0 (got {value})")
        if any(n <= 0 for n in self.val_seq_lens):
            raise EvalSpecError(f"val_seq_lens: every length must be > 0 (got {self.val_seq_lens})")
        if self.position_buckets < 0:
            raise EvalSpecError(f"position_buckets: must be >= 0 (got {self.position_buckets}; 0: none)")
        if self.humaneval_temperature < 0:
            raise EvalSpecError(f"humaneval_temperature: must be >= 0 (got {self.humaneval_temperature})")
        if self.evalplus_temperature < 0:
            raise EvalSpecError(f"evalplus_temperature: must be >= 0 (got {self.evalplus_temperature})")
        if not 0 < self.evalplus_top_p <= 1:
            raise EvalSpecError(f"evalplus_top_p: must be in (0, 1] (got {self.evalplus_top_p})")
        for bench in ("humaneval", "evalplus"):  # the one rule for both: N greedy answers are one answer N times
            samples, temperature = getattr(self, f"{bench}_samples"), getattr(self, f"{bench}_temperature")
            if getattr(self, bench) and samples > 1 and temperature == 0:
                raise EvalSpecError(f"{bench}_samples: {samples} answers a task at {bench}_temperature 0 would all "
                                    f"be the greedy one: set {bench}_temperature > 0 (or {bench}_samples 1)")
        if self.evalplus_find_zero not in ("fixed", "released"):
            raise EvalSpecError(f"evalplus_find_zero: {self.evalplus_find_zero!r} is not 'fixed' or 'released'")
        if self.evalplus is not None:
            names = self.evalplus_datasets
            if any(n not in EVALPLUS_DATASETS for n in names) or len(set(names)) != len(names):
                raise EvalSpecError(f"evalplus: {self.evalplus!r}: expected a comma list of distinct "
                                    f"{list(EVALPLUS_DATASETS)}")

    @property
    def evalplus_datasets(self) -> list[str]:
        """``evalplus`` as a list ("humaneval,mbpp" -> ["humaneval", "mbpp"]; unset: [])."""
        return [n.strip() for n in self.evalplus.split(",")] if self.evalplus else []

    def lengths(self, seq_len: int) -> list[int]:
        """The lengths each held-out set is validated at, ascending: the run's ``seq_len`` and every
        ``val_seq_lens`` (the run's own always: ``eval/val_loss`` is the one every reader compares)."""
        return sorted({seq_len, *self.val_seq_lens})

    def benchmarks(self) -> dict[str, EvalSpec]:
        """One spec per benchmark this one runs (CORE, lm-eval, HumanEval, EvalPlus), each with
        the others off: a caller that must survive one failing (the trainer) runs them apart."""
        off = {"core": {"core_bundle": None}, "lm_eval": {"lm_eval_tasks": None},
               "humaneval": {"humaneval": False}, "evalplus": {"evalplus": None}}
        wanted = {"core": self.core_bundle, "lm_eval": self.lm_eval_tasks, "humaneval": self.humaneval,
                  "evalplus": self.evalplus}
        return {name: dataclasses.replace(self, **{k: v for other, kv in off.items() if other != name
                                                   for k, v in kv.items()})
                for name in off if wanted[name]}


def default(name: str):
    """The default of EvalSpec field ``name`` (for eval.run's flags: written once, here)."""
    f = {f.name: f for f in dataclasses.fields(EvalSpec)}[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
