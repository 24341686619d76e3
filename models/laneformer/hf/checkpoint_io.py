"""Native Laneformer weights in torchtitan DCP checkpoints, checked against a config.

A run's ``checkpoints/step-<N>/`` folders are torchtitan DCP checkpoints
(model FQNs at the top level, beside optimizer and dataloader state); which
step a path stands for is ``models.laneformer.checkpoint``'s answer. Only
the model tensors are read, in the dtype they were saved in, and only
single-process DCP is used, so no process group is needed.
"""

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..model import Laneformer


def expected_shapes(config: Laneformer.Config) -> dict[str, torch.Size]:
    """Native tensor names and shapes of a model with this config (built on meta: no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Laneformer(config).state_dict().items()}


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Size], where: dict[str, str]) -> None:
    """Raise ValueError listing missing and unexpected tensors and every shape mismatch.

    ``where`` maps a found tensor to the file it came from, for the message.
    """
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(f"{k!r} ({where.get(k, '?')})" for k in unexpected))
    for k in sorted(set(expected) & set(found)):
        if tuple(found[k]) != tuple(expected[k]):
            problems.append(
                f"tensor {k!r} in {where.get(k, '?')} has shape {list(found[k])}, the config implies {list(expected[k])}"
            )
    if problems:
        raise ValueError("the config does not match the weights:\n  " + "\n  ".join(problems))


def load_dcp(folder: Path, config: Laneformer.Config) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, in their saved dtypes, after checking names and shapes."""
    saved = {
        k: v for k, v in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    expected = expected_shapes(config)
    # Tensors under the model's top-level modules; optimizer state sits under "optimizer.".
    roots = {k.split(".")[0] for k in expected}
    found = {k: v.size for k, v in saved.items() if k.split(".")[0] in roots}
    check_shapes(expected, found, dict.fromkeys(found, str(folder)))
    state_dict = {k: torch.empty(expected[k], dtype=saved[k].properties.dtype) for k in expected}
    with _single_process():
        dcp.load(state_dict, checkpoint_id=str(folder), no_dist=True)  # alone, even under a process group
    return state_dict


def save_dcp(state_dict: dict[str, torch.Tensor], folder: Path) -> None:
    with _single_process():
        dcp.save({k: v.contiguous() for k, v in state_dict.items()}, checkpoint_id=str(folder))


@contextlib.contextmanager
def _single_process():
    """Silence DCP's warning that it runs without a process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
