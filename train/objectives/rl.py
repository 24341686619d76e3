"""Reinforcement learning with verifiable rewards on code (``[rl] tasks``; issue 59): GRPO with the DAPO and
Dr. GRPO changes, as OLMo 3's OlmoRL and TRL's GRPOTrainer run it.

A step, per micro batch (``make_batches``, before the forward): the loader's k prompts (data.rl_tasks); for each,
G completions sampled in process on the policy's current weights (models.laneformer.sample: the KV-cache decoder,
weights gathered from the FSDP model at each step, one generator a sample); each completion's reward from its
tests run in the sandbox (eval.rewards); the advantage, reward minus its group's mean (divided by the group's
std + 1e-6 with ``std_scale``, torchtitan's AdvantageEstimator formula); a group whose samples all score the same
is dropped (its tokens leave the loss and its denominator) and counted (``frac_reward_zero_std``). Each sample
becomes one training row: prompt then completion, the labels shifted by one, ``loss_mask`` on the completion's
tokens (off for a truncated one with ``truncated = "mask"``), its ``advantages`` and the sampler's
``generator_logprobs`` on the same positions; padding has no label and no mask.

The loss is torchtitan 0.3.0's ``DAPOLoss`` (torchtitan/experiments/rl/losses/dapo.py, loaded by its file
path: ``import torchtitan.experiments.rl`` imports vLLM): the sum of the clipped per-token surrogate over the
masked tokens, over a denominator that the trainer sums over the step's micro batches and ranks (``weight``):

- ``dapo``: the step's response tokens (token-level, DAPO arXiv 2503.14476);
- ``dr_grpo``: the step's sequences x max_new_tokens, a constant (Dr. GRPO arXiv 2503.20783);
- ``grpo``: the step's sequences, each sequence's advantages divided by its length |o_i|: the per-token
  surrogate is positively homogeneous in the advantage, so this is each sequence's token mean, then the mean
  over sequences (tests/train/test_rl_loss.py checks it against a direct per-sequence implementation).

The policy takes one update per batch (TRL's num_iterations 1), so the ratio is 1 up to the decoder's and the
trainer's rounding; the clip metrics say how often it leaves the band. Metrics (``step_metrics``), with TRL's
names: ``reward``, ``reward_std`` (the mean of the groups' stds), ``frac_reward_zero_std``,
``completions/mean_length``, ``completions/max_length``, ``completions/clipped_ratio`` (truncated),
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``entropy``; and ``rl/reward_failures`` (rewards that hung,
crashed or reported garbage), ``rl/sampling_s``, ``rl/sampling_tokens_per_s``. ``evaluate``: greedy held-out
pass@1 (``eval/rl_pass@1``, EvalPlus's estimator), also at step 0 (the eval callback).
"""

from __future__ import annotations

import functools
import runpy
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchtitan
from torchtitan.components.loss import IGNORE_INDEX, compute_logprobs
from torchtitan.config import CompileConfig

from data.rl_tasks import PROMPT_INDEX, Task, TaskDataLoader, TaskError, read_tasks, split
from data.tokenizer import Tokenizer, continuation_text
from eval.rewards import FAILURES, STOPS, check_reward, score_all
from models.laneformer import Laneformer
from models.laneformer.generate import LaneDecoder
from models.laneformer.hf.checkpoint_io import expected_shapes
from models.laneformer.sample import Sample, sample, sample_seed
from train.objectives.base import Objective, TrainerParts
from train.recipe import Recipe, TableError
from train.recipe.objective import RL
from train.recipe.schema import Rl as RlTable

GENERATOR_LOGPROBS, ADVANTAGES, LOSS_MASK = "generator_logprobs", "advantages", "loss_mask"  # DAPOLoss's keywords
EVAL_PASS_AT_1 = "eval/rl_pass@1"
# The sums step_metrics reduces over ranks, in this order (completions/max_length: a histogram of lengths after).
SUMS = ("reward", "reward_sq", "samples", "groups", "zero_std_groups", "group_std", "length", "truncated",
        "tokens", "clip_low", "clip_high", "entropy", "failures", "sampling_s", "sampled_tokens")


@functools.cache
def dapo_module() -> SimpleNamespace:
    """torchtitan's ``losses/dapo.py``, run from its file (``runpy``, which holds it as a module while its
    dataclasses are made): its own imports are torchtitan.components.loss and torchtitan.config only, while
    its package's ``__init__`` imports vLLM."""
    path = Path(torchtitan.__file__).parent / "experiments" / "rl" / "losses" / "dapo.py"
    return SimpleNamespace(**runpy.run_path(str(path), run_name="_torchtitan_rl_dapo"))


