"""The reference log-probs: those of the ``init_from`` weights on every pair, computed once.

As open-instruct's ``build_reference_logprobs_cache`` (``open_instruct/dpo_utils.py``) does, and
unlike torchtune's ``full_dpo_distributed`` (a second, frozen, FSDP-sharded model kept in memory):
before step 1 the policy IS the reference, so the trainer runs it once over every pair, forward
only, on the same ranks and the same micro batch shape as training (each rank a share, merged
across ranks), writes the result in the run dir and keeps only the numbers. TRL's
``precompute_ref_log_probs`` is the same idea.

The file is named by a key of everything the numbers depend on: the init checkpoint (its path and
its files' names, sizes and modification times), the pair sources' manifests (which hold every
shard's checksum), the loss type (summed or averaged log-probs), ``seq_len`` and the chat template.
``beta`` is not in it: changing beta reuses the numbers. A restart with the same key reuses the file
and says so; another key computes again, which needs the policy to still be the reference (step 0).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rundir import REFERENCE_LOGPS_DIR
from data.shards import MANIFEST
from train.preference.loss import sequence_logps
from train.preference.pairs import PairSet


class ReferenceError(RuntimeError):
    """The reference log-probs cannot be had (missing at a resumed step, or missing a pair)."""


def checkpoint_identity(folder: str | Path) -> dict:
    """What says an init checkpoint changed: its resolved path and its files' names, sizes and mtimes."""
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {"path": str(folder),
            "files": [[str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def cache_key(init_checkpoint: str, sources: list[str], loss: str, seq_len: int, template_sha256: str) -> str:
    """The key the reference log-probs of ``sources`` are filed under (see the module docstring)."""
    parts = {"init": checkpoint_identity(init_checkpoint),
             "manifests": [hashlib.sha256((Path(s) / MANIFEST).read_bytes()).hexdigest() for s in sources],
             "loss": loss, "seq_len": seq_len, "template_sha256": template_sha256}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cache_file(run_dir: str | Path, role: str, key: str) -> Path:
    """Where the reference log-probs of ``role``'s pairs (``train`` or ``heldout``) are kept."""
    return Path(run_dir) / REFERENCE_LOGPS_DIR / f"{role}-{key}.npy"


def save(path: Path, logps: np.ndarray) -> None:
    """Write atomically: a killed save leaves no half file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.save(buffer, logps)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)


def load(path: Path, pairs: PairSet) -> np.ndarray:
    """The cached [pairs, 2] (chosen, rejected) log-probs; a pair without a finite value is an error
    naming it."""
    logps = np.load(path)
    if logps.ndim != 2 or logps.shape[1] != 2:
        raise ReferenceError(f"{path}: shape {logps.shape}, expected [pairs, 2]")
    missing = [p for p in range(len(pairs)) if p >= len(logps) or not np.isfinite(logps[p]).all()]
    if missing:
        raise ReferenceError(f"{path}: no reference log-probs for {len(missing)} pair(s), first "
                             f"{pairs.describe(missing[0])}")
    return logps


def pair_logps(model: torch.nn.Module, pairs: PairSet, local_pairs: int, average: bool, device: torch.device,
               beat: Callable[[], None] = lambda: None) -> np.ndarray:
    """[pairs, 2] (chosen, rejected) log-probs of ``model`` on every pair (no backward): rank r of W
    takes pairs ``c * k * W + r * k + j`` of chunk c (k = ``local_pairs``, the training micro batch's),
    every rank the same number of forwards (the last chunk padded with pair 0, dropped), then the
    ranks' results are gathered. ``beat`` is called before each forward (the heartbeat)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    n, k = len(pairs), local_pairs
    chunks = math.ceil(n / (k * world))
    mine = torch.zeros(chunks * k, 2, dtype=torch.float32, device=device)
    # With autograd on, as training's forward: the same (compiled) graph gives the numbers step 1 gets,
    # and under no_grad Dynamo cannot trace the model's autograd.Function (save_for_backward on a
    # FakeTensor). Nothing is kept: each chunk's graph goes with its logits.
    for c in range(chunks):
        ids = np.arange(c * k * world + rank * k, c * k * world + (rank + 1) * k)
        batch = pairs.rows(np.where(ids < n, ids, 0))
        beat()
        logits = model(torch.from_numpy(batch["input_ids"]).to(device),
                       positions=torch.from_numpy(batch["positions"]).to(device))
        logps = sequence_logps(logits, torch.from_numpy(batch["labels"]).to(device), average).detach()
        del logits
        mine[c * k:(c + 1) * k] = torch.stack([logps[:k], logps[k:]], dim=1)
    if world > 1:
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
    else:
        gathered = [mine]
    # global order: chunk, then rank, then position in the rank's share
    merged = torch.stack([g.view(chunks, k, 2) for g in gathered], dim=1).reshape(-1, 2)[:n]
    return merged.cpu().numpy()
