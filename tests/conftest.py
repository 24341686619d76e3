"""Every test runs offline: no Hugging Face Hub, no wandb server.

What tests in several folders share: running train.py for real (recipes in a temp dir, torchrun,
metrics.jsonl), the launcher's reference run (the session fixture ``reference``), a random tiny model
and a run dir holding one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.shards import write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, Tokenizer
from launch.attempts import history
from rundir import REPO

# One intra-op thread in the test processes, as in the ranks and commands they start (env() below): make test
# runs two pytest-xdist workers on two cores, and torch's default, a thread per core, has each worker's
# in-process ops contend with the other worker for both.
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# --- compiled kernels: one Inductor cache for the session's processes ---

INDUCTOR_CACHE: dict[str, str] = {}  # {"TORCHINDUCTOR_CACHE_DIR": the session's}, set by pytest_configure


def pytest_configure(config):
    """The session's Inductor cache (FX graphs, AOTAutograd, kernels), which the pytest-xdist workers inherit from
    this process and every process a test starts from env() below: the same graph compiled by two of them (the
    CP ranks of tests/models/test_context_parallel.py and of bench.gpu_check's CPU check, tests/bench) is
    compiled once. A fresh folder, removed at the end, so a session is not sped up or upset by what another
    session or torch version left in Inductor's per-host default (/tmp/torchinductor_$USER), unless the
    environment names one. train.py keeps its own, [run] compile_cache."""
    if not hasattr(config, "workerinput") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.made_inductor_cache = tempfile.mkdtemp(
            prefix="laneformer-test-inductor-")
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        INDUCTOR_CACHE["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]


def pytest_unconfigure(config):
    if made := getattr(config, "made_inductor_cache", None):
        import shutil

        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(autouse=True)
def session_inductor_cache(monkeypatch):
    """Each test starts with the session's cache: a trainer built in process (LaneformerTrainer) points
    TORCHINDUCTOR_CACHE_DIR at its run's compile_cache, in a temp dir of that test's."""
    for name, value in INDUCTOR_CACHE.items():
        monkeypatch.setenv(name, value)


# --- running train.py for real (tests/train, tests/e2e, tests/launch, tests/bench) ---

TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short(tmp_path, steps=12, *extra):
    """--set values for a short tiny run in ``tmp_path/run``."""
    return (f"run.output_dir={tmp_path / 'run'}", f"training.steps={steps}", "logging.interval=1",
            "training.seq_len=64", "training.global_batch=8", "training.micro_batch=4",
            "schedule.warmup_steps=2", *extra)


def train_command(recipe: str, *sets: str, nproc: int = 1) -> list[str]:
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "train.py"), "--recipe", recipe]
    if not any(s.startswith("logging.report=") for s in sets):
        sets = (*sets, "logging.report=false")  # drawing the report costs each run seconds; tests/train/test_report.py draws
    if not any(s.startswith("logging.wandb_mode=") for s in sets):
        # an offline wandb run starts a service per rank, ~1 s a launch; tests/train/test_train.py's short_run checks it
        sets = (*sets, 'logging.wandb_mode="disabled"')
    for s in sets:
        cmd += ["--set", s]
    return cmd


POISON = """
import os, sys
sys.path.insert(0, {repo!r})
from train.objectives import OBJECTIVES
calls = {{"n": 0}}
def poison(forward):
    def poisoned(self, pred, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] in {calls!r} and int(os.environ.get("RANK", "0")) in {ranks!r}:
            pred = pred * float("nan")
        return forward(self, pred, *args, **kwargs)
    return poisoned
for objective in OBJECTIVES.values():  # whichever the run's is
    objective.__call__ = poison(objective.__call__)
sys.argv[0] = "train.py"
import runpy
runpy.run_path("train.py", run_name="__main__")
"""


def poisoned_command(folder: Path, recipe: str, *sets: str, calls: set[int], ranks: set[int] = frozenset({0}),
                     nproc: int = 1) -> list[str]:
    """``train_command`` with planted spikes: the loss of the ``calls``-th micro batches (counted from 1 on each
    rank, e.g. ``accumulation x (step - 1) + 1``: the first micro batch of ``step``) goes NaN on ``ranks``.
    The script that plants them is written to ``folder``."""
    script = Path(folder) / "poisoned_train.py"
    script.write_text(POISON.format(repo=str(REPO), calls=set(calls), ranks=set(ranks)))
    cmd = train_command(recipe, *sets, nproc=nproc)
    cmd[cmd.index(str(REPO / "train.py"))] = str(script)
    return cmd


def env() -> dict:
    return {**os.environ, **INDUCTOR_CACHE, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}


def train(recipe: str, *sets: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """``train.py`` on ``nproc`` ranks. One rank runs as ``python train.py``, without the torchrun agent
    (~1.5 s a launch here): train.py then gives itself torchrun's one-rank environment, and the exit code
    is train.py's own rather than torchrun's 1."""
    cmd = train_command(recipe, *sets, nproc=nproc)
    if nproc == 1:
        cmd = [sys.executable, *cmd[cmd.index(str(REPO / "train.py")):]]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


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


# --- launcher runs (tests/launch; the session fixture reference below, also for tests/train/test_report.py) ---

STEPS = 20
# Shortened tiny.toml; deterministic so resumed and uninterrupted runs agree exactly.
SHORT = (f"training.steps={STEPS}", "training.seq_len=64", "training.global_batch=8", "training.micro_batch=4",
         "schedule.warmup_steps=2", "logging.interval=1", "run.deterministic=true", "checkpoint.interval=4")


def local_command(run: Path, nproc: int = 2, report: bool = False) -> list[str]:
    """launch.local on ``nproc`` ranks. Its straggler bar is 1.5x the other ranks' median: two balanced
    ranks on two cores shared with a second suite differ by 20% now and then (the bar a 2-rank run had
    when the median held the rank judged); a test that makes a straggler sets its own. The run draws
    its report (a process at each end of a launch) only for a test that reads it."""
    return [sys.executable, "-m", "launch.local", "--recipe", "tiny.toml", "--nproc", str(nproc),
            *(f"--set={s}" for s in (f"run.output_dir={run}", *SHORT, "launch.straggler_threshold=0.5",
                                     f"logging.report={str(report).lower()}"))]


def reference_run(tmp_path_factory) -> Path:
    """The run dir of the reference run below, in the temp dir every pytest-xdist worker of the
    session shares (``make test`` runs two)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "launch-reference"


def reference_losses(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted 2-rank run; made once per session, by the first worker that
    needs it while the others wait on its lock."""
    from filelock import FileLock

    run = reference_run(tmp_path_factory)
    with FileLock(f"{run}.lock"):
        if not history(run) or history(run)[-1].get("action") != "done":
            result = subprocess.run(local_command(run, report=True), cwd=REPO, env=env(), capture_output=True, text=True,
                                    timeout=600)  # ~100 s under a second suite
            assert result.returncode == 0, result.stderr[-3000:]
    return losses(run)


def checkpoint_tensors(step_dir: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor of a DCP checkpoint (model, optimizer moments, ...) by its dotted name, read back
    through DCP's own ``dcp_to_torch_save`` (a .pt written beside the run dir, not inside it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = Path(step_dir).parent.parent
    out = run.parent / f"{run.name}-{Path(step_dir).name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix.rstrip(".")] = value

    walk("", torch.load(out, weights_only=False))
    return flat


# --- a random tiny model (tests/train, tests/data, tests/eval, tests/e2e) ---

def tiny_random_model(seed: int = 0):
    from models.laneformer import model_registry
    from models.laneformer.model import Laneformer

    config = model_registry("tiny", attn_backend="dense").model
    torch.manual_seed(seed)
    model = Laneformer(config)
    model.init_states()
    return model.eval()


# --- training runs (tests/train, tests/e2e) ---


def assert_overfits(tmp_path, nproc, compile, ac):
    """25 steps of tiny on one repeated batch take the loss below 30% of step 1's."""
    source = repeated_batch_source(tmp_path / "one", tokens=8 * 64)
    result = train("tiny.toml", *short(tmp_path, 25, f"parallel.compile={str(compile).lower()}",
                                       f'parallel.activation_checkpoint="{ac}"',
                                       f'data.sources=[{{name = "one", path = "{source}", weight = 1.0, max_epochs = 1000, '
                                       f'held_out = 0}}]',  # one batch, nothing to hold out
                                       "schedule.warmup_steps=2", "training.skip_spikes=false"), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    values = losses(tmp_path / "run")
    assert values[25] < 0.3 * values[1], values


# --- a checkpoint's own tokenizer (tests/eval/test_eval_run_cli.py, tests/models/test_generate.py) ---


def other_tokenizer(folder: Path) -> Path:
    """A SentencePiece model with the tiny one's size that is not it: pieces 300 ("an") and 301 ("ce")
    swap ids, so text with them encodes differently. Written as ``folder/tokenizer.model``."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(TINY_TOKENIZER.read_bytes())
    a, b = proto.pieces[300], proto.pieces[301]
    a.piece, b.piece = b.piece, a.piece
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(proto.SerializeToString())
    return folder / "tokenizer.model"


def write_tiny_run(run: Path, tokenizer: str | Path | None) -> Path:
    """A run dir as training leaves it (a random tiny model at checkpoints/step-1, laneformer_config.json,
    recipe.toml naming ``tokenizer`` in [data], no sources; None: no recipe.toml). Returns the step dir."""
    from models.laneformer import write_native_config
    from models.laneformer.hf.checkpoint_io import save_dcp

    model = tiny_random_model(seed=3)
    step = run / "checkpoints" / "step-1"
    save_dcp({k: v.detach().clone() for k, v in model.state_dict().items()}, step)
    write_native_config(model.config, run)
    if tokenizer is not None:
        (run / "recipe.toml").write_text(f'[data]\ntokenizer = "{tokenizer}"\n')
    return step


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of one uninterrupted, deterministic 2-rank tiny run (SHORT above), made
    once per session: the launcher, SLURM and kill-and-resume tests all compare against it."""
    return reference_losses(tmp_path_factory)
