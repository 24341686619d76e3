"""Every command in the README, run as a new user would, at tiny scale where the real one needs a GPU,
the Hub or the 2B's data, and what each prints and writes checked.

``readme_commands`` finds them: each line of a code block (fenced, or indented by four spaces) that
starts with a program, its trailing ``# comment`` dropped, and each backticked command in a table
column headed ``command``. ``COMMANDS`` holds one entry per README command:

- ``Here``: how it runs on this machine: the same program and flags with the placeholders filled (the
  module's short run, made by ``make train``; the bundled tokenizer and sample data; a toy CORE bundle
  and EvalPlus dataset), the exit status the README documents, a line it must print, a check of
  what it writes, and its group: each group of ``GROUPS`` runs in its own file,
  tests/readme/test_readme_<group>.py, in README order, so that make test's two pytest-xdist workers
  share them (``--dist loadfile`` keeps a file on one worker);
- ``Same``: the same program and flags as another README command, which runs here, or the same work as
  the test named, which does it (in process or as this command): not done twice;
- ``Skip``: why it cannot run here: it needs a GPU, the Hub or another network, or SLURM; it is this
  suite's own setup; or it runs for minutes, and the test named runs it at toy size.

The test fails when a command exits otherwise, prints a traceback, lacks its line or its files, and
when the README and ``COMMANDS`` disagree: a README command without an entry (the message says what to
add), an entry whose command left the README, a ``Same`` pointing at a command that does not run here or
at a test that does not exist or whose file does not name the command's module, recipe or mode, a
``Skip`` naming a test that does not exist, a ``Here`` in no group, a group without its file.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rundir import REPO
from tests.conftest import TORCHRUN, env, losses
from tests.train.test_sweep_report import ACCURACY as DPO_ACCURACY
from tests.train.test_sweep_report import fake_preference_sweep

README = REPO / "README.md"
PROGRAMS = ("python ", "torchrun ", "make ", "tensorboard ", "export ", "... ")


def readme_commands() -> list[str]:
    """The README's commands in order, each once: code block lines and ``command`` table cells."""
    found: list[str] = []

    def add(command: str) -> None:
        command = command.replace("\\|", "|")
        if command.startswith(PROGRAMS) and command not in found:
            found.append(command)

    fenced, column, lines = False, None, []
    for line in README.read_text().splitlines():  # a code line ending in " \\" goes on on the next one
        if lines and lines[-1].endswith(" \\") and not line.startswith("```"):
            lines[-1] = lines[-1][:-1] + line.strip()
        else:
            lines.append(line)
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or re.match(r" {4}\S", line):
            add(re.sub(r"\s+#\s.*$", "", line.strip()))
        elif line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if column is None:
                column = cells.index("command") if "command" in cells else -1
            elif column >= 0 and len(cells) > column:
                for span in re.findall(r"`([^`]+)`", cells[column]):
                    add(span)
        else:
            column = None
    return found


Check = Callable[[dict, str], None]  # (the placeholders, the output): asserts what the command wrote


# The groups the commands that run here are run in, each by its own test file, tests/readme/test_readme_<group>.py:
# make test's pytest-xdist workers take whole files (--dist loadfile), so the groups spread over them. Each group
# runs in README order; a command that reads another's output is in its group. Roughly equal shares of the time
# (seconds, each file alone on 2 cores beside another suite), so that no worker waits on one long file at the end.
RUN, TRAIN, PLAN, DATA, EXPORT, LONG_CONTEXT = "run", "train", "plan", "data", "export", "long"
GROUPS = {
    RUN: "make train: the run the later commands read, made once per session by whichever group reads {run} first "
         "(tests/readme/conftest.py; ~12 s)",
    TRAIN: "train.py's flags, torchtitan's entry point, the report, gpu_check, SLURM's dry runs (~60 s)",
    PLAN: "the planner on the 2B: phase 1's plot, long.toml at four lengths (~60 s)",
    DATA: "data: tokenized, checked, split; preference data; the dtp sweep's dry run; the local launcher (~70 s)",
    EXPORT: "Hugging Face export and import, CORE, EvalPlus, generation on one and two processes (~55 s)",
    LONG_CONTEXT: "tiny-long from the run and its evals: loss by position, passkey, RULER (~50 s)",
}


@dataclass(frozen=True)
class Here:
    """How a README command runs on this machine: ``command`` with {run}, {tmp}, ... filled, in ``group``."""

    command: str
    says: str  # a line the output must hold
    rc: int = 0  # the exit status the README documents here (2: bad input, e.g. the 2B's data is not here)
    check: Check | None = None
    group: str = ""  # one of GROUPS


@dataclass(frozen=True)
class Same:
    """The same program and flags as ``readme`` (another README command, which runs here), or the same work as
    ``test`` (tests/<path>::<name>, which runs it in process or as the command): not run here a second time."""

    readme: str = ""
    test: str = ""


GPU, NETWORK, SLURM, SUITE, LONG = ("needs GPUs", "needs the Hub or another network", "needs SLURM",
                                    "the suite's own setup", "runs for minutes")


@dataclass(frozen=True)
class Skip:
    """Why a README command does not run here; ``test`` (tests/<path>::<name>) runs it elsewhere, if any."""

    kind: str  # one of GPU, NETWORK, SLURM, SUITE, LONG
    why: str
    test: str = ""


# ---- what the commands write, checked ------------------------------------------------------------

def made_the_run(work: dict, out: str) -> None:
    run = Path(work["run"])
    logged = losses(run)
    assert sorted(logged) == [1, 2, 4, 6], logged  # every logging.interval=2 steps, and the last
    assert f"final loss: {logged[6]:.4f} at step 6" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-3", "step-6"]


def report_has_the_run(work: dict, out: str) -> None:
    from report.page import embedded_data

    page = Path(work["tmp"]) / "report" / "report.html"
    loss = embedded_data(page.read_text())["loss"]["loss"]
    assert dict(zip(loss["steps"], loss["values"])) == losses(Path(work["run"]))  # every logged step, exactly
    assert Path(work["run"]).name in page.read_text()


