"""Evaluation during training: every N steps and at the end, never fatal.

Validation loss and bits-per-byte on every held-out set (each source's
held-out documents, data.holdout, and any ``[eval] val_sources``), per set
and as their token-weighted mean, over the tokens training learns from (chat
sources' masked labels are left out, as in the training loss); DCLM CORE on a bundle, lm-eval tasks, and a small EvalPlus
subset (HumanEval+/MBPP+, e.g. during SFT). Results go to stdout, the metric loggers
(tensorboard, wandb) and ``<run>/evals/step-<N>.json`` with the eval's wall
time. A failing part is logged and written to that JSON; the others and training go on.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

import rundir
from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
from eval.spec import EvalSpec
from train.callbacks.callback import Callback, LaneformerTrainer
from train.health.phases import Phase
from train.metric_names import VAL_BPB, VAL_LOSS, per_set


def token_bytes(sp) -> np.ndarray:
    """UTF-8 bytes each id stands for (byte-fallback ids: 1; BOS/EOS/unk: 0), for bits-per-byte."""
    sizes = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for i in range(sp.get_piece_size()):
        if sp.is_byte(i):
            sizes[i] = 1
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            sizes[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return sizes


def validation_rows(val_samples: int, micro: int, world: int, rank: int) -> list[np.ndarray]:
    """``rank``'s rows of a held-out set, batch by batch: samples 0 .. val_samples - 1 dealt out
    ``micro`` to a rank in turn, -1 for a padding row. Every rank runs as many forwards of ``micro``
    rows as the busiest (FSDP gathers its weights in every forward; a compiled model keeps one shape),
    so rows past val_samples are padding, left out of the loss: the scored samples, and so the loss,
    are the same on any number of ranks and any micro batch."""
    per_step = world * micro
    rows = [b * per_step + rank * micro + np.arange(micro) for b in range(math.ceil(val_samples / per_step))]
    return [np.where(r < val_samples, r, -1) for r in rows]


class Eval(Callback, Configurable):
    name = "eval"
    phase = Phase.EVAL

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every: int = 0  # steps; 0: only at the end
        at_end: bool = True
        spec: EvalSpec = field(default_factory=EvalSpec)  # what to evaluate: the recipe's [eval]
        chat_template: str | None = None  # the run's (recipe [data] chat_template, resolved), for EvalPlus's chat
        val_sets: dict[str, str] = field(default_factory=dict)  # name -> held-out dir (train.recipe.validation_sets)

    def __init__(self, config: Config, trainer: LaneformerTrainer):
        self.config = config
        self._val: dict[str, Mixture] | None = None

    def post_step(self, trainer: LaneformerTrainer) -> None:
        c, step = self.config, trainer.step
        due = (c.every and step % c.every == 0) or (c.at_end and step == trainer.config.training.steps)
        parts = {"validation": self.validation} if c.val_sets else {}
        parts.update({name: self._benchmark(spec) for name, spec in c.spec.benchmarks().items()})
        if not due or not parts:
            return
        start, results, errors = time.perf_counter(), {}, []
        model = trainer.model_parts[0]
        model.eval()
        for name, run in parts.items():
            try:  # an eval must never stop training
                with torch.no_grad():
                    results.update(run(trainer))
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                logger.error(f"eval at step {step} failed: {errors[-1]}\n{traceback.format_exc()}")
        model.train()
        results["eval/wall_time_s"] = time.perf_counter() - start
        trainer.metrics_processor.logger.log(results, step)
        if dist.get_rank() == 0:
            logger.info(f"eval at step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
            out = rundir.eval_file(trainer.config.dump_folder, step)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"step": step, "metrics": results, "errors": errors}, indent=2) + "\n")

    def validation(self, trainer: LaneformerTrainer) -> dict[str, float]:
        """Mean loss (nats/token) and bits per byte over the first val_samples samples of each held-out
        set, per set and over all of them (weighted by each set's tokens)."""
        seq_len, micro = trainer.config.training.seq_len, trainer.config.training.local_batch_size
        tokenizer = trainer.tokenizer.tokenizer
        if self._val is None:  # each set on its own: a one-source mixture, read from its start
            self._val = {name: Mixture([SourceSpec(name=name, path=path, weight=1.0, max_epochs=1e9)], seq_len, seed=0,
                                       expected_fingerprint=tokenizer.fingerprint,
                                       expected_vocab_size=tokenizer.vocab_size)
                         for name, path in self.config.val_sets.items()}
            self._bytes = torch.from_numpy(token_bytes(tokenizer.sp))
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        totals = torch.zeros(len(self._val), 3, dtype=torch.float64)  # per set: nats, tokens, bytes
        for i, val in enumerate(self._val.values()):
            for rows in validation_rows(self.config.spec.val_samples, micro, world, rank):
                padding = torch.from_numpy(rows < 0)
                batch = val.batch(np.maximum(rows, 0))  # a padding row reads sample 0 again, scored for nothing
                labels = torch.from_numpy(batch["labels"]).masked_fill(padding[:, None], IGNORE_INDEX)
                logits = trainer.model_parts[0](
                    torch.from_numpy(batch["input_ids"]).to(trainer.device),
                    positions=torch.from_numpy(batch["positions"]).to(trainer.device))
                nats = F.cross_entropy(logits.float().flatten(0, 1), labels.to(trainer.device).flatten(),
                                       reduction="sum")
                kept = labels != IGNORE_INDEX  # cross_entropy skips these too (its default ignore_index)
                totals[i] += torch.tensor([float(nats), int(kept.sum()), float(self._bytes[labels[kept]].sum())],
                                          dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)
        results = {}
        for name, (nats, tokens, nbytes) in zip(self._val, totals.tolist()):
            results[per_set(VAL_LOSS, name)] = nats / tokens
            results[per_set(VAL_BPB, name)] = nats / math.log(2) / nbytes
        nats, tokens, nbytes = totals.sum(0).tolist()
        return {VAL_LOSS: nats / tokens, VAL_BPB: nats / math.log(2) / nbytes, **results}

    def _benchmark(self, spec: EvalSpec) -> Callable[[LaneformerTrainer], dict[str, float]]:
        """Scores ``spec`` (one benchmark) on the training model, through eval.suite."""
        def run(trainer: LaneformerTrainer) -> dict[str, float]:
            from eval.suite import evaluate

            model = trainer.model_parts[0]
            return evaluate(lambda ids: model(ids), trainer.tokenizer.tokenizer, spec,
                            max_seq_len=trainer.config.training.seq_len, device=trainer.device,
                            log=logger.info if dist.get_rank() == 0 else None, chat_template=self.config.chat_template)
        return run