def advantages(rewards: list[float], std_scale: bool) -> list[float]:
    """torchtitan's AdvantageEstimator (experiments/rl/rollout/advantage.py): r - mean, over pstdev + 1e-6 when
    ``std_scale``."""
    mean = sum(rewards) / len(rewards)
    denom = statistics.pstdev(rewards) + 1e-6 if std_scale else 1.0
    return [(r - mean) / denom for r in rewards]


def rows(prompt: list[int], samples: list[Sample], adv: list[float], keep: list[bool], seq_len: int, pad_id: int
         ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Training rows of one group: ``input`` (prompt + completion, shifted), labels, and the loss's inputs."""
    n = len(samples)
    out = {"input": torch.full((n, seq_len), pad_id, dtype=torch.int64),
           GENERATOR_LOGPROBS: torch.zeros(n, seq_len), ADVANTAGES: torch.zeros(n, seq_len),
           LOSS_MASK: torch.zeros(n, seq_len, dtype=torch.bool)}
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    p = len(prompt)
    for i, s in enumerate(samples):
        seq = prompt + s.ids
        if len(seq) - 1 > seq_len:
            raise ValueError(f"prompt ({p}) + completion ({len(s.ids)}) tokens exceed seq_len + 1 ({seq_len + 1})")
        out["input"][i, :len(seq) - 1] = torch.tensor(seq[:-1])
        span = slice(p - 1, len(seq) - 1)  # the positions whose labels are the completion
        labels[i, span] = torch.tensor(s.ids)
        out[GENERATOR_LOGPROBS][i, span] = torch.tensor(s.logprobs)
        out[ADVANTAGES][i, span] = adv[i]
        out[LOSS_MASK][i, span] = keep[i]
    return out, labels


class Rl(Objective):
    name = RL
    inputs = per_token = (GENERATOR_LOGPROBS, ADVANTAGES, LOSS_MASK)
    eval_name = "held-out tasks"
    evaluates = True
    reads_sources = False

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        rl: RlTable = field(default_factory=RlTable)  # the recipe's [rl] as it is
        seed: int = 0  # [run] seed: the prompts' order and every sample's generator

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config)
        r = config.rl
        dapo = dapo_module()
        self.loss = dapo.DAPOLoss(dapo.DAPOLoss.Config(ratio_clip_low=r.clip_low, ratio_clip_high=r.clip_high))
        self._sums = torch.zeros(len(SUMS), dtype=torch.float64)
        self._lengths = torch.zeros(r.max_new_tokens + 1, dtype=torch.float64)
        self.tokenizer: Any = None
        self.train_tasks: list[Task] = []
        self.held_out_tasks: list[Task] = []

    # -- from the recipe -------------------------------------------------------------------------------

    @classmethod
    def config_of(cls, recipe: Recipe, model: Laneformer.Config) -> Config:
        return cls.Config(rl=recipe.rl, seed=recipe.run.seed)

    @classmethod
    def dataloader_of(cls, recipe: Recipe, model: Laneformer.Config) -> TaskDataLoader.Config:
        r = recipe.rl
        assert r.tasks is not None  # an RL run's (Recipe.objective)
        return TaskDataLoader.Config(tasks=r.tasks, held_out=r.held_out, samples_per_prompt=r.samples_per_prompt,
                                     seed=recipe.run.seed)

    @classmethod
    def check(cls, recipe: Recipe, model: Laneformer.Config, tokenizer: Tokenizer) -> list[str]:
        """An RL run's preflight: its [training] shape (``Rl.check``), no context parallelism, no other sources,
        the tasks open and fit seq_len with max_new_tokens, the reward imports."""
        p, r, t = recipe.path, recipe.rl, recipe.training
        out = []
        try:
            r.check(t)
        except TableError as e:
            out.append(f"{p}: [{e.table}] {e}")
        if recipe.parallel.context_parallel > 1:
            out.append(f"{p}: [parallel] context_parallel: not available in an RL run (a sequence's length, the "
                       "grpo loss's |o_i|, would be cut)")
        if recipe.data.sources:
            out.append(f"{p}: [data] sources: an RL run trains on its [rl] tasks only (remove [[data.sources]])")
        if why := check_reward(r.reward):
            out.append(f"{p}: [rl] reward: {why}")
        try:
            train, held_out = split(read_tasks(r.tasks or "", tokenizer), r.held_out)
        except (TaskError, OSError) as e:
            return out + [f"{p}: [rl] tasks: {e}"]
        longest = max(len(task.ids) for task in train + held_out)
        if longest + r.max_new_tokens - 1 > t.seq_len:
            out.append(f"{p}: [training] seq_len: {t.seq_len} < the longest prompt ({longest} tokens) + [rl] "
                       f"max_new_tokens ({r.max_new_tokens}) - 1")
        if not train or not held_out:
            out.append(f"{p}: [rl] held_out: {r.held_out} leaves {len(train)} training and {len(held_out)} held-out "
                       "tasks: both need one")
        return out

    # -- before step 1 ----------------------------------------------------------------------------------

    def prepare(self, trainer: TrainerParts) -> None:
        loader = trainer.dataloader
        self.train_tasks, self.held_out_tasks = loader.train, loader.held_out
        self.tokenizer = trainer.tokenizer.tokenizer
        self._sums = self._sums.to(trainer.device)
        self._lengths = self._lengths.to(trainer.device)

    # -- rollouts ----------------------------------------------------------------------------------------

    def _decoder(self, trainer: TrainerParts) -> LaneDecoder:
        """The KV-cache decoder on the policy's current weights (gathered whole on every rank under FSDP2:
        fine at tiny scale; every rank must call it)."""
        model = trainer.model_parts[0]
        config: Laneformer.Config = model.config  # type: ignore[assignment]
        names = expected_shapes(config)
        weights = {}
        for key, value in model.state_dict().items():
            name = key.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            if name in names:
                weights[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        return LaneDecoder(config, weights, range(config.n_lanes), trainer.device)

    def _stop(self, prompt: list[int]) -> Callable[[list[int]], bool]:
        return lambda ids: any(s in continuation_text(self.tokenizer, prompt, ids) for s in STOPS)

    def _sample(self, decoder: LaneDecoder, task: Task, seeds: list[int], temperature: float) -> list[Sample]:
        r = self.config.rl
        generators = [torch.Generator(device=decoder.device).manual_seed(s) for s in seeds]
        return sample(decoder, list(task.ids), generators, r.max_new_tokens, self.tokenizer.eos_id, temperature,
                      r.top_k, r.top_p, stop=self._stop(list(task.ids)))

    def _rewards(self, tasks: list[Task], samples: list[Sample]):
        r = self.config.rl
        jobs = [(t.prompt, continuation_text(self.tokenizer, list(t.ids), s.ids),
                 {"id": t.id, "prompt": t.prompt, "tests": list(t.tests)}) for t, s in zip(tasks, samples)]
        return score_all(r.reward, jobs, r.reward_timeout_s, r.reward_memory_mb)

    def make_batches(self, trainer: TrainerParts, batches: list) -> list:
        """Each micro batch's prompts become its G x k training rows (the module's docstring)."""
        r, G = self.config.rl, self.config.rl.samples_per_prompt
        seq_len = trainer.config.training.seq_len
        start = time.perf_counter()
        decoder = self._decoder(trainer)
        groups = []
        for input_dict, _ in batches:
            for index in input_dict[PROMPT_INDEX].tolist():
                task = self.train_tasks[index]
                seeds = [sample_seed(self.config.seed, trainer.step, task.id, s) for s in range(G)]
                groups.append((task, self._sample(decoder, task, seeds, r.temperature)))
        sampling_s = time.perf_counter() - start
        scored = self._rewards([t for t, ss in groups for _ in ss], [s for _, ss in groups for s in ss])
        out, sums = [], dict.fromkeys(SUMS, 0.0)
        sums["sampling_s"] = sampling_s
        per_batch = len(groups) // len(batches)
        for b in range(len(batches)):
            parts = []
            for g, (task, ss) in enumerate(groups[b * per_batch:(b + 1) * per_batch], b * per_batch):
                rewards = [s.reward for s in scored[g * G:(g + 1) * G]]
                sums["failures"] += sum(s.failure in FAILURES for s in scored[g * G:(g + 1) * G])
                zero_std = max(rewards) == min(rewards)
                keep = [not zero_std and not (r.truncated == "mask" and s.truncated) for s in ss]
                parts.append(rows(list(task.ids), ss, advantages(rewards, r.std_scale), keep, seq_len,
                                  self.tokenizer.eos_id))
                sums["reward"] += sum(rewards)
                sums["reward_sq"] += sum(x * x for x in rewards)
                sums["samples"] += G
                sums["groups"] += 1
                sums["zero_std_groups"] += zero_std
                sums["group_std"] += statistics.stdev(rewards)  # TRL's reward_std: the groups' (sample) stds
                sums["length"] += sum(len(s.ids) for s in ss)
                sums["truncated"] += sum(s.truncated for s in ss)
                sums["sampled_tokens"] += sum(len(s.ids) for s in ss)
                for s in ss:
                    self._lengths[len(s.ids)] += 1
            inputs = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
            out.append((inputs, torch.cat([p[1] for p in parts])))
        self._sums += torch.tensor([sums[k] for k in SUMS], dtype=torch.float64, device=self._sums.device)
        return out

    # -- one micro batch ---------------------------------------------------------------------------------

    def weight(self, batch: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """dapo: the micro batch's loss tokens (DAPOLoss's own rule: masked, finite generator log-prob);
        dr_grpo: its sequences in the loss x max_new_tokens; grpo: its sequences in the loss."""
        mask = batch[LOSS_MASK] & torch.isfinite(batch[GENERATOR_LOGPROBS])
        if self.config.rl.loss == "dapo":
            return mask.sum()
        sequences = mask.any(dim=1).sum()
        return sequences * self.config.rl.max_new_tokens if self.config.rl.loss == "dr_grpo" else sequences

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask, adv, old = inputs[LOSS_MASK].bool(), inputs[ADVANTAGES], inputs[GENERATOR_LOGPROBS]
        if self.config.rl.loss == "grpo":  # each sequence's token mean: A_i / |o_i| (the module's docstring)
            adv = adv / mask.sum(dim=1, keepdim=True).clamp(min=1)
        loss, _ = self.loss(pred, labels, global_valid_tokens, generator_logprobs=old, advantages=adv, loss_mask=mask)
        with torch.no_grad():  # TRL's clip_ratio/low_mean and high_mean, and the entropy, over the loss's tokens
            logprobs, entropy = compute_logprobs(pred.detach(), labels, return_entropy=True)
            ratio, r = torch.exp(logprobs - old), self.config.rl
            low = (ratio < 1 - r.clip_low) & (adv < 0) & mask
            high = (ratio > 1 + r.clip_high) & (adv > 0) & mask
            add = {"tokens": mask.sum(), "clip_low": low.sum(), "clip_high": high.sum(),
                   "entropy": (entropy * mask).sum()}
            for k, v in add.items():
                self._sums[SUMS.index(k)] += v.double()
        return loss, {}

    # -- the step's metrics, and the held-out tasks ------------------------------------------------------

    def step_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict[str, float]:
        out: dict[str, float] = {}
        if reduce is not None:
            both = reduce(torch.cat([self._sums, self._lengths])).tolist()
            s, lengths = dict(zip(SUMS, both[:len(SUMS)])), both[len(SUMS):]
            n, tokens = max(s["samples"], 1), max(s["tokens"], 1)
            mean = s["reward"] / n
            out = {"reward": mean, "reward_std": s["group_std"] / max(s["groups"], 1),
                   "frac_reward_zero_std": s["zero_std_groups"] / max(s["groups"], 1),
                   "completions/mean_length": s["length"] / n,
                   "completions/max_length": float(max(i for i, c in enumerate(lengths) if c) if any(lengths) else 0),
                   "completions/clipped_ratio": s["truncated"] / n,
                   "clip_ratio/low_mean": s["clip_low"] / tokens, "clip_ratio/high_mean": s["clip_high"] / tokens,
                   "entropy": s["entropy"] / tokens, "rl/reward_failures": s["failures"],
                   "rl/sampling_s": s["sampling_s"],
                   "rl/sampling_tokens_per_s": s["sampled_tokens"] / max(s["sampling_s"], 1e-9)}
        self._sums.zero_()
        self._lengths.zero_()
        return out

    def evaluate(self, trainer: TrainerParts) -> dict[str, float]:
        """Greedy held-out pass@1: each rank its share of the held-out tasks (every rank gathers the weights)."""
        from evalplus.eval import estimate_pass_at_k

        decoder = self._decoder(trainer)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = self.held_out_tasks[rank::world]
        answers = [self._sample(decoder, task, [0], 0.0)[0] for task in mine]
        r = self.config.rl
        scored = score_all("pass_fail", [(t.prompt, continuation_text(self.tokenizer, list(t.ids), a.ids),
                                          {"id": t.id, "prompt": t.prompt, "tests": list(t.tests)})
                                         for t, a in zip(mine, answers)], r.reward_timeout_s, r.reward_memory_mb)
        passed = torch.zeros(len(self.held_out_tasks), dtype=torch.int64, device=trainer.device)
        for i, s in zip(range(rank, len(self.held_out_tasks), world), scored):
            passed[i] = int(s.reward == 1.0)
        if world > 1:
            dist.all_reduce(passed)
        values = passed.cpu().numpy()
        return {EVAL_PASS_AT_1: float(estimate_pass_at_k([1] * len(values), values, 1).mean())}
