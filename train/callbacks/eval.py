"""Evaluation during training: every N steps and at the end, never fatal.

Validation loss and bits-per-byte on every held-out set (each source's
held-out documents, data.held_out, and any ``[eval] val_sources``), per set
and as their token-weighted mean, over the tokens training learns from (chat
sources' masked labels are left out, as in the training loss), at the run's
length and each ``[eval] val_seq_lens``, with the loss by position in the
document at the longest (``[eval] position_buckets``, eval.position_loss);
DCLM CORE on a bundle, lm-eval tasks, and a small EvalPlus
subset (HumanEval+/MBPP+, e.g. during SFT). Then the objective's own evaluation where it has one
(``trainer.objective.evaluates``; a preference run with ``[preference] held_out``: ``eval/pref_loss``
and ``eval/pref_accuracy`` on the held-out pairs, train.objectives.preference), also before step 1
(logged as step 0, not on resume): the baseline the curves start from; for ``dpo`` and ``dpo_norm``
the policy is the reference then, so the loss is ln 2 and no pair is won (ties). The reference's
log-probs are the init checkpoint's, computed before step 1 with the training pairs'
(train.preference.reference), never the trained policy's (TRL #1148 took eval log-probs from the policy).

One callback, so one rule for when an eval is due, one order (the model's evals, then the objective's,
each logged on its own) and one writer of ``<run>/evals/step-<N>.json``, with all of a step's
results and the model evals' wall time. A failing part is logged and written to that JSON; the others
and training go on.
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

import rundir
from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
from eval.position_loss import bucket_edges, bucket_losses, bucket_sums, token_nats, validation_rows
from eval.spec import EvalSpec
from train.callbacks.callback import Callback, TrainerView
from health.phases import Phase
from train.metric_names import VAL_BPB, VAL_LOSS, at_length, per_set


def token_bytes(sp) -> np.ndarray:
    """UTF-8 bytes each id stands for (byte-fallback ids: 1; BOS/EOS/unk: 0), for bits-per-byte."""
    sizes = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for i in range(sp.get_piece_size()):
        if sp.is_byte(i):
            sizes[i] = 1
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            sizes[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return sizes


class Eval(Callback[TrainerView], Configurable):
    name = "eval"
    phase = Phase.EVAL

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        every: int = 0  # steps; 0: only at the end
        at_end: bool = True
        spec: EvalSpec = field(default_factory=EvalSpec)  # what to evaluate: the recipe's [eval]
        chat_template: str | None = None  # the run's (recipe [data] chat_template, resolved), for EvalPlus's chat
        val_sets: dict[str, str] = field(default_factory=dict)  # name -> held-out dir (train.recipe.validation_sets)

    def __init__(self, config: Config, trainer: TrainerView):
        self.config = config
        self._val: dict[int, dict[str, Mixture]] = {}  # length -> each held-out set at it, opened once
        self.parts: dict[str, Callable[[TrainerView], dict[str, float]]] = \
            {"validation": self.validation} if config.val_sets else {}
        self.parts.update({name: self._benchmark(spec) for name, spec in config.spec.benchmarks().items()})

    def pre_train(self, trainer: TrainerView) -> None:
        if trainer.objective.evaluates and trainer.step == 0:  # not a resumed run: it has its baseline
            results, errors = self.score(trainer, 0, self.objective_part(trainer))
            self.log(trainer, 0, results)
            self.write(trainer, 0, results, errors)

    def post_step(self, trainer: TrainerView) -> None:
        c, step = self.config, trainer.step
        if not ((c.every and step % c.every == 0) or (c.at_end and step == trainer.config.training.steps)):
            return
        results: dict[str, float] = {}
        errors: list[str] = []
        if self.parts:  # without autograd, in eval mode, timed
            start = time.perf_counter()
            model = trainer.model_parts[0]
            model.eval()
            with torch.no_grad():
                results, errors = self.score(trainer, step, self.parts)
            model.train()
            results["eval/wall_time_s"] = time.perf_counter() - start
            self.log(trainer, step, results)
        if trainer.objective.evaluates:
            own, failed = self.score(trainer, step, self.objective_part(trainer))
            self.log(trainer, step, own)
            results, errors = {**results, **own}, errors + failed
        self.write(trainer, step, results, errors)

    @staticmethod
    def score(trainer: TrainerView, step: int,
              parts: dict[str, Callable[[TrainerView], dict[str, float]]]) -> tuple[dict[str, float], list[str]]:
        """Run ``parts`` in order: their results, and the errors of those that failed (an eval never
        stops training)."""
        results: dict[str, float] = {}
        errors: list[str] = []
        for name, run in parts.items():
            try:
                results.update(run(trainer))
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                logger.error(f"eval at step {step} failed: {errors[-1]}\n{traceback.format_exc()}")
        return results, errors

    @staticmethod
    def log(trainer: TrainerView, step: int, results: dict[str, float]) -> None:
        if results:
            trainer.metrics_processor.logger.log(results, step)
            if trainer.rank0:
                logger.info(f"eval at step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))

    @staticmethod
    def write(trainer: TrainerView, step: int, results: dict[str, float], errors: list[str]) -> None:
        """The step's evals file (rank 0), with all its results and errors."""
        if trainer.rank0 and (results or errors):
            out = rundir.eval_file(Path(trainer.config.dump_folder), step)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"step": step, "metrics": results, "errors": errors}, indent=2) + "\n")

    def validation(self, trainer: TrainerView) -> dict[str, float]:
        """Mean loss (nats/token) and bits per byte of each held-out set, per set and over all of them
        (weighted by each set's tokens), at the run's seq_len and at each ``[eval] val_seq_lens`` length
        (train.metric_names.at_length); with ``[eval] position_buckets``, the loss by position at the
        longest (eval.position_loss). Each rank sums its rows; the sums are added over ranks, then divided."""
        spec, seq_len = self.config.spec, trainer.config.training.seq_len
        lengths = spec.lengths(seq_len)
        edges = bucket_edges(lengths[-1], spec.position_buckets) if spec.position_buckets else None
        totals = torch.zeros(len(lengths), len(self.config.val_sets), 3, dtype=torch.float64)  # nats, tokens, bytes
        positions = torch.zeros(2, spec.position_buckets, dtype=torch.float64)  # nats, tokens per bucket
        for i, length in enumerate(lengths):
            for j, val in enumerate(self.held_out_sets(trainer, length).values()):
                at_longest = edges if length == lengths[-1] else None
                totals[i, j], by_position = self.score_set(trainer, val, length, at_longest)
                positions += by_position
        if dist.is_initialized():
            dist.all_reduce(totals)
            dist.all_reduce(positions)
        results = {k: v for length, sets in zip(lengths, totals) for k, v in self.named(sets, length, seq_len).items()}
        return {**results, **(bucket_losses(positions, edges) if edges else {})}

    def held_out_sets(self, trainer: TrainerView, length: int) -> dict[str, Mixture]:
        """Each held-out set as rows of ``length``: a one-source mixture, read from its start (opened once)."""
        tokenizer = trainer.tokenizer.tokenizer
        if length not in self._val:
            self._val[length] = {name: Mixture([SourceSpec(name=name, path=path, weight=1.0, max_epochs=1e9)], length,
                                               seed=0, expected_fingerprint=tokenizer.fingerprint,
                                               expected_vocab_size=tokenizer.vocab_size)
                                 for name, path in self.config.val_sets.items()}
            self._bytes = torch.from_numpy(token_bytes(tokenizer.sp))
        return self._val[length]

    def score_set(self, trainer: TrainerView, val: Mixture, length: int,
                  edges: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's sums over one held-out set's rows of ``length``: (nats, tokens, bytes), and with
        ``edges`` (nats, tokens) per position bucket (else zeros). Every length scores the same tokens,
        the first val_samples x seq_len of the set (rounded up to whole rows), micro_batch x seq_len
        tokens a forward: what differs between lengths is only the context each token is predicted from."""
        t = trainer.config.training
        rows_per_forward = max(1, t.local_batch_size * t.seq_len // length)
        samples = math.ceil(self.config.spec.val_samples * t.seq_len / length)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        sums = torch.zeros(3, dtype=torch.float64)
        by_position = torch.zeros(2, self.config.spec.position_buckets, dtype=torch.float64)
        for rows in validation_rows(samples, rows_per_forward, world, rank):
            padding = torch.from_numpy(rows < 0)
            batch = val.batch(np.maximum(rows, 0))  # a padding row reads sample 0 again, scored for nothing
            labels = torch.from_numpy(batch["labels"]).masked_fill(padding[:, None], IGNORE_INDEX)
            positions = torch.from_numpy(batch["positions"])
            logits = trainer.model_parts[0](torch.from_numpy(batch["input_ids"]).to(trainer.device),
                                            positions=positions.to(trainer.device))
            nats = token_nats(logits, labels.to(trainer.device)).double().cpu()
            kept = labels != IGNORE_INDEX
            sums += torch.tensor([nats.sum().item(), kept.sum().item(), self._bytes[labels[kept]].sum().item()],
                                 dtype=torch.float64)
            if edges:
                by_position += bucket_sums(nats, labels, positions, edges)
        return sums, by_position

    def named(self, totals: torch.Tensor, length: int, seq_len: int) -> dict[str, float]:
        """One length's metrics from its summed (nats, tokens, bytes) per set: per set, then over all sets."""
        loss, bpb = at_length(VAL_LOSS, length, seq_len), at_length(VAL_BPB, length, seq_len)
        results = {}
        for name, (nats, tokens, nbytes) in zip(self.config.val_sets, totals.tolist()):
            results[per_set(loss, name)] = nats / tokens
            results[per_set(bpb, name)] = nats / math.log(2) / nbytes
        nats, tokens, nbytes = totals.sum(0).tolist()
        return {loss: nats / tokens, bpb: nats / math.log(2) / nbytes, **results}

    def _benchmark(self, spec: EvalSpec) -> Callable[[TrainerView], dict[str, float]]:
        """Scores ``spec`` (one benchmark) on the training model, through eval.suite."""
        def run(trainer: TrainerView) -> dict[str, float]:
            from eval.suite import evaluate

            model = trainer.model_parts[0]
            return evaluate(lambda ids: model(ids), trainer.tokenizer.tokenizer, spec,
                            max_seq_len=trainer.config.training.seq_len, device=trainer.device,
                            log=logger.info if dist.get_rank() == 0 else None, chat_template=self.config.chat_template)
        return run

    @staticmethod
    def objective_part(trainer: TrainerView) -> dict[str, Callable[[TrainerView], dict[str, float]]]:
        """The objective's own evaluation as a part (train.objectives: a preference run's held-out pairs, with
        autograd on, as its reference pass)."""
        return {trainer.objective.eval_name: trainer.objective.evaluate}
