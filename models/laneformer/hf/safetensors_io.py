"""Safetensors weights of an HF folder: sharded writing, checked reading.

Reading checks each file's header against its size before loading, so a
truncated download or copy is refused with the file and the first tensor
whose bytes are missing, instead of a bare deserialisation error. Both
directions show tensors done of total on stderr (``rundir.progress``), a file
at a time: safetensors reads and writes whole files.
"""

import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rundir.progress import progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"1024"`` -> bytes (decimal units, as the Hub uses)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    """Write ``tensors`` as one file, or as shards plus an index when over ``max_shard_bytes``."""
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    names = (
        [SINGLE_FILE] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    mode = _default_file_mode()
    with progress(total=len(tensors), desc="tensors written", unit="tensor") as bar:
        for name, shard in zip(names, shards):
            save_file(shard, folder / name, metadata={"format": "pt"})
            os.chmod(folder / name, mode)  # safetensors creates 0600 files: unreadable to a team
            bar.update(len(shard))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
            "weight_map": {k: name for name, shard in zip(names, shards) for k in shard},
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _default_file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_complete(path: Path) -> list[str]:
    """Raise ValueError naming ``path`` and a tensor if the file is shorter than its header says; return its tensor names."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ValueError(f"{path}: truncated safetensors file (header of {header_len} bytes, file of {size})")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    available = size - 8 - header_len
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][1]):
        end = info["data_offsets"][1]
        if end > available:
            raise ValueError(
                f"{path}: truncated safetensors file: tensor {name!r} needs bytes up to {end} "
                f"of the data section, the file holds {available}"
            )
    return list(header)


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, tensor name -> file name) of an HF folder, single-file or sharded."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    sources = {}
    for name in files:  # every file is checked before any is read
        in_file = check_complete(folder / name)
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if f == name and k not in in_file)
            if absent:
                raise ValueError(f"{folder / name}: tensors listed in {INDEX_FILE} are absent: {absent}")
        sources.update(dict.fromkeys(in_file, name))
    tensors = {}
    with progress(total=len(sources), desc="tensors read", unit="tensor") as bar:
        for name in files:
            loaded = load_file(folder / name)
            tensors.update(loaded)
            bar.update(len(loaded))
    return tensors, sources
