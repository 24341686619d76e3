"""Running train.py for real in tests: recipes in a temp dir, torchrun, metrics.jsonl."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from data.shards import write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, Tokenizer

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(recipe: str, *sets: str, nproc: int = 1) -> list[str]:
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "train.py"), "--recipe", recipe]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def env() -> dict:
    return {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def train(recipe: str, *sets: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(recipe, *sets, nproc=nproc), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> dict[int, dict]:
    """step -> the last metrics logged for it (a resumed run re-logs the replayed steps)."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss_metrics/global_avg_loss"] for s, r in metrics(run_dir).items()
            if "loss_metrics/global_avg_loss" in r}


def repeated_batch_source(directory: Path, tokens: int, seed: int = 0) -> Path:
    """One document of exactly ``tokens`` ids: every step then reads the same batch."""
    tok = Tokenizer()
    rng = np.random.default_rng(seed)
    doc = [tok.bos_id, *rng.integers(3, tok.vocab_size, tokens - 2).tolist(), tok.eos_id]
    directory.mkdir(parents=True)
    write_shard(directory / "00000_unshuffled.ds", [doc])
    write_manifest(directory, {"path": str(TINY_TOKENIZER), "fingerprint": tok.fingerprint,
                               "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                               "eos_id": tok.eos_id}, {"kind": "test"})
    return directory


def wandb_history(run_file: str) -> dict[int, dict]:
    """History rows of an offline ``run-*.wandb`` file, read independently of wandb's
    own service: LevelDB-log framing (7-byte file header, 32 KiB blocks, records with
    crc/length/type headers) around protobuf ``Record`` messages."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, rows = open(run_file, "rb").read(), 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST piece of a record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(items.get("_step"), {}).update(items)
    return rows


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (torchrun's ranks get their own
    sessions, so killing its process group is not enough)."""
    import signal

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