def prints(*lines: str) -> Check:
    """More lines the output must hold."""
    def check(work: dict, out: str) -> None:
        assert [line for line in lines if line not in out] == []
    return check


def refused_and_wrote_nothing(work: dict, out: str) -> None:
    """The dtp dry run: its plan, then every variant refused for the phase-1 data this machine lacks."""
    assert "8 variant(s) refused" in out and "[data.sources[0]] path: " in out
    assert not (Path(work["tmp"]) / "dtp").exists()


def png_written(path: str) -> Check:
    def check(work: dict, out: str) -> None:
        assert Path(path.format_map(work)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return check


CORPUS = ["def f(x):\n    return x", "A short line of prose."]


def tokenized_the_corpus(work: dict, out: str) -> None:
    """Both documents, each its tokens framed by <s> and </s>, by the tokenizer itself."""
    from data.tokenizer import Tokenizer

    manifest = json.loads((Path(work["tmp"]) / "tok" / "manifest.json").read_text())
    tokenizer = Tokenizer(REPO / "assets/tokenizer/tokenizer.model")
    assert (manifest["num_documents"], manifest["num_tokens"]) == (2, sum(len(tokenizer.encode(t)) + 2 for t in CORPUS))
    assert all((Path(work["tmp"]) / "tok" / s["file"]).stat().st_size == s["bytes"] for s in manifest["shards"])


def tokenized_the_conversations(work: dict, out: str) -> None:
    """Every conversation of the file is a document with a loss mask, or counted as refused."""
    manifest = json.loads((Path(work["tmp"]) / "chat" / "manifest.json").read_text())
    refused = manifest["chat"]["rejected"]
    lines = (REPO / "assets/chat/conversations.jsonl").read_text().splitlines()
    assert manifest["loss_mask"] and manifest["num_documents"] + sum(refused.values()) == len(lines), manifest
    assert f"conversations refused (not trained on): {refused}" in out


def assets_unchanged(work: dict, out: str) -> None:
    """A command that reads the bundled sample data (or finds its split already made) changes none of it."""
    assert subprocess.run(["git", "status", "--porcelain", "assets"], cwd=REPO, capture_output=True,
                          text=True).stdout == ""


def decontaminated_nothing_clean(work: dict, out: str) -> None:
    """Both documents of the clean corpus kept; the manifest counts 0 dropped per benchmark."""
    manifest = json.loads((Path(work["tmp"]) / "decont" / "manifest.json").read_text())
    assert manifest["num_documents"] == len(CORPUS)
    assert manifest["decontamination"]["dropped"] == {"humaneval": 0, "mbpp": 0}, manifest["decontamination"]


def sampled_and_wrote_evalplus_files(work: dict, out: str) -> None:
    """pass@1 and pass@2 of each of the four names; evalplus's files, one line a sample (1 task x 2)."""
    assert [m for m in ("humaneval", "humaneval+", "mbpp", "mbpp+") for k in (1, 2) if f"{m}/pass@{k}" not in out] == []
    for dataset in ("humaneval", "mbpp"):
        assert len((Path(work["tmp"]) / "samples" / f"{dataset}.jsonl").read_text().splitlines()) == 2


def made_the_bundled_pairs(work: dict, out: str) -> None:
    """The pairs file and the train/held_out shards and masks, byte for byte the bundled ones."""
    made, bundled = Path(work["tmp"]) / "preference", REPO / "assets" / "preference"
    files = [f.relative_to(bundled) for f in bundled.rglob("*") if f.is_file() and ".ds" in f.name]
    assert len(files) == 8 and (made / "pairs.jsonl").read_bytes() == (bundled / "pairs.jsonl").read_bytes()
    assert [str(f) for f in files if (made / f).read_bytes() != (bundled / f).read_bytes()] == []


def compared_on_preference_accuracy(work: dict, out: str) -> None:
    """Every tiny-dpo variant compared on held-out accuracy, and the report says why not on the losses."""
    import csv

    summary = list(csv.DictReader(open(Path(work["dpo_sweep"]) / "summary.csv")))
    assert [(r["variant"], r["metric"]) for r in summary] == [(v, "eval/pref_accuracy") for v in DPO_ACCURACY]
    assert "the runs' losses are not on one scale (preference.loss dpo, dpo_norm, simpo; preference.beta 0.1, 5" in out


def exported_the_checkpoint(work: dict, out: str) -> None:
    """to-hf: config.json and the safetensors hold the run's last checkpoint's weights (fp32: kept)."""
    import torch
    from safetensors.torch import load_file

    from tests.conftest import checkpoint_tensors

    hf = Path(work["tmp"]) / "hf"
    assert json.loads((hf / "config.json").read_text())["model_type"] == "laneformer"
    exported = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    saved = {k: v for k, v in checkpoint_tensors(Path(work["run"]) / "checkpoints" / "step-6").items()
             if not k.startswith("optimizer.")}  # the model's, under torchtitan's names
    assert len(exported) == len(saved), (sorted(exported), sorted(saved))
    for name, tensor in saved.items():  # under `model.` in the released layout, lm_head beside it
        got = exported.get(name if name == "lm_head.weight" else f"model.{name}")
        assert got is not None and torch.equal(got, tensor), f"{name}: not in the export with the checkpoint's values"


def imported_the_export(work: dict, out: str) -> None:
    """from-hf: the imported DCP checkpoint holds the export's tensors under torchtitan's names, and the
    run's model config."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = Path(work["tmp"])
    imported = tmp / "imported"
    assert json.loads((imported / "laneformer_config.json").read_text()) == json.loads(
        (Path(work["run"]) / "laneformer_config.json").read_text())
    dcp_to_torch_save(imported, tmp / "imported.pt")
    state = torch.load(tmp / "imported.pt", weights_only=False)
    exported = {k: v for f in (tmp / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(k if k == "lm_head.weight" else f"model.{k}" for k in state)
    assert all(torch.equal(t, exported[k if k == "lm_head.weight" else f"model.{k}"]) for k, t in state.items())


def ids_of(out: str) -> str:
    [ids] = re.findall(r"^ids: (.*)$", out, re.M)
    return ids


def same_ids_as_one_process(work: dict, out: str) -> None:
    assert ids_of(out) == work["ids"], (ids_of(out), work["ids"])


def remember_ids(work: dict, out: str) -> None:
    work["ids"] = ids_of(out)


def launched_and_done(work: dict, out: str) -> None:
    from launch.attempts import history

    run = Path(work["tmp"]) / "local"
    assert [(e["event"], e.get("action")) for e in history(run)] == [("start", None), ("end", "done")]
    assert sorted(losses(run)) == [1, 2]


def titan_run(work: dict, out: str) -> None:
    """torchtitan's own entry point ran the registered config (train.config_registry) for its 2 steps
    (the one test of that entry point: tests/train/test_train.py ran the same command)."""
    assert sorted(losses(Path(work["tmp"]) / "titan")) == [1, 2]


def plan_rows_as_the_readme_quotes(work: dict, out: str) -> None:
    """Every row of the README's plan-at-length table is a row --plan printed (the README shows all its
    columns but accumulation, CP GB/step and MFU)."""
    quoted = [line.split() for line in README.read_text().splitlines() if re.match(r"^\d+,\d+ +H[12]00 ", line)]
    printed = {tuple(row[:3]): row for row in (line.split() for line in out.splitlines()) if len(row) == 11}
    assert len(quoted) == 8, quoted
    for row in quoted:
        got = printed.get(tuple(row[:3]))
        assert got is not None and row == got[:7] + got[9:10], (row, got)


def long_run_scored_by_position(work: dict, out: str) -> None:
    """tiny-long from the tiny run: a model of 512 tokens with YaRN on its full layers, and its end-of-run
    eval holds the loss in 8 buckets of 512 positions."""
    run = Path(work["tmp"]) / "tiny-long"
    config = json.loads((run / "laneformer_config.json").read_text())
    assert (config["max_seq_len"], config["rope_scaling"], config["rope_scaling_factor"]) == (512, "yarn", 4.0), config
    metrics = json.loads((run / "evals" / "step-2.json").read_text())["metrics"]
    assert [k for k in metrics if k.startswith("eval/val_loss_pos/")] == [
        f"eval/val_loss_pos/{a}-{a + 64}" for a in range(0, 512, 64)], metrics


# ---- the README's commands ------------------------------------------------------------------------

SHORT_RUN = ("--set run.output_dir={run} --set training.steps=6 --set schedule.warmup_steps=2 "
             "--set logging.interval=2 --set checkpoint.interval=3 --set eval.every=0 --set logging.report=false")
MAKE_TRAIN = "make train"  # first: the run the later commands read
HF = "python -m models.laneformer.convert to-hf runs/NAME OUT"
ONE_PROCESS = "python -m models.laneformer.generate --checkpoint X --prompt TEXT --max-new-tokens N"
PLOT = "python train.py --recipe phase1.toml --plan --gpus 192 --plot plan.png"
DTP_DRY = "python -m launch.sweep recipes/sweeps/dtp.toml --dry-run --gpus 8 --gpu h100"
CORE = "python -m eval.run --checkpoint runs/NAME --core BUNDLE --max-per-task 100"
EVALPLUS = ("python -m eval.run --checkpoint X --evalplus humaneval,mbpp --evalplus-data DIR [--chat] [--limit N] "
            "[--evalplus-find-zero released]")
BENCH = "tests/bench/test_bench.py"
SWEEP = "tests/launch/test_sweep.py::test_the_comparison_holds_each_runs_own_metrics"

COMMANDS: dict[str, Here | Same | Skip] = {
    # Not the README's bare `make train`: its setup step is this suite's environment (`-o` keeps make from
    # reinstalling it), and TRAIN_ARGS shortens the run to 6 steps.
    MAKE_TRAIN: Here(f"make -o .venv/.installed train TRAIN_ARGS='{SHORT_RUN}'", "final loss: ", check=made_the_run,
                     group=RUN),
    "make test": Skip(SUITE, "this suite itself (CI runs it on a clean clone)"),
    "make setup": Skip(SUITE, "makes the environment this suite runs in (CI runs make test on a clean clone)"),
    # --- one command per job ---
    "torchrun --nproc-per-node 8 train.py --recipe phase1.toml": Skip(GPU, "the 2B on 8 GPUs; train.py itself runs "
                                                                         "here through make train"),
    "... --set optimizer.lr=2e-4 --set training.steps=1000 --set data.sources.code.weight=0.3":
        Here("python train.py --recipe tiny.toml --set optimizer.lr=2e-4 --set training.steps=1000 "
             "--set data.sources.code.weight=0.3 --print-config",
             "steps = 1000", check=prints("lr = 0.0002", 'sample_data/code"\nweight = 0.3'), group=TRAIN),
    "python train.py --recipe phase1.toml --print-config": Here("python train.py --recipe phase1.toml --print-config",
                                                                'flavor = "2B"', group=TRAIN),
    "python train.py --recipe phase1.toml --dry-run [--gpus 192 --mfu 0.4] [--run DIR]":
        Here("python train.py --recipe phase1.toml --dry-run --gpus 192 --mfu 0.28 --run {run}",
             "expected wall time: 12.9 days on 192 GPUs at 28% MFU", rc=2, group=TRAIN),
    "python train.py --recipe phase1.toml --plan [--gpus 192 --gpu h100|h200|a100|mi300x] [--sweep] [--ops]":
        Same(PLOT),
    "torchrun -m torchtitan.train --module train --config laneformer_tiny":
        Here("torchrun -m torchtitan.train --module train --config laneformer_tiny --training.steps 2 "
             "--dump_folder {tmp}/titan --metrics.log_freq 1", "", check=titan_run, group=TRAIN),
    "python train.py --recipe phase1 --set optimizer.name=muon --plan --gpus 192": Skip(LONG, "the 2B's plan with "
        "Muon (a minute, as phase 1's plan in the plan group); the test named checks what it counts, on tiny",
        "tests/train/test_muon.py::test_the_plan_counts_muons_one_buffer_and_its_newton_schulz"),
    "torchrun --nproc-per-node 8 train.py --recipe phase1.toml --set optimizer.name=muon": Skip(GPU, "the 2B on 8 "
        "GPUs; Muon on 1, 2 and 4 gloo ranks in the test named", "tests/e2e/test_muon.py"),
    "torchrun ... train.py --recipe phase2.toml": Skip(GPU, "the 2B on GPUs from phase 1's checkpoint; tiny-phase2 "
        "from a tiny checkpoint runs in the test named", "tests/train/test_train.py::test_phase2_starts_from_phase1_weights"),
    "python -m report runs/NAME [runs/OTHER ...] [--out DIR] [--plan-gpu h100 --gpus 192]":
        Here("python -m report {run} --out {tmp}/report", "report.html", check=report_has_the_run, group=TRAIN),
    PLOT: Here("python train.py --recipe phase1.toml --plan --gpus 192 --plot {tmp}/plan.png",
               "peak memory per GPU: 58.76 GiB of 79.6 GiB (fits)", check=png_written("{tmp}/plan.png"), group=PLAN),
    "python -m models.laneformer.inspect --flavor 2B": Here("python -m models.laneformer.inspect --flavor 2B",
                                                           "2,320,069,632", group=DATA),
    "python -m data.tokenize --input <hub id, dir or glob> --text-key text --tokenizer tokenizer.model --out DIR "
    "[--slurm ...]": Here("python -m data.tokenize --input {tmp}/corpus.jsonl --text-key text "
                          "--tokenizer assets/tokenizer/tokenizer.model --out {tmp}/tok", "2 documents",
                          check=tokenized_the_corpus, group=DATA),
    "python -m data.tokenizer fetch [--repo ID]": Skip(NETWORK, "downloads from the Hub; a local fake hub in the test "
        "named", "tests/train/test_data_commands.py::test_tokenizer_fetch_puts_in_place_only_the_expected_file"),
    "python -m train.data download --recipe phase1 --source web-high [--slurm --partition P]": Skip(NETWORK,
        "downloads from the Hub; a local fake hub in the test named",
        "tests/train/test_data_commands.py::test_download_then_tokenize_the_local_copy_with_the_hub_cut_off"),
    "python -m train.data tokenize --recipe phase1 --source web-high [--tasks N --slurm ...]": Skip(NETWORK,
        "reads the source from the Hub or its download; a local fake hub in the test named",
        "tests/train/test_data_commands.py::test_download_then_tokenize_the_local_copy_with_the_hub_cut_off"),
    "python -m data.tokenize --input FILE --chat-key messages --tokenizer T --out DIR":
        Here("python -m data.tokenize --input assets/chat/conversations.jsonl --chat-key messages "
             "--tokenizer assets/tokenizer/tokenizer.model --out {tmp}/chat", "conversations refused",
             check=tokenized_the_conversations, group=DATA),
    "python -m train.data verify --recipe phase1": Here("python -m train.data verify --recipe tiny", "ok ",
                                                        group=DATA),
    "python -m train.data held-out --recipe phase1 [--source web-high]":  # split already: unchanged
        Here("python -m train.data held-out --recipe tiny", "held out (held_out 0.1)", check=assets_unchanged,
             group=DATA),
    "python -m data.held_out DIR --held-out 0.0001":
        Here("python -m data.held_out assets/sample_data/code --held-out 0.1", "held out (held_out 0.1)",
             check=assets_unchanged, group=DATA),
    "python -m data.verify DIR...": Here("python -m data.verify assets/sample_data/prose assets/sample_data/code",
                                         "ok ", group=DATA),
    "python -m data.decontaminate report DIR... --benchmarks humaneval,mbpp[,core] --evalplus-data DIR "
    "[--core-bundle DIR]": Here("python -m data.decontaminate report assets/sample_data/prose --benchmarks core "
                                "--core-bundle {bundle}", "core: 0 overlapping", check=assets_unchanged, group=DATA),
    "python -m data.tokenize --input DIR --tokenizer T --out OUT --decontaminate humaneval,mbpp[,core] "
    "--evalplus-data DIR [--core-bundle DIR]":
        Here("python -m data.tokenize --input {tmp}/corpus.jsonl --tokenizer assets/tokenizer/tokenizer.model "
             "--out {tmp}/decont --decontaminate humaneval,mbpp --evalplus-data {evalplus}",
             "dropped as benchmark overlap", check=decontaminated_nothing_clean, group=DATA),
    "python -m train.data tokenize --recipe phase2 --source code --evalplus-data DIR": Skip(NETWORK,
        "reads phase 2's code source from the Hub or its download; a bundled source in the test named",
        "tests/data/test_decontaminate.py::test_a_recipe_source_with_decontaminate_is_tokenized_with_it"),
    "python -m data.decontaminate report OUT... --benchmarks humaneval,mbpp --evalplus-data DIR":
        Same("python -m data.decontaminate report DIR... --benchmarks humaneval,mbpp[,core] --evalplus-data DIR "
             "[--core-bundle DIR]"),
    HF: Here("python -m models.laneformer.convert to-hf {run} {tmp}/hf", "", check=exported_the_checkpoint,
             group=EXPORT),
    # merge: the test named averages a run dir and an export (1,0 and 0.25,0.75) as this command does
    "python -m models.laneformer.merge OUT CKPT CKPT... [--weights W,W,...]": Same(
        test="tests/models/test_merge.py::test_weights_pick_one_exactly_or_interpolate_across_a_run_dir_and_an_export"),
    "python -m models.laneformer.convert from-hf HF_DIR OUT": Here("python -m models.laneformer.convert from-hf "
                                                                   "{tmp}/hf {tmp}/imported", "",
                                                                   check=imported_the_export, group=EXPORT),
    "python -m models.laneformer.push OUT --repo-id ORG/NAME [--dry-run]":
        Here("python -m models.laneformer.push {tmp}/hf --repo-id org/laneformer-tiny --dry-run", "config.json",
             group=EXPORT),
    CORE: Here("python -m eval.run --checkpoint {run} --core {bundle} --core-tasks copa,winograd --max-per-task 2",
               "partial CORE", group=EXPORT),
    "python -m eval.core_data fetch DIR": Skip(NETWORK, "downloads nanochat's eval_bundle.zip; the test named "
                                                        "converts a local copy", "tests/eval/test_core_data.py"),
    EVALPLUS: Here("python -m eval.run --checkpoint {tmp}/hf --evalplus humaneval,mbpp --evalplus-data {evalplus} "
                   "--chat --limit 1 --max-new-tokens 8", "mbpp+/pass@1",
                   check=prints("humaneval/pass@1", "humaneval+/pass@1", "mbpp/pass@1"), group=EXPORT),
    "python -m eval.run --checkpoint IMPORTED --evalplus humaneval,mbpp --evalplus-data EVALPLUS_DIR --chat "
    "--samples 16 --temperature T [--top-p 0.95] [--seed 0] [--evalplus-out DIR]":
        Here("python -m eval.run --checkpoint {tmp}/hf --evalplus humaneval,mbpp --evalplus-data {evalplus} --chat "
             "--limit 1 --max-new-tokens 8 --samples 2 --temperature 0.8 --seed 0 --evalplus-out {tmp}/samples",
             "mbpp+/pass@2", check=sampled_and_wrote_evalplus_files, group=EXPORT),
    ONE_PROCESS: Here("python -m models.laneformer.generate --checkpoint {tmp}/hf --prompt 'def add(a, b):' "
                      "--max-new-tokens 4 --no-tp-baseline", "ids: ", check=remember_ids, group=EXPORT),
    "torchrun --nproc-per-node 8 -m models.laneformer.generate --checkpoint HF_DIR --prompt TEXT --max-new-tokens N "
    "--lane-parallel": Here("torchrun --nproc-per-node 2 -m models.laneformer.generate --checkpoint {tmp}/hf "
                            "--prompt 'def add(a, b):' --max-new-tokens 4 --lane-parallel --no-tp-baseline", "ids: ",
                            check=same_ids_as_one_process, group=EXPORT),
    "python -m launch.sweep recipes/sweeps/dtp.toml [--dry-run --gpus 8 --gpu h100] [--parallel K | --slurm "
    "--partition P ...]": Same(DTP_DRY),
    "python -m report runs/sweeps/dtp": Skip(GPU, "compares the dtp study's 24 runs on 8 H100s; the test named "
                                                        "compares the tiny sweep", SWEEP),
    "python -m launch.local --recipe tiny.toml --nproc 2 [--set ...]":
        Here("python -m launch.local --recipe tiny.toml --nproc 2 --set run.output_dir={tmp}/local "
             "--set training.steps=2 --set schedule.warmup_steps=1 --set logging.report=false --set eval.every=0 "
             "--set eval.at_end=false", "", check=launched_and_done, group=DATA),
    "python -m bench.gpu_check": Here("python -m bench.gpu_check --out {tmp}/gpu_check.json",
                                      "no CUDA GPU found, so nothing was checked", rc=1, group=TRAIN),
    # --- benchmarks ---
    "python -m bench.lanes_vs_dense --flavors 100M --modes compiled --steps 15": Skip(LONG, "a benchmark", BENCH),
    "python -m bench.compile": Skip(LONG, "a benchmark", BENCH),
    "python -m bench.checkpoint": Skip(LONG, "a benchmark", BENCH),
    "python -m bench.dataloader": Skip(LONG, "a benchmark", BENCH),
    "python -m bench.step_overhead": Skip(LONG, "a benchmark", BENCH),
    "python -m bench.compile_cache": Skip(LONG, "three compiled launches; its figures are in bench/README.md",
                                          "tests/bench/test_bench.py"),
    # --- SFT ---
    "python -m models.laneformer.convert from-hf RELEASE IMPORTED": Same("python -m models.laneformer.convert from-hf "
                                                                        "HF_DIR OUT"),
    "python -m eval.run --checkpoint IMPORTED --evalplus humaneval,mbpp --evalplus-data EVALPLUS_DIR --chat":
        Same(EVALPLUS),
    # --- post-training: preference optimization ---
    "python -m data.make_sample_pairs": Here("python -m data.make_sample_pairs --out {tmp}/preference",
                                             "1026 pairs, 64,529 tokens", check=made_the_bundled_pairs, group=DATA),
    "python -m data.make_rl_tasks": Same(test="tests/train/test_rl_recipe.py::test_bundled_assets_are_what_the_script_makes"),
    "python train.py --recipe tiny-rl": Skip(LONG, "after the tiny, tiny-phase2 and tiny-sft runs; the test named runs "
        "4 steps of it from a random model, killed and resumed", "tests/e2e/test_rl.py"),
    "python train.py --recipe tiny-dpo": Skip(LONG, "the reference pass over 1,140 pairs and 60 steps (~20 minutes "
        "here); the test named runs a preference run at toy size",
        "tests/e2e/test_preference.py::test_one_rank_ln2_held_out_cache_kill_and_resume_beta"),
    "python -m launch.sweep recipes/sweeps/tiny-dpo.toml": Skip(LONG, "6 tiny-dpo runs; the test named runs a "
                                                                      "sweep at toy size", SWEEP),
    # On the sweep dir the fixture lays out as launch.sweep and tiny-dpo.toml's runs leave it, their metrics written
    # by the test (training them takes ~2 hours here).
    "python -m report runs/sweeps/tiny-dpo": Here("python -m report {dpo_sweep}",
                                                        "held-out preference accuracy at 20,480 tokens "
                                                        "(eval/pref_accuracy, higher is better;",
                                                        check=compared_on_preference_accuracy, group=DATA),
    "python train.py --recipe dpo --dry-run": Here("python train.py --recipe dpo --dry-run",
                                                   "reference pass: one forward over 271,409 pairs", rc=2, group=DATA),
    "python -m train.data download --recipe dpo --source tulu3-preference":
        Same("python -m train.data download --recipe phase1 --source web-high [--slurm --partition P]"),
    "python -m train.data tokenize --recipe dpo --source tulu3-preference":
        Same("python -m train.data tokenize --recipe phase1 --source web-high [--tasks N --slurm ...]"),
    "torchrun --nproc-per-node 8 train.py --recipe dpo": Skip(GPU, "the 2B's DPO on 8 GPUs from the SFT checkpoint; "
                                                                   "the tiny one runs in the test named above"),
    # --- sweeps ---
    "python -m report.forgetting runs/sweeps/NAME [--merge-weights 0,0.25,0.5,0.75,1]": Skip(LONG, "reads a phase-2 "
        "sweep's runs (11 CPU-minutes to train at tiny scale), then writes and scores 5 merges; the test named draws "
        "a sweep the launcher lays out and scores merges at 0 and 1", "tests/train/test_forgetting_report.py"),
    "python -m launch.sweep recipes/sweeps/tiny-replay.toml": Skip(LONG, "4 tiny-phase2 runs from runs/tiny (~6 "
        "CPU-minutes, after tiny's 4); the test named lays the sweep out with the launcher's own code",
        "tests/train/test_forgetting_report.py"),
    "python -m report.forgetting runs/sweeps/tiny-replay": Same("python -m report.forgetting runs/sweeps/NAME "
                                                                "[--merge-weights 0,0.25,0.5,0.75,1]"),
    "python -m launch.sweep recipes/sweeps/tiny-dtp.toml": Skip(LONG, "4 runs of 100 steps (8.9 CPU-minutes); the "
                                                                      "test named runs it at 4 steps", SWEEP),
    "python -m report runs/sweeps/tiny-dtp": Skip(LONG, "compares the sweep above; the test named runs it on "
                                                              "its 4-step sweep", SWEEP),
    DTP_DRY: Here("python -m launch.sweep recipes/sweeps/dtp.toml --dry-run --gpus 8 --gpu h100 --root {tmp}/dtp",
                  "sweep total: 24 runs, 46.4 GPU-hours at the roofline (5.8 h on 8 x H100", rc=2,
                  check=refused_and_wrote_nothing, group=DATA),
    "python -m launch.sweep recipes/sweeps/dtp.toml --slurm --partition gpu --nodes 1 --gpus-per-node 8 "
    "--time 12:00:00": Skip(SLURM, "submits a job per run", "tests/launch/test_sweep.py"),
    # --- from zero to a phase-1 run ---
    "python -m data.tokenizer fetch": Same("python -m data.tokenizer fetch [--repo ID]"),
    "export LANEFORMER_DATA_ROOT=/lustre/you/laneformer":
        Here("bash -c 'export LANEFORMER_DATA_ROOT={tmp}/lustre && python train.py --recipe phase1 --dry-run'",
             "{tmp}/lustre/tokenized/nemotron-cc-v2/high-quality not found", rc=2, group=TRAIN),
    "python train.py --recipe phase1 --dry-run": Here("python train.py --recipe phase1 --dry-run",
                                                      "needs >= ", rc=2, group=TRAIN),
    "python -m train.data download --recipe phase1 --source web-high [--slurm --partition cpu]":
        Same("python -m train.data download --recipe phase1 --source web-high [--slurm --partition P]"),
    "python -m train.data tokenize --recipe phase1 --source web-high --tasks 512 --slurm --partition cpu "
    "--time 24:00:00 --sbatch-arg signal=USR1@120":
        Same("python -m train.data tokenize --recipe phase1 --source web-high [--tasks N --slurm ...]"),
    "python train.py --recipe phase1 --plan --gpu h100": Same(PLOT),
    # --no-plan: the plan is the --plot row's
    "python -m launch.slurm submit --recipe phase1 --nodes 24 --gpus-per-node 8 --partition gpu --account ACCOUNT "
    "--time 48:00:00 --nccl-socket-ifname ib0 --dry-run":
        Here("python -m launch.slurm submit --recipe phase1 --nodes 24 --gpus-per-node 8 --partition gpu "
             "--account ACCOUNT --time 48:00:00 --nccl-socket-ifname ib0 --dry-run --no-plan", "#SBATCH --nodes=24",
             rc=2, group=TRAIN),
    "python -m launch.slurm status runs/laneformer-2b-phase1": Here("python -m launch.slurm status {run}",
                                                                   "latest checkpoint: step 6 of 6", group=TRAIN),
    "python -m launch.slurm logs runs/laneformer-2b-phase1 -f": Skip(SLURM, "follows a SLURM job's logs; the test "
        "named reads them on the emulated cluster", "tests/launch/test_launch_slurm.py"),
    "tensorboard --logdir runs/laneformer-2b-phase1": Here("tensorboard --logdir {run} --inspect --tag "
                                                           "loss_metrics/global_avg_loss",
                                                           "loss_metrics/global_avg_loss", group=TRAIN),
    "python -m launch.slurm submit --recipe phase2 --nodes 24 --gpus-per-node 8 ...": Skip(SLURM, "a SLURM "
        "submission; the test named submits on the emulated cluster", "tests/launch/test_launch_slurm.py"),
    "python -m models.laneformer.convert to-hf runs/laneformer-2b-phase2 exports/laneformer-2b": Same(HF),
    "python -m eval.core_data fetch core_bundle": Same("python -m eval.core_data fetch DIR"),
    "python -m eval.run --checkpoint exports/laneformer-2b --core core_bundle": Same(CORE),
    "python -m models.laneformer.push exports/laneformer-2b --repo-id ORG/laneformer-2b": Skip(NETWORK, "uploads to "
        "the Hub (its --dry-run runs above)", "tests/models/test_push.py"),
    # --- long context ---
    # The long recipe's verdict at its own 16k (plan.dry_run, with the recipe's 192 GPUs and the default MFU and
    # peak): the test named prints it and checks both lines; the exit 2 (no data here) is phase 1's dry run's.
    "python train.py --recipe long --dry-run": Same(test="tests/train/test_plan_length.py::"
                                                         "test_the_dry_run_of_long_toml_says_no_cp_is_needed_at_16k"),
    "python train.py --recipe long --plan --gpus 192": Here("python train.py --recipe long --plan --gpus 192",
                                                            "65,536 tokens: CP 4 on H100 80GB, CP 2 on H200 141GB",
                                                            check=plan_rows_as_the_readme_quotes, group=PLAN),
    "torchrun --nproc-per-node 8 train.py --recipe long": Skip(GPU, "the 2B's long phase on GPUs from phase 2's "
                                                                    "checkpoint; tiny-long runs here below"),
    # data.make_passkey's main is build(--out) and a line per manifest: the test named builds and compares every
    # file, manifests included, with the bundled assets/passkey and assets/long.
    "python -m data.make_passkey": Same(test="tests/data/test_passkey.py::"
                                             "test_bundled_assets_are_what_the_script_makes"),
    "python train.py --recipe tiny-long": Here("python train.py --recipe tiny-long --set checkpoint.init_from={run} "
                                               "--set run.output_dir={tmp}/tiny-long --set training.steps=2 "
                                               "--set training.global_batch=2 --set training.micro_batch=2 "
                                               "--set schedule.warmup_steps=1 --set checkpoint.interval=2 "
                                               "--set eval.val_samples=2 --set logging.report=false",
                                               "final loss: ", check=long_run_scored_by_position, group=LONG_CONTEXT),
    "python -m eval.run --checkpoint runs/tiny-long --loss-by-position 8 --held-out long=assets/long --seq-len 512 "
    "--val-samples 67": Here("python -m eval.run --checkpoint {tmp}/tiny-long --loss-by-position 8 "
                             "--held-out long=assets/long --seq-len 512 --val-samples 2", "eval/val_loss_pos/448-512",
                             group=LONG_CONTEXT),
    "python -m eval.run --checkpoint runs/tiny --set max_seq_len=512 --loss-by-position 8 --held-out long=assets/long "
    "--seq-len 512 --val-samples 67": Here("python -m eval.run --checkpoint {run} --set max_seq_len=512 "
                                           "--loss-by-position 8 --held-out long=assets/long --seq-len 512 "
                                           "--val-samples 2", "eval/val_loss_pos/448-512", group=LONG_CONTEXT),
    "python -m eval.passkey runs/tiny-long": Here("python -m eval.passkey {tmp}/tiny-long --limit 2", "length 512",
                                                  check=prints("accuracy "), group=LONG_CONTEXT),
    "python -m eval.passkey runs/tiny --set max_seq_len=512": Here("python -m eval.passkey {run} --set max_seq_len=512 "
                                                                   "--limit 2", "length 512", group=LONG_CONTEXT),
    "python -m eval.passkey runs/tiny-long --length 2048 --set max_seq_len=2048":
        Here("python -m eval.passkey {tmp}/tiny-long --length 2048 --set max_seq_len=2048 --limit 2",
             "on 2 documents made for --length 2048", check=prints("length 2048"), group=LONG_CONTEXT),
    "python -m eval.run --checkpoint runs/tiny-long --lm-eval niah_single_1 --limit 20":
        Here("python -m eval.run --checkpoint {tmp}/tiny-long --lm-eval niah_single_1 --limit 1",
             "lm_eval/niah_single_1/512", group=LONG_CONTEXT),
}

TODO = ('add to COMMANDS in tests/test_readme_commands.py: "{c}": Here("<the command with placeholders filled: '
        '{{run}}, {{tmp}}, {{bundle}}, {{evalplus}}>", "<a line it prints>", rc=<documented exit status>, '
        'check=<a function asserting what it writes>, group=<one of GROUPS>), or Same("<another README command it '
        'repeats>"), or Same(test="tests/<file>::<test that does the same work>"), or '
        'Skip(GPU|NETWORK|SLURM|SUITE|LONG, "<why>", "tests/<file>::<test that runs it>")')


def named_test(test: str) -> Path:
    """The file of ``tests/<path>[::name]``, once it holds the test function ``name``."""
    path, _, name = test.partition("::")
    file = REPO / path
    assert file.is_file(), test
    assert not name or re.search(rf"^def {name}\(", file.read_text(), re.M), test
    return file


def what_it_runs(readme: str) -> list[str]:
    """What the file of a test doing a README command's work names: the command's module (``python -m
    data.make_passkey``: make_passkey), its recipe (``--recipe long``: long.toml), its mode (--dry-run: dry_run)."""
    words = readme.split()
    names = [words[words.index("-m") + 1].rsplit(".", 1)[-1]] if "-m" in words else []
    names += [words[words.index("--recipe") + 1].removesuffix(".toml") + ".toml"] if "--recipe" in words else []
    return names + [flag[2:].replace("-", "_") for flag in ("--dry-run", "--plan") if flag in words]


def test_every_readme_command_has_an_entry_and_every_entry_a_readme_command():
    listed = readme_commands()
    missing = [TODO.format(c=c) for c in listed if c not in COMMANDS]
    assert not missing, "README commands without an entry:\n" + "\n".join(missing)
    assert [c for c in COMMANDS if c not in listed] == [], "entries in COMMANDS whose command left the README"


def test_a_same_entry_points_at_a_command_that_runs_and_a_skip_is_reasoned():
    for readme, entry in COMMANDS.items():
        if isinstance(entry, Same) and entry.test:
            assert not entry.readme and "::" in entry.test, f"{readme}: Same names one test, or a README command"
            names, text = what_it_runs(readme), named_test(entry.test).read_text()
            assert names and [n for n in names if n not in text] == [], f"{readme}: {entry.test} does not run {names}"
        elif isinstance(entry, Same):
            assert isinstance(COMMANDS.get(entry.readme), (Here, Skip)) and entry.readme != readme, readme
            target = COMMANDS[entry.readme]
            assert not isinstance(target, Same), f"{readme}: points at another Same"
            assert readme.split()[:3] == entry.readme.split()[:3], f"{readme}: not the program of {entry.readme}"
        elif isinstance(entry, Skip):
            assert entry.kind in (GPU, NETWORK, SLURM, SUITE, LONG) and len(entry.why) > 10, readme
            assert entry.test or entry.kind in (GPU, SUITE), f"{readme}: say which test runs it at toy size"
            if entry.test:
                named_test(entry.test)
    # what does not run here, by kind: a change to this list is a change to what the README test checks
    skipped = {}
    for readme, entry in COMMANDS.items():
        if isinstance(entry, Skip):
            skipped.setdefault(entry.kind, []).append(readme.split(" [")[0][:40])
    assert {k: len(v) for k, v in skipped.items()} == {SUITE: 2, GPU: 6, NETWORK: 6, LONG: 14, SLURM: 3}, skipped
    # and what another test does instead, the same work, checked there
    assert [r for r, e in COMMANDS.items() if isinstance(e, Same) and e.test] == [
        "python -m models.laneformer.merge OUT CKPT CKPT... [--weights W,W,...]", "python -m data.make_rl_tasks",
        "python train.py --recipe long --dry-run", "python -m data.make_passkey"]


def test_every_command_that_runs_here_is_in_a_group_and_every_group_has_its_test_file():
    for readme, entry in COMMANDS.items():
        assert not isinstance(entry, Here) or entry.group in GROUPS, f"{readme}: group= one of {sorted(GROUPS)}"
    assert [r for r, e in COMMANDS.items() if isinstance(e, Here) and e.group == RUN] == [MAKE_TRAIN]
    for group in GROUPS.keys() - {RUN}:
        assert any(isinstance(e, Here) and e.group == group for e in COMMANDS.values()), f"{group}: an empty group"
        file = REPO / "tests" / "readme" / f"test_readme_{group}.py"
        assert file.is_file() and f'run_group("{group}", ' in file.read_text(), f"{file} runs the group {group}"
    assert sorted(p.name for p in (REPO / "tests" / "readme").glob("test_*.py")) == sorted(
        f"test_readme_{g}.py" for g in GROUPS.keys() - {RUN})


class Work(dict):
    """The placeholders of a group's commands, each made the first time a command or a check reads it: {tmp},
    the group's own folder (with the corpus); {run}, the run make train makes (once for all the groups:
    tests/readme/conftest.py); a toy CORE bundle, {bundle}; a toy EvalPlus dataset, {evalplus}; and the tiny-dpo
    sweep's dir with its runs' metrics (not trained), {dpo_sweep}."""

    def __init__(self, tmp: Path, run: Callable[[], str]):
        super().__init__(tmp=str(tmp))
        (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
        self.makers = {"run": run, "bundle": lambda: toy_core_bundle(tmp / "core"), "evalplus": lambda: toy_evalplus(
            tmp / "evalplus"), "dpo_sweep": lambda: fake_preference_sweep(tmp / "tiny-dpo", DPO_ACCURACY)}

    def __missing__(self, key: str) -> str:
        if key not in self.makers:
            raise KeyError(key)
        value = self[key] = str(self.makers[key]())
        return value


def toy_core_bundle(folder: Path) -> Path:
    from tests.eval.conftest import write_toy_core_bundle

    return write_toy_core_bundle(folder)


def toy_evalplus(folder: Path) -> Path:
    from tests.eval.evalplus_cases import HUMANEVAL, MBPP, write_release

    folder.mkdir()
    write_release(folder / "HumanEvalPlus.jsonl", HUMANEVAL)
    write_release(folder / "MbppPlus.jsonl", MBPP)
    return folder


def run_here(line: str) -> subprocess.CompletedProcess:
    """As a user with the venv activated runs it: its programs (python, torchrun, tensorboard) first on PATH."""
    argv = shlex.split(line)
    program = {"python": sys.executable, "torchrun": TORCHRUN}.get(argv[0], argv[0])
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run([program, *argv[1:]], cwd=REPO, env={**env(), "PATH": path}, capture_output=True,
                          text=True, timeout=600)


def run_checked(here: Here, work: dict) -> str | None:
    """Runs ``here``; what is wrong (its exit status, a traceback, its line missing, what it wrote), or None."""
    line = here.command.format_map(work)  # first: {run} may be made for it
    start = time.monotonic()
    result = run_here(line)
    print(f"{time.monotonic() - start:6.1f} s  {line}")  # pytest -s: what each costs
    out = result.stdout + result.stderr
    problem = None
    if result.returncode != here.rc or "Traceback (most recent call last)" in out:
        problem = f"exit {result.returncode} (documented {here.rc})"
    elif here.says.format_map(work) not in out:
        problem = f"expected {here.says.format_map(work)!r} in its output"
    elif here.check:
        try:
            here.check(work, out)
        except Exception as e:  # noqa: BLE001 - every failure of every command, reported at once
            problem = f"what it wrote: {type(e).__name__}: {e}"
    return problem and f"ran: {line}\n  {problem}\n{out[-3000:]}"


def run_group(group: str, work: Work) -> None:
    """The group's commands in README order (a command that reads another's output comes after it), each checked
    for its exit status, its line and what it writes; every failure reported at once."""
    failures = [f"{readme}\n  {problem}" for readme in readme_commands()
                if isinstance(here := COMMANDS.get(readme), Here) and here.group == group
                and (problem := run_checked(here, work))]
    assert not failures, "\n\n".join(failures)


def test_every_test_the_readme_names_exists():
    """The README's "tested by" and "shown by" columns point at tests/<path>[::name]: each must be there."""
    missing = []
    for path, name in re.findall(r"`((?:[\w]+/)+test_\w+\.py)(?:::(\w+))?`", README.read_text()):
        file = REPO / "tests" / path.removeprefix("tests/")
        if not file.is_file() or (name and not re.search(rf"^(async )?def {name}\(", file.read_text(), re.M)):
            missing.append(f"{path}::{name}" if name else path)
    assert not missing, missing
