"""The reference log-probs: those of the ``init_from`` weights on every pair, computed once.

As open-instruct's ``build_reference_logprobs_cache`` (``open_instruct/dpo_utils.py``) does, and
unlike torchtune's ``full_dpo_distributed`` (a second, frozen, FSDP-sharded model kept in memory):
before step 1 the policy IS the reference, so the trainer runs it once over every pair, forward
only, on the same ranks and the same micro batch shape as training (each rank a share, merged
across ranks), writes the result in the run dir and keeps only the numbers. TRL's
``precompute_ref_log_probs`` is the same idea.

The file (``<run>/reference_logps/<role>-<key>.npy``) is named by a key of everything the numbers
depend on: the init checkpoint's step and a digest of its files' contents (not its path or times: a
copy is the same checkpoint), the pair sources' manifests (which hold every shard's checksum), the
chat template, the loss type (summed or averaged log-probs), ``seq_len``, and the parameter dtype and
compile setting the forward runs with. ``beta`` is not in it: changing beta reuses the numbers.

Reading a checkpoint of many GB costs minutes, so it is read once, at step 0 (the ranks share its
files), and its step and digest are recorded with what each key holds (``inputs.json`` beside the
files). A resumed run keys by the recorded init: an SFT run dir that gained a newer step since
(``init_from`` names its latest) changes nothing. A key whose file exists is reused, and the run says
so; another is computed at step 0, when the policy still is the reference, and refused at a later
step by an error that names what changed since the record (``[preference] held_out`` added, the dtype
switched, ...).
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

from rundir import REFERENCE_INPUTS_FILE, REFERENCE_LOGPS_DIR, REFERENCE_LOGPS_FILE, VERIFIED_FILE, step_number
from data.shards import MANIFEST
from train.preference.loss import sequence_logps
from data.pairs_loader import PairSet

# The key's inputs a resumed run can change, by the recipe key that changes them (the sources: SOURCES)
WHERE = {"template_sha256": "[data] chat_template", "loss": "[preference] loss", "seq_len": "[training] seq_len",
         "param_dtype": "[parallel] param_dtype (on CPU: float32 unless cpu_fp32 = false)",
         "compile": "[parallel] compile"}
SOURCES = {"train": "[data.sources] (the pair sources)", "held_out": "[preference] held_out"}
OLD_ROLE = "heldout"  # the held-out role's name in run dirs written before laneformer 0.2


class ReferenceError(RuntimeError):
    """The reference log-probs cannot be had (missing at a resumed step, or missing a pair)."""


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_identity(folder: str | Path, beat: Callable[[], None] = lambda: None) -> dict:
    """The init checkpoint as the keys hold it: its step (the ``step-N`` folder's N; None for an HF
    export) and a digest of its files' contents by relative name, with its path for people (not in
    the keys). Rank r of W hashes files r, r + W, ... (DCP writes a file per saving rank) and the
    ranks' digests are gathered; ``beat`` is called before each file. The replica check's note
    (rundir.VERIFIED_FILE) says something of the checkpoint, not in it."""
    folder = Path(folder)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != VERIFIED_FILE)
    digests = {}
    for name in names[rank::world]:
        beat()
        digests[name] = file_sha256(folder / name)
    if world > 1:
        gathered: list[dict[str, str]] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, digests)
        digests = {k: v for g in gathered for k, v in g.items()}
    return {"path": str(folder), "step": step_number(folder),
            "digest": hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()}


def key_inputs(init: dict, sources: list[str], loss: str, seq_len: int, template_sha256: str, param_dtype: str,
               compile: bool) -> dict:
    """What the key of ``sources``' reference log-probs holds (see the module docstring); ``init`` is
    ``checkpoint_identity``'s."""
    return {"init_step": init["step"], "init_digest": init["digest"],
            "manifests": [file_sha256(Path(s) / MANIFEST) for s in sources], "template_sha256": template_sha256,
            "loss": loss, "seq_len": seq_len, "param_dtype": param_dtype, "compile": compile}


def cache_key(inputs: dict) -> str:
    """The key the reference log-probs are filed under: a digest of ``key_inputs``."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def cache_file(run_dir: str | Path, role: str, key: str) -> Path:
    """Where the reference log-probs of ``role``'s pairs (``train`` or ``held_out``) are kept; a run dir's
    from before laneformer 0.2 (``OLD_ROLE``'s file) where only that exists, until the next release."""
    folder = Path(run_dir) / REFERENCE_LOGPS_DIR
    path = folder / REFERENCE_LOGPS_FILE.format(role=role, key=key)
    old = folder / REFERENCE_LOGPS_FILE.format(role=OLD_ROLE, key=key)
    return old if role == "held_out" and old.is_file() and not path.exists() else path


def inputs_file(run_dir: str | Path) -> Path:
    """The record of the init checkpoint and of each role's sources and key inputs, written at step 0."""
    return Path(run_dir) / REFERENCE_LOGPS_DIR / REFERENCE_INPUTS_FILE


def read_inputs(run_dir: str | Path, step: int) -> dict:
    """The record a resumed run keys by (its init checkpoint as it was at step 0)."""
    path = inputs_file(run_dir)
    if not path.is_file():
        raise ReferenceError(f"{path}: missing, and the run is at step {step}: it records the init checkpoint the "
                             "reference log-probs were computed from at step 0. Restore it, or start a new run dir")
    record = json.loads(path.read_text())
    if OLD_ROLE in record:  # a run dir from before laneformer 0.2: read until the next release
        record["held_out"] = record.pop(OLD_ROLE)
    return record


def changes(role: str, recorded: dict | None, sources: list[str], inputs: dict) -> list[str]:
    """What of ``role``'s key differs from the record, each as ``[table] key: then, now``."""
    where = SOURCES[role]
    if recorded is None:
        return [f"{where}: unset at the first launch, {sources} now"]
    out = []
    if recorded["sources"] != sources:
        out.append(f"{where}: {recorded['sources']} at the first launch, {sources} now")
    elif recorded["inputs"]["manifests"] != inputs["manifests"]:
        out.append(f"{where}: the sources' manifests changed since the first launch (the data was tokenized again)")
    return out + [f"{WHERE[k]}: {recorded['inputs'][k]!r} at the first launch, {v!r} now"
                  for k, v in inputs.items() if k in WHERE and recorded["inputs"][k] != v]


def missing_at_resume(run_dir: str | Path, role: str, step: int, record: dict, sources: list[str], inputs: dict
            ) -> ReferenceError:
    """The error for a key without its file at a resumed step: what changed since the record, or that
    the file is gone."""
    found = changes(role, record.get(role), sources, inputs)
    path, record_path = cache_file(run_dir, role, cache_key(inputs)), inputs_file(run_dir)
    why = (f"Changed since the run's first launch (recorded in {record_path}): {'; '.join(found)}. Undo the change, "
           "or start a new run dir" if found else
           f"Nothing its key holds changed since the first launch (recorded in {record_path}): the file was "
           "removed. Restore it, or start a new run dir")
    return ReferenceError(f"{path}: no reference log-probs of the {role} pairs, and the run is at step {step}: the "
                          f"policy is no longer the reference, so they cannot be computed now. {why}")


def write_atomically(path: Path, data: bytes) -> None:
    """A killed write leaves no half file under the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_inputs(run_dir: str | Path, record: dict) -> None:
    write_atomically(inputs_file(run_dir), (json.dumps(record, indent=2) + "\n").encode())


def save(path: Path, logps: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, logps)
    write_atomically(path, buffer.getvalue())


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
