"""The trainer of a preference run: ``LaneformerTrainer`` whose loss is the preference loss.

The seam is torchtitan's ``_forward_backward_body`` (one micro batch's forward, loss and backward):
everything around it, the step's callbacks, clipping, the spike guard, checkpoints, resumption, the
replica check, evals, report and export, is the pretraining trainer's. A micro batch is k pairs as
``[chosen..., rejected...]`` rows (data.pairs_loader), so chosen and rejected go through one
forward. The loss returned is the micro batch's sum of pair losses over the step's pairs
(``global_batch / 2``), so the loop's sum over micro batches and ranks, which it logs as the loss,
is the mean pair loss, as torchtitan's cross-entropy is the mean token loss. ``preference_loss``
(train.preference.loss) is built once, here, and scores the held-out pairs too (train.callbacks.eval).

Before step 1, at the loop's ``reference_pass`` (after the checkpoint load, before ``pre_train``),
the reference log-probs are computed or read (train.preference.reference). At each logging step the
``pref/*`` metrics (train.preference.metrics.STEP_METRICS) are summed over the step's micro batches and
ranks and logged with the step's other metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
import torch
import tyro

from data.pairs_loader import PAIR_IDS, PairSet
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from health.phases import Phase
from train.preference import reference
from train.preference.loss import PreferenceLoss, pair_sums, sequence_logps
from train.preference.metrics import STEP_METRICS
from train.recipe import Preference
from train.trainer import LaneformerTrainer


class PreferenceTrainer(LaneformerTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(LaneformerTrainer.Config):
        # The recipe's [preference] as it is (train.recipe.Preference: its defaults are the only ones); set
        # by train.preference.build.configure, not the CLI.
        preference: Annotated[Preference, tyro.conf.Suppress] = field(default_factory=Preference)
        template_sha256: str = ""  # the run's chat template: part of the reference key

    def __init__(self, config: Config):
        super().__init__(config)
        self._pair_ids: torch.Tensor | None = None
        self._pref_sums = torch.zeros(len(STEP_METRICS), dtype=torch.float64, device=self.device)
        self.pairs_per_step = config.training.global_batch_size // 2
        self.local_pairs = config.training.local_batch_size // 2
        p = config.preference
        assert p.loss is not None and p.gamma is not None  # a preference run's (train.preference.build)
        self.preference_loss = PreferenceLoss(p.loss, p.beta, p.label_smoothing, p.gamma)
        self.reference: dict[str, torch.Tensor] = {}  # role -> [pairs, 2] on the device
        # whatever the loss type: train.callbacks.eval scores them, against a reference or not (simpo)
        self.held_out_pairs = PairSet(p.held_out, config.training.seq_len, self.tokenizer.tokenizer.fingerprint,
                                     self.tokenizer.get_vocab_size()) if p.held_out else None

    # -- the reference log-probs, before step 1 -----------------------------------------------------

    def reference_pass(self) -> None:
        if self.preference_loss.needs_reference:
            self.enter(Phase.EVAL)  # a pass over every pair: the eval's stall allowance and goodput bucket
            self.reference = self._references()

    def _references(self) -> dict[str, torch.Tensor]:
        """Each role's reference log-probs (train.preference.reference): at step 0 the init checkpoint is
        read and what the keys hold is recorded; a resumed run keys by the record."""
        c = self.config
        sets = {"train": self.dataloader.loader.pairs}
        if self.held_out_pairs is not None:
            sets["held_out"] = self.held_out_pairs
        if self.step == 0:
            if not c.checkpoint.initial_load_path:
                raise reference.ReferenceError(f"[preference] loss {c.preference.loss!r} needs a reference: set "
                                               "[checkpoint] init_from (the SFT checkpoint)")
            record = {"init": reference.checkpoint_identity(c.checkpoint.initial_load_path,
                                                            beat=lambda: self.enter(Phase.EVAL))}
        else:
            record = reference.read_inputs(c.dump_folder, self.step)
        out = {}
        for role, pairs in sets.items():
            inputs = reference.key_inputs(record["init"], pairs.paths, c.preference.loss, c.training.seq_len,
                                          c.template_sha256, c.training.mixed_precision_param, c.compile.enable)
            out[role] = self._reference(role, pairs, inputs, record)
            record[role] = {"sources": pairs.paths, "inputs": inputs}
        if self.step == 0 and self.rank0:
            reference.write_inputs(c.dump_folder, record)
        return out

    def _reference(self, role: str, pairs: PairSet, inputs: dict, record: dict) -> torch.Tensor:
        c = self.config
        key = reference.cache_key(inputs)
        path = reference.cache_file(c.dump_folder, role, key)
        if path.is_file():
            logps = reference.load(path, pairs)
            if self.rank0:
                logger.info(f"reference log-probs of the {role} pairs: reusing {path} (key {key}; not recomputed)")
        elif self.step > 0:
            raise reference.missing_at_resume(c.dump_folder, role, self.step, record, pairs.paths, inputs)
        else:
            if self.rank0:
                logger.info(f"reference log-probs of the {role} pairs: computing {len(pairs):,} pairs with "
                            f"the init checkpoint {record['init']['path']} (key {key})")
            logps = reference.pair_logps(self.model_parts[0], pairs, self.local_pairs, self.preference_loss.average,
                                         self.device, beat=lambda: self.enter(Phase.EVAL))
            if self.rank0:
                reference.save(path, logps)
                logger.info(f"reference log-probs of the {role} pairs: written to {path}")
        return torch.from_numpy(np.ascontiguousarray(logps)).to(self.device)

    # -- one micro batch ----------------------------------------------------------------------------

    def forward_backward_step(self, *, input_dict: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
        self._pair_ids = input_dict.pop(PAIR_IDS)  # not a model input
        return super().forward_backward_step(input_dict=input_dict, **kwargs)

    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        k, objective = inputs.shape[0] // 2, self.preference_loss
        with self.train_context():
            logits = self.model_parts[0](inputs, **extra_kwargs)
            logps = sequence_logps(logits, labels, objective.average)
            del logits
            chosen, rejected = logps[:k], logps[k:]
            ref = self.reference["train"][self._pair_ids].unbind(1) if objective.needs_reference else ()
            losses, chosen_rewards, rejected_rewards = objective(chosen, rejected, *ref)
            loss = losses.sum() / self.pairs_per_step
            loss.backward()
        self._pref_sums += pair_sums(losses, chosen, rejected, chosen_rewards, rejected_rewards)
        return loss.detach()

    # -- the step's metrics -------------------------------------------------------------------------

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, local_weight: torch.Tensor,
                 global_weight: torch.Tensor, lr: dict[str, float]) -> None:
        super().log_step(loss, grad_norm, local_weight, global_weight, lr)
        if self.metrics_processor.should_log(self.step):
            sums = self._pref_sums
            if self.parallel_dims.dp_enabled:
                sums = dist_utils.dist_sum_tensor(sums, self.parallel_dims.get_mesh("batch"))
            values = (sums / self.pairs_per_step).tolist()
            self.metrics_processor.logger.log(dict(zip(STEP_METRICS, values)), self.step)
        self._pref_sums.zero_()
