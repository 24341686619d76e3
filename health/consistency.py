"""Replica consistency: under HSDP the copies of each shard are compared bit for bit.

Why: a GPU can compute a wrong result without raising anything (Meta's Llama 3 report counts silent
data corruption among the interruptions of its 16k-GPU run). A corrupted optimizer update changes
that rank's shard of the weights; FSDP then all-gathers it into every rank's forward, and once
checkpointed every restart resumes from it. With ``[parallel] replicate`` > 1 (HSDP) every shard of
the parameters and of the optimizer state is held by ``replicate`` ranks that apply the same
all-reduced gradient, so their bits must be identical after every step: free evidence.

The check (``ReplicaVerifier.run``), every ``[training] consistency_every`` steps and always before a
checkpoint is saved (the ``train.callbacks.replica_check`` callback calls it at both points), after
the step's optimizer update:

- each rank sums the 32-bit words of its local shards (parameters; optimizer moments and step
  counts) into two int64 checksums, parameters and optimizer state, exactly: one flipped bit
  changes a word by +-2^k and so the sum;
- the ranks all-gather them, 16 bytes a rank, in one collective. Over all ranks, not only the
  replica group, so that every rank takes the same decision at the same step: a rank that went on
  would enter the checkpoint save its stopped peers never join, or be stopped by torchrun and
  checkpoint as if preempted;
- each replica group (the ranks holding one shard) votes: a value held by more than half of it is
  right, the ranks that differ from it are named; with no majority (2 replicas) every holder of a
  differing shard is named.

Nothing happens on other steps: no host sync. On a mismatch every rank raises ``ReplicaMismatch``
(exit code ``Exit.REPLICA_MISMATCH``): the exit note and ``<run>/alerts.jsonl`` name the step, the
ranks and their hosts, and nothing is saved. A checkpoint saved after a passing check records it
(``step-N/replicas_verified.json``), and a run with replicas resumes from the latest verified one.
The tests make a mismatch with ``train.callbacks.bitflip``.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Iterable

import torch

from rundir import VERIFIED_FILE
from health.exits import Exit, StopRun
from health.alerts import write_alert

WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatch(StopRun):
    code = Exit.REPLICA_MISMATCH


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' words (their own width), as int64 on their device: bit-exact."""
    total = None
    for t in tensors:
        t = local(t).detach()
        if t.numel() == 0:
            continue
        s = t.contiguous().view(WORDS[t.element_size()]).sum(dtype=torch.int64)
        total = s if total is None else total + s
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def vote(values: list[tuple[int, ...]]) -> list[int]:
    """Positions in ``values`` (one replica group's checksums) that are wrong: those differing from a
    strict majority's value, or, without a majority, every position when they are not all equal."""
    if len(set(values)) <= 1:
        return []
    top = max(set(values), key=values.count)
    if values.count(top) * 2 > len(values):
        return [i for i, v in enumerate(values) if v != top]
    return list(range(len(values)))


class ReplicaVerifier:
    """The check of one rank: which ranks form each replica group, and the hosts of all ranks."""

    def __init__(self, mesh: torch.Tensor, run_dir: Path, every: int):
        """``mesh``: the global ranks as ``[replicate, shard]`` (HSDP's ``(dp_replicate, fsdp)`` mesh)."""
        import torch.distributed as dist

        self.groups = mesh.reshape(mesh.shape[0], -1).t().tolist()  # per shard: its ranks, replica by replica
        self.run_dir, self.every = Path(run_dir), every
        self.hosts: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.verified_step = -1  # the latest step whose check passed

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def run(self, step: int, model_parts, optimizers) -> None:
        """Compare every replica group's checksums (one all-gather); raise ReplicaMismatch on a difference."""
        import torch.distributed as dist

        if self.verified_step == step:
            return
        params = [p for m in model_parts for p in m.parameters()]
        state = [v for opt in optimizers.optimizers for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        device = params[0].device if params else torch.device("cpu")
        mine = torch.stack([checksum(params).to(device), checksum(state).to(device)])
        every = torch.empty(dist.get_world_size() * 2, dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(every, mine)
        sums = [tuple(row) for row in every.view(-1, 2).tolist()]  # the one host sync of a check step
        odd = sorted(group[i] for group in self.groups for i in vote([sums[r] for r in group]))
        if not odd:
            self.verified_step = step
            return
        self._stop(step, odd, sums)

    def _stop(self, step: int, odd: list[int], sums: list[tuple[int, int]]) -> None:
        import torch.distributed as dist

        where = [f"rank {r} on {self.hosts[r]}" for r in odd]
        shards = [i for i, group in enumerate(self.groups) if any(r in group for r in odd)]
        what = sorted({("parameters", "optimizer state")[k] for g in shards for k in range(2)
                       if len({sums[r][k] for r in self.groups[g]}) > 1})
        # vote() names every holder of a shard whose copies have no strict majority
        majority = all(sum(r in odd for r in self.groups[g]) < len(self.groups[g]) for g in shards)
        who = "the odd one" if majority else f"no majority among {len(self.groups[shards[0]])} replicas, the holders"
        text = (f"replica mismatch after step {step}: the copies of shard {', '.join(map(str, shards))} differ in "
                f"{' and '.join(what)}; {who}: {'; '.join(where)}. Nothing was saved; restart from the latest "
                "verified checkpoint without that node.")
        details: dict[str, Any] = {"step": step, "ranks": odd, "hosts": sorted({self.hosts[r] for r in odd}), "shards": shards,
                   "majority": majority, "differs_in": what}
        if dist.get_rank() == 0:
            write_alert(self.run_dir, "replica_mismatch", text=text, **details)
        raise ReplicaMismatch(text, message=text, **details)

    def mark_verified(self, step_dir: Path, step: int) -> None:
        """After a save whose check passed: the checkpoint records it (rank 0 writes)."""
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / VERIFIED_FILE).write_text(json.dumps({"step": step, "replicas": len(self.groups[0]),
                                                          "shards": len(self.groups)}) + "\n")


def is_verified(step_dir: Path) -> bool:
    return (Path(step_dir) / VERIFIED_FILE).is_file()

