"""Every command in the README's tables, run as a new user would, at tiny scale where the real one
needs a GPU, the Hub or the 2B's data.

``COMMANDS`` holds, for each command the README's tables show (``readme_commands``), how it runs
here: the same program and flags, with the placeholders filled (a tiny run made by the README's own
train command, the bundled tokenizer and sample data, a toy CORE bundle), and the exit status the
README documents; or, for a command this machine cannot run, why. The test fails when a command
exits otherwise, prints a Python traceback, or when the README and this table disagree (a command
added to the README without a line here, or a line here whose command left the README).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rundir import REPO
from tests.conftest import TORCHRUN, env

README = REPO / "README.md"
# The tables whose command column is checked, and which column holds the commands.
TABLES = {"## One command per job": 1, "## Performance": 2, "## From zero to a phase-1 run on a SLURM cluster": 1}
PROGRAMS = ("python ", "torchrun ", "make ", "tensorboard ", "export ", "... ")


def readme_commands() -> list[str]:
    """The backticked commands of the README tables' command columns, in order, each once."""
    text, found = README.read_text(), []
    for heading, column in TABLES.items():
        section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            if not line.startswith("|") or line.startswith("|---"):
                continue
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            for span in re.findall(r"`([^`]+)`", cells[column] if len(cells) > column else ""):
                if span.startswith(PROGRAMS) and span.replace("\\|", "|") not in found:
                    found.append(span.replace("\\|", "|"))
    return found


@dataclass(frozen=True)
class Here:
    """How a README command runs on this machine: ``command`` with {run}, {tmp}, {bundle} filled."""

    command: str
    rc: int = 0  # the exit status the README documents here (2: bad input, e.g. the 2B's data is not here)
    says: str = ""  # a line the output must hold


TRAIN_TINY = ("python train.py --recipe tiny.toml --set run.output_dir={tmp}/{name} --set training.steps=6 "
              "--set schedule.warmup_steps=2 --set logging.interval=2 --set checkpoint.interval=3 "
              "--set eval.every=0 --set logging.report=false --set logging.wandb_mode='\"disabled\"'")
RUN = "{run}"
HUB = "needs the Hugging Face Hub (not reachable here); tests/train/test_data_commands.py runs it against a local fake hub"
GPU = "needs a GPU; its --cpu-check path runs in tests/bench/test_gpu_check.py"
SAME = "the same program and flags as the first table's row, which runs above"
BENCH = "a benchmark (minutes, a ratio against a baseline measured in the same run); tests/bench/test_bench.py runs each at toy size"

COMMANDS: dict[str, Here | str] = {
    # --- one command per job ---
    "torchrun --nproc-per-node 8 train.py --recipe phase1.toml": Here(TRAIN_TINY.format(tmp="{tmp}", name="main"),
                                                                      says="final loss: "),
    "... --set optimizer.lr=2e-4 --set training.steps=1000":
        Here("python train.py --recipe tiny.toml --set optimizer.lr=2e-4 --set training.steps=1000 --print-config",
             says="steps = 1000"),
    "python train.py --recipe phase1.toml --print-config": Here("python train.py --recipe phase1.toml --print-config",
                                                                says='flavor = "2B"'),
    "python train.py --recipe phase1.toml --dry-run [--gpus 192 --mfu 0.4] [--run DIR]":
        Here("python train.py --recipe phase1.toml --dry-run --gpus 192 --mfu 0.28", rc=2,
             says="expected wall time: 12.9 days on 192 GPUs at 28% MFU"),
    "python train.py --recipe phase1.toml --plan [--gpus 192 --gpu h100|h200|a100|mi300x] [--sweep] [--ops]":
        "the --plot row below runs the same plan of the 2B; tests/train/test_plan.py runs --sweep, --ops and --json",
    "torchrun -m torchtitan.train --module train --config laneformer_tiny":
        "tests/train/test_train.py::test_torchtitans_own_entry_point_runs_the_registered_config runs it (2 steps)",
    "torchrun ... train.py --recipe phase2.toml": "tests/train/test_train.py::test_phase2_starts_from_phase1_weights "
                                                  "runs tiny-phase2 from a tiny run's checkpoint",
    "python -m train.report runs/NAME [runs/OTHER ...] [--out DIR] [--plan-gpu h100 --gpus 192]":
        Here("python -m train.report {run} --out {tmp}/report", says="report.html"),
    "python train.py --recipe phase1.toml --plan --gpus 192 --plot plan.png":
        Here("python train.py --recipe phase1.toml --plan --gpus 192 --plot {tmp}/plan.png",
             says="peak memory per GPU: 58.76 GiB of 79.6 GiB (fits)"),
    "python -m models.laneformer.inspect --flavor 2B": Here("python -m models.laneformer.inspect --flavor 2B",
                                                           says="2,320,069,632"),
    "python -m data.tokenize --input <hub id, dir or glob> --text-key text --tokenizer tokenizer.model --out DIR [--slurm ...]":
        Here("python -m data.tokenize --input {tmp}/corpus.jsonl --text-key text "
             "--tokenizer assets/tokenizer/tokenizer.model --out {tmp}/tok", says="2 documents"),
    "python -m data.tokenizer fetch [--repo ID]": HUB,
    "python -m train.data download --recipe phase1 --source web-high [--slurm --partition P]": HUB,
    "python -m train.data tokenize --recipe phase1 --source web-high [--tasks N --slurm ...]": HUB,
    "python -m data.tokenize --input FILE --chat-key messages --tokenizer T --out DIR":
        Here("python -m data.tokenize --input assets/chat/conversations.jsonl --chat-key messages "
             "--tokenizer assets/tokenizer/tokenizer.model --out {tmp}/chat", says="conversations refused"),
    "python -m train.data verify --recipe phase1": Here("python -m train.data verify --recipe tiny", says="ok "),
    "python -m train.data holdout --recipe phase1 [--source web-high]":
        Here("python -m train.data holdout --recipe tiny", says="held out (holdout 0.1)"),  # split already: unchanged
    "python -m data.holdout DIR --holdout 0.0001":
        Here("python -m data.holdout assets/sample_data/code --holdout 0.1", says="held out (holdout 0.1)"),
    "python -m data.verify DIR...": Here("python -m data.verify assets/sample_data/prose assets/sample_data/code",
                                         says="ok "),
    "python -m data.decontaminate report DIR... --benchmarks humaneval,mbpp[,core] --evalplus-data DIR "
    "[--core-bundle DIR]": Here("python -m data.decontaminate report assets/sample_data/prose --benchmarks core "
                                "--core-bundle {bundle}", says="core: 0 overlapping"),
    "python -m models.laneformer.convert to-hf runs/NAME OUT": Here("python -m models.laneformer.convert to-hf "
                                                                    "{run} {tmp}/hf"),
    "python -m models.laneformer.convert from-hf HF_DIR OUT": Here("python -m models.laneformer.convert from-hf "
                                                                   "{tmp}/hf {tmp}/imported"),
    "python -m models.laneformer.push OUT --repo-id ORG/NAME [--dry-run]":
        Here("python -m models.laneformer.push {tmp}/hf --repo-id org/laneformer-tiny --dry-run", says="config.json"),
    "python -m eval.run --checkpoint runs/NAME --core BUNDLE --max-per-task 100":
        Here("python -m eval.run --checkpoint {run} --core {bundle} --core-tasks copa,winograd --max-per-task 2",
             says="partial CORE"),
    "python -m eval.core_data fetch DIR": "downloads nanochat's eval_bundle.zip (no network here); "
                                          "tests/eval/test_core_data.py converts a local copy",
    "python -m eval.run --checkpoint X --evalplus humaneval,mbpp --evalplus-data DIR [--chat] [--limit N] "
    "[--evalplus-find-zero released]": "runs model code in the sandbox for minutes; tests/eval/test_evalplus.py "
                                      "runs the same scoring on a dataset written for the test",
    "python -m models.laneformer.generate --checkpoint X --prompt TEXT --max-new-tokens N":
        Here("python -m models.laneformer.generate --checkpoint {tmp}/hf --prompt 'def add(a, b):' "
             "--max-new-tokens 4 --no-tp-baseline", says="ids: "),
    "torchrun --nproc-per-node 8 -m models.laneformer.generate --checkpoint HF_DIR --prompt TEXT --max-new-tokens N "
    "--lane-parallel": "8 ranks on 2 cores; tests/e2e/test_lane_parallel_decode.py runs it on 8, 4 and 2 ranks",
    "python -m launch.sweep recipes/sweeps/dtp.toml [--dry-run --gpus 8 --gpu h100] [--parallel K | --slurm "
    "--partition P ...]": "tests/launch/test_sweep.py runs the tiny sweep end to end, the dry run's plan and a "
                          "refused variant; the dtp study needs the phase-1 shards",
    "python -m train.report runs/sweeps/dtp": "tests/launch/test_sweep.py compares the tiny sweep it ran",
    "python -m launch.local --recipe tiny.toml --nproc 2 [--set ...]": "tests/launch/test_launch_local.py runs it "
        "(2 ranks; a preemption, a crash and a stalled rank, each resumed with the same losses)",
    "python -m bench.gpu_check": Here("python -m bench.gpu_check --out {tmp}/gpu_check.json", rc=1,
                                      says="no CUDA GPU found, so nothing was checked"),
    # --- benchmarks ---
    "python -m bench.lanes_vs_dense --flavors 100M --modes compiled --steps 15": BENCH,
    "python -m bench.compile": BENCH,
    "python -m bench.checkpoint": BENCH,
    "python -m bench.dataloader": BENCH,
    "python -m bench.step_overhead": BENCH,
    "python -m bench.compile_cache": "a benchmark (three compiled launches, minutes); its figures are in bench/README.md",
    # --- from zero to a phase-1 run ---
    "make setup": "this suite runs in the environment it makes (CI runs make test on a clean clone)",
    "make test": "this suite itself (CI runs it on a clean clone)",
    "python -m data.tokenizer fetch": HUB,
    "export LANEFORMER_DATA_ROOT=/lustre/you/laneformer": "sets a variable; "
        "tests/train/test_data_commands.py::test_the_data_root_moves_every_source_path_and_set_beats_the_environment",
    "python train.py --recipe phase1 --dry-run": "the table's phase-1 dry run above, without its optional flags",
    "python -m train.data download --recipe phase1 --source web-high [--slurm --partition cpu]": HUB,
    "python -m train.data tokenize --recipe phase1 --source web-high --tasks 512 --slurm --partition cpu "
    "--time 24:00:00 --sbatch-arg signal=USR1@120": HUB,
    "python train.py --recipe phase1 --plan --gpu h100": "traces the 2B on 192 fake ranks (~1 min); "
        "tests/train/test_plan.py runs it and checks its figures",
    "python -m launch.slurm submit --recipe phase1 --nodes 24 --gpus-per-node 8 --partition gpu --account ACCOUNT "
    "--time 48:00:00 --nccl-socket-ifname ib0 --dry-run":
        Here("python -m launch.slurm submit --recipe phase1 --nodes 24 --gpus-per-node 8 --partition gpu "
             "--account ACCOUNT --time 48:00:00 --nccl-socket-ifname ib0 --dry-run --no-plan", rc=2,
             says="#SBATCH --nodes=24"),
    "python -m launch.slurm status runs/laneformer-2b-phase1": Here("python -m launch.slurm status {run}",
                                                                   says="latest checkpoint: step 6 of 6"),
    "python -m launch.slurm logs runs/laneformer-2b-phase1 -f": "follows a SLURM job's logs; "
        "tests/launch/test_launch_slurm.py reads them on the emulated cluster",
    "tensorboard --logdir runs/laneformer-2b-phase1": "a server; tests/train/test_train.py reads the run's event files",
    "python -m launch.slurm submit --recipe phase2 --nodes 24 --gpus-per-node 8 ...": "a SLURM submission; "
        "tests/launch/test_launch_slurm.py submits on the emulated cluster",
    "python -m models.laneformer.convert to-hf runs/laneformer-2b-phase2 exports/laneformer-2b": SAME,
    "python -m eval.core_data fetch core_bundle": "downloads nanochat's eval_bundle.zip (no network here)",
    "python -m eval.run --checkpoint exports/laneformer-2b --core core_bundle": SAME,
    "python -m models.laneformer.push exports/laneformer-2b --repo-id ORG/laneformer-2b": SAME,
}


def test_every_readme_command_has_a_line_here_and_every_line_a_readme_command():
    listed = readme_commands()
    assert [c for c in listed if c not in COMMANDS] == [], "README commands without a line in COMMANDS"
    assert [c for c in COMMANDS if c not in listed] == [], "lines in COMMANDS whose command left the README"
    assert all(isinstance(v, Here) or len(v) > 20 for v in COMMANDS.values()), "a skipped command needs its reason"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, str]:
    """The placeholders: a tiny run made by the README's train command, a corpus, a toy CORE bundle."""
    from tests.eval.conftest import write_toy_core_bundle

    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "corpus.jsonl").write_text('{"text": "def f(x):\\n    return x"}\n{"text": "A short line of prose."}\n')
    return {"tmp": str(tmp), "run": str(tmp / "main"), "bundle": str(write_toy_core_bundle(tmp / "core"))}


def run_here(line: str, work: dict) -> subprocess.CompletedProcess:
    argv = shlex.split(line.format(**work))
    program = {"python": sys.executable, "torchrun": TORCHRUN}.get(argv[0], argv[0])
    return subprocess.run([program, *argv[1:]], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_readme_command_runs_here_as_documented(work):
    """In README order, so the train command makes the run the later ones read."""
    failures = []
    for readme in readme_commands():
        here = COMMANDS.get(readme)
        if not isinstance(here, Here):
            continue
        start = time.monotonic()
        result = run_here(here.command, work)
        print(f"{time.monotonic() - start:6.1f} s  {here.command.format(**work)}")  # pytest -s: what each costs
        out = result.stdout + result.stderr
        if result.returncode != here.rc or "Traceback (most recent call last)" in out or here.says not in out:
            failures.append(f"{readme}\n  ran: {here.command.format(**work)}\n  exit {result.returncode} "
                            f"(documented {here.rc}); expected {here.says!r}\n{out[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_every_test_the_readme_names_exists():
    """The README's "tested by" and "shown by" columns point at tests/<path>[::name]: each must be there."""
    missing = []
    for path, name in re.findall(r"`((?:[\w]+/)+test_\w+\.py)(?:::(\w+))?`", README.read_text()):
        file = REPO / "tests" / path.removeprefix("tests/")
        if not file.is_file() or (name and not re.search(rf"^(async )?def {name}\(", file.read_text(), re.M)):
            missing.append(f"{path}::{name}" if name else path)
    assert not missing, missing
