"""Ablation sweeps: a grid of recipe variants x seeds, each an ordinary run, started by the launchers.

    python -m launch.sweep SWEEP.toml [--dry-run [--gpus N --gpu h100]] [--nproc N] [--parallel K]
    python -m launch.sweep SWEEP.toml --slurm [--partition P --account A --time T --nodes N
                                              --gpus-per-node G --nproc-per-node R --slurm-arg=ARG ...]

The sweep file (``recipes/sweeps/*.toml``)::

    name = "dtp"                         # optional: the file's stem
    recipe = "phase1.toml"               # the base recipe
    seeds = [1, 2, 3]                    # run.seed of each repeat
    baseline = { "model.delay" = 0 }     # the variant every other is compared with
    [set]                                # fixed overrides, the --set grammar (dotted or quoted keys)
    training.total_tokens = 2_000_000_000
    [vary]                               # axes: the grid is their product
    model.delay = [0, 1, 2]

``[[vary]]`` (several tables) makes the union of their grids, each at the base
values of the keys it does not vary: one axis at a time around a baseline
costs far less than the full product. Variants that come out equal are run once.

Each variant x seed is a run of train.py in ``runs/sweeps/<name>/<variant>-seed<k>/``
(``--root`` moves ``runs/sweeps/<name>``), started through ``launch.local`` (one
after another, or ``--parallel K`` at once) or ``launch.slurm submit`` (a job
per run); their requeue, resume and crash rules apply unchanged. A variant is
named by the values that differ from the baseline's (``delay=2,late_mode=flush``);
the baseline by its own (``delay=0``).

Before anything is written every variant passes train.py's preflight on the
launch's world size; an invalid one is refused naming the variant and the key
(exit 2, no sweep dir, no run dir). Running the command again starts only the
runs that are not done and not running, and prints done/running/left.
``sweep.json`` in the sweep dir records the grid, each run's dir and state;
``python -m train.report SWEEP_DIR`` compares the runs (train/report/sweep.py).
``--dry-run`` prints the grid and the runs' states; with ``--gpus N``, each
variant's memory plan and roofline tokens/s on N GPUs of kind ``--gpu``
(train/plan, as ``train.py --plan``) and the GPU-hours of every run and the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.attempts import history, job_info
from rundir import REPO, parse_set
from train import recipe as R
from train.exits import Exit
from train.plan.gpus import GPUS
from train.report.sweep import SWEEP_FILE

RESERVED = ("run.output_dir", "run.seed", "run.name")  # the sweep sets these for every run
KEYS = {"name", "recipe", "seeds", "baseline", "set", "vary"}


class SweepError(ValueError):
    """A sweep file or variant problem, naming the file (and variant, key)."""


@dataclass
class Sweep:
    path: Path
    name: str
    recipe: str
    seeds: list[int]
    baseline: dict[str, Any]
    sets: dict[str, Any]  # [set] plus the command line's --set, flattened to dotted keys
    grids: list[dict[str, list]]  # [vary], or each [[vary]]


@dataclass
class Variant:
    declared: dict[str, Any]  # the axis values this variant sets
    values: dict[str, Any] = field(default_factory=dict)  # every axis key's value as the run resolves it
    name: str = ""
    recipe: R.Recipe | None = None
    config: Any = None  # the model config, None when the model's checks failed


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"delay": 2}}`` and ``{"model.delay": 2}`` alike as ``{"model.delay": 2}``."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_sweep(path: str | Path, extra_sets: list[str] = ()) -> Sweep:
    """The sweep file, checked: every problem names the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: sweep file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    R.check_keys(raw, KEYS, path, "sweep")  # a RecipeError naming the file and the closest key
    for key in ("recipe", "seeds", "vary"):
        if key not in raw:
            raise SweepError(f"{path}: missing key '{key}'")
    for key in ("set", "baseline"):
        if not isinstance(raw.get(key, {}), dict):
            raise SweepError(f"{path}: {key}: expected a table")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise SweepError(f"{path}: name: expected letters, digits, '.', '_' or '-', got {name!r}")
    seeds = raw["seeds"]
    if not (isinstance(seeds, list) and seeds and all(type(s) is int for s in seeds) and len(set(seeds)) == len(seeds)):
        raise SweepError(f"{path}: seeds: expected a non-empty list of distinct integers, got {seeds!r}")
    sets = _flatten(raw.get("set", {}))
    for item in extra_sets:
        try:
            key, value = parse_set(item)
        except ValueError as e:
            raise SweepError(f"--set: {e}") from None
        sets[key] = value
    vary = raw["vary"]
    if not all(isinstance(g, dict) for g in (vary if isinstance(vary, list) else [vary])):
        raise SweepError(f"{path}: vary: expected a table [vary] or tables [[vary]]")
    grids = [_flatten(g) for g in (vary if isinstance(vary, list) else [vary])]
    for i, grid in enumerate(grids):
        where = f"{path}: [vary]" if not isinstance(vary, list) else f"{path}: [[vary]] #{i + 1}"
        if not grid:
            raise SweepError(f"{where}: no axes")
        for key, values in grid.items():
            if not (isinstance(values, list) and values):
                raise SweepError(f"{where} {key}: expected a non-empty list of values, got {values!r}")
    axes = {k for g in grids for k in g}
    for key in (*sets, *axes):
        if key in RESERVED:
            raise SweepError(f"{path}: {key}: set by the sweep for every run (its dir, seed and name)")
        if "." not in key:
            raise SweepError(f"{path}: {key}: expected table.key")
    baseline = _flatten(raw.get("baseline", {}))
    if not baseline:
        raise SweepError(f"{path}: baseline: missing, e.g. baseline = {{ \"{sorted(axes)[0]}\" = ... }}")
    for key in baseline:
        if key not in axes:
            raise SweepError(f"{path}: baseline: {key} is not an axis of [vary] ({', '.join(sorted(axes))})")
    if not isinstance(raw["recipe"], str):
        raise SweepError(f"{path}: recipe: expected a recipe file or a name in recipes/, got {raw['recipe']!r}")
    recipe = str(R.find(raw["recipe"]).resolve())  # the launchers run in the repo, wherever this ran
    return Sweep(path, name, recipe, seeds, baseline, sets, grids)


def set_args(values: dict[str, Any]) -> list[str]:
    """``key=value`` items in the --set grammar (a JSON scalar or list is a TOML value)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def _value(recipe: R.Recipe, config, key: str, declared: Any) -> Any:
    """What the run will use for ``key``: a model field from the built config, a recipe value from
    the resolved recipe; the declared value where neither holds it."""
    table, _, name = key.partition(".")
    if table == "model" and name != "flavor" and config is not None and hasattr(config, name):
        return getattr(config, name)
    obj: Any = recipe
    for part in key.split("."):
        obj = obj.get(part, declared) if isinstance(obj, dict) else getattr(obj, part, declared)
    return obj


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text.replace("/", "_")


def variants(sweep: Sweep, world: int, root: Path) -> tuple[list[Variant], str]:
    """Every distinct variant, loaded and preflighted as train.py would on ``world`` ranks, and the
    problems of those that fail (each named by its values and the failing key; "" if none). A variant
    whose recipe does not load is left out; one that loads but fails a check is kept, with its problems,
    so a dry run can still plan it."""
    from train.build import preflight

    found: dict[tuple, Variant] = {}
    problems = []
    axes = list(dict.fromkeys(k for g in sweep.grids for k in g))
    for grid in sweep.grids:
        for combo in itertools.product(*grid.values()):
            declared = dict(zip(grid, combo))
            label = ",".join(f"{k}={_text(v)}" for k, v in declared.items())
            sets = set_args({**sweep.sets, **declared, "run.output_dir": str(root)})
            try:
                recipe = R.load(sweep.recipe, sets)
                checked = preflight(recipe, world)
            except R.RecipeError as e:
                problems.append((label, [str(e)]))
                continue
            v = Variant(declared, recipe=recipe, config=checked.config)
            v.values = {k: _value(recipe, checked.config, k, declared.get(k)) for k in axes}
            key = tuple(json.dumps(v.values[k]) for k in axes)
            if key in found:  # the same run as an earlier grid's
                continue
            found[key] = v
            if checked.problems:
                problems.append((label, checked.problems))
    out = list(found.values())
    if out:
        name_variants(sweep, out, axes)
    return out, _problem_text(sweep, problems) if problems else ""


def _problem_text(sweep: Sweep, problems: list[tuple[str, list[str]]]) -> str:
    """Problems every variant shares once (missing data, a tokenizer), the rest per variant."""
    common = set(problems[0][1]).intersection(*(set(p) for _, p in problems)) if len(problems) > 1 else set()
    lines = [f"{sweep.path}: {len(problems)} variant(s) refused"]
    if common:
        lines += ["every refused variant:", *(f"  {p}" for p in problems[0][1] if p in common)]
    for label, probs in problems:
        own = [p for p in probs if p not in common]
        lines += [f"variant {label}:", *(f"  {p}" for p in own)] if own else []
    return "\n".join(lines)


def name_variants(sweep: Sweep, found: list[Variant], axes: list[str]) -> None:
    """Names from the values that differ from the baseline's (the baseline: its own values).
    A key is shown by its last part unless two axes share it."""
    last = [k.rsplit(".", 1)[-1] for k in axes]
    short = {k: (s if last.count(s) == 1 else k) for k, s in zip(axes, last)}
    base = [v for v in found if all(v.values[k] == val for k, val in sweep.baseline.items())]
    if len(base) != 1:
        what = ", ".join(f"{k}={_text(v)}" for k, v in sweep.baseline.items())
        raise SweepError(f"{sweep.path}: baseline: {what} matches {len(base)} variants; it must name exactly one "
                         "(add the keys that tell them apart)")
    for v in found:
        keys = list(sweep.baseline) if v is base[0] else [k for k in axes if v.values[k] != base[0].values[k]]
        v.name = ",".join(f"{short[k]}={_text(v.values[k])}" for k in keys)
    found.sort(key=lambda v: v is not base[0])  # the baseline first


@dataclass
class RunSpec:
    variant: Variant
    seed: int
    dir: Path

    @property
    def label(self) -> str:
        return self.dir.name

    def sets(self, sweep: Sweep) -> list[str]:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{sweep.name}-{self.label}")
        return set_args({**sweep.sets, **self.variant.declared, "run.output_dir": str(self.dir),
                         "run.seed": self.seed, "run.name": name})


def runs_of(found: list[Variant], sweep: Sweep, root: Path) -> list[RunSpec]:
    """Seed by seed, so a sweep cut short has every variant at its first seeds."""
    return [RunSpec(v, seed, root / f"{v.name}-seed{seed}") for seed in sweep.seeds for v in found]


# ---- states ------------------------------------------------------------------------------------


def _alive(job: str) -> bool:
    """Whether the launcher that recorded ``job`` still runs: launch.local's process
    (``local-<pid>``), or a SLURM job the controller has queued or running."""
    if job.startswith("local-"):
        try:
            cmdline = Path(f"/proc/{int(job.removeprefix('local-'))}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False
        return b"launch.local" in cmdline
    from launch.slurm import ACTIVE

    return job_info(job).get("JobState") in ACTIVE


def state(run: Path) -> str:
    """done, running (its launcher is alive: a local process, a queued or running job), failed
    (the launcher gave up; a rerun tries again) or left (not started, or its launcher stopped:
    a rerun resumes it), from the launchers' own records (launch/attempts.py, launcher/jobs)."""
    from launch.slurm import job_ids

    events, jobs = history(run), job_ids(run)
    last = events[-1] if events else None
    if last and last["event"] == "end" and last["action"] == "done":
        return "done"
    job = jobs[-1] if jobs else (last["job"] if last else None)
    if job and _alive(job):
        return "running"
    return "failed" if last and last["event"] == "end" and last["action"] == "fail" else "left"


def write_record(root: Path, sweep: Sweep, found: list[Variant], runs: list[RunSpec], states: dict[Path, str],
                 launcher: str) -> None:
    """``sweep.json``: the grid, each run's dir (relative to the sweep dir) and state."""
    record = {
        "name": sweep.name, "file": str(sweep.path.resolve()), "recipe": sweep.recipe, "set": sweep.sets,
        "vary": sweep.grids, "seeds": sweep.seeds, "baseline": found[0].name, "launcher": launcher,
        "variants": [{"name": v.name, "values": v.values, "set": v.declared} for v in found],
        "runs": [{"variant": r.variant.name, "seed": r.seed, "run_dir": r.dir.name, "state": states[r.dir]}
                 for r in runs],
    }
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(root / SWEEP_FILE)


def tally(states: dict[Path, str]) -> str:
    counts = {s: sum(1 for x in states.values() if x == s) for s in ("done", "running", "failed", "left")}
    return ", ".join(f"{n} {s}" for s, n in counts.items() if n or s in ("done", "running", "left"))


# ---- launching ---------------------------------------------------------------------------------


def local_command(sweep: Sweep, run: RunSpec, nproc: int) -> list[str]:
    return [sys.executable, "-m", "launch.local", "--recipe", sweep.recipe, "--nproc", str(nproc),
            *(f"--set={s}" for s in run.sets(sweep))]


def slurm_command(sweep: Sweep, run: RunSpec, args) -> list[str]:
    opts = [f"--{k.replace('_', '-')}={v}" for k in ("partition", "account", "time", "nodes", "gpus_per_node",
                                                      "nproc_per_node") if (v := getattr(args, k)) is not None]
    return [sys.executable, "-m", "launch.slurm", "submit", "--recipe", sweep.recipe, *opts, *args.slurm_arg,
            *(f"--set={s}" for s in run.sets(sweep))]


def launch_local(todo: list[RunSpec], sweep: Sweep, args, root: Path, on_change) -> int:
    """launch.local per run, ``--parallel`` at once; each run's output in ``logs/<run>.log``."""
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    pending, active, failed = list(todo), {}, 0
    while pending or active:
        while pending and len(active) < args.parallel:
            run = pending.pop(0)
            log = open(logs / f"{run.label}.log", "a")
            print(f"sweep: start {run.label} (log {log.name})", flush=True)
            active[subprocess.Popen(local_command(sweep, run, args.nproc), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)] = (run, log)
            on_change()
        time.sleep(0.5)
        for proc in [p for p in active if p.poll() is not None]:
            run, log = active.pop(proc)
            log.close()
            failed += proc.returncode != 0
            print(f"sweep: {run.label}: {state(run.dir)} (launch.local exit {proc.returncode})", flush=True)
            on_change()
    return failed


def launch_slurm(todo: list[RunSpec], sweep: Sweep, args, on_change) -> int:
    """launch.slurm submit per run (it checks, snapshots and queues; the job requeues itself)."""
    failed = 0
    for run in todo:
        out = subprocess.run(slurm_command(sweep, run, args), cwd=REPO, capture_output=True, text=True)
        said = (out.stdout.strip() if out.returncode == 0 else out.stderr.strip()) or f"exit {out.returncode}"
        print(f"sweep: {run.label}: {said}", flush=True)
        failed += out.returncode != 0
        on_change()
    return failed


# ---- dry run -----------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (header, *rows)]


def plan_lines(found: list[Variant], sweep: Sweep, gpus: int, gpu: str) -> list[str]:
    """Per variant: train/plan's memory and roofline (with communication) on ``gpus`` x ``gpu``, as
    ``train.py --plan`` computes them; GPU-hours = tokens / (tokens/s/GPU) / 3600 per run."""
    from train.plan import GIB, make_plan

    rows, total, planned = [], 0.0, 0
    for v in found:
        try:
            if v.config is None:  # the model's own checks failed: nothing to trace
                raise R.RecipeError("its model does not build")
            p = make_plan(v.recipe, gpus=gpus, gpu=gpu, with_compiled=False)
        except (R.RecipeError, ValueError) as e:
            rows.append([v.name, *"------", f"not planned: {str(e).splitlines()[0][:200]}"])
            continue
        tps, tokens = p.comm.tokens_per_s, v.recipe.training.total_tokens
        hours = tokens / tps / 3600
        total, planned = total + hours * len(sweep.seeds), planned + len(sweep.seeds)
        rows.append([v.name, f"{p.nparams:,}", f"{p.memory.peak / GIB:.1f}", "yes" if p.fits else "NO",
                     f"{tps:,.0f}", f"{p.comm.mfu:.1%}", f"{tokens:,}", f"{hours:,.2f}"])
    label = GPUS[gpu].label
    return [f"plan per run on {gpus} x {label} (train/plan, as train.py --plan: one step traced on fake tensors; "
            "eager roofline with communication):",
            *table(["variant", "parameters", "peak GiB", "fits", "tokens/s/GPU", "MFU", "tokens", "GPU-hours"], rows),
            f"sweep total: {planned} runs, {total:,.1f} GPU-hours at the roofline ({total / gpus:,.1f} h on {gpus} x "
            f"{label}, a run at a time). The roofline bounds speed from above: Kog measured ~17k tokens/s/H100 on "
            "the 2B where the plan says 32.6k (README), so budget about twice this"]


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path, help="the sweep file (recipes/sweeps/*.toml)")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="an override for every run, after the file's [set]")
    p.add_argument("--root", type=Path, help="the sweep dir (default runs/sweeps/<name> in the repo)")
    p.add_argument("--dry-run", action="store_true", help="print the grid (and with --gpus the plan); start nothing")
    p.add_argument("--gpus", type=int, help="dry run: plan each run on this many GPUs")
    p.add_argument("--gpu", default="h100", choices=list(GPUS), help="dry run: the GPU kind")
    p.add_argument("--nproc", type=int, default=1, help="local: ranks per run (launch.local --nproc)")
    p.add_argument("--parallel", type=int, default=1, help="local: runs at once")
    p.add_argument("--slurm", action="store_true", help="submit each run with launch.slurm (a job per run)")
    for name in ("partition", "account", "time"):
        p.add_argument(f"--{name}", help="slurm: passed to launch.slurm submit")
    p.add_argument("--nodes", type=int, help="slurm: nodes per run")
    p.add_argument("--gpus-per-node", type=int, help="slurm: GPUs per node (0: none)")
    p.add_argument("--nproc-per-node", type=int, help="slurm: ranks per node")
    p.add_argument("--slurm-arg", action="append", default=[], metavar="ARG",
                   help="slurm: any other launch.slurm submit option, e.g. --slurm-arg=--no-exclusive")
    return p.parse_args(argv)


def world_size(args) -> int:
    if args.dry_run and args.gpus:
        return args.gpus
    if args.slurm:
        return (args.nodes or 1) * (args.nproc_per_node or (8 if args.gpus_per_node is None else args.gpus_per_node))
    return args.nproc


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.parallel < 1 or args.nproc < 1:
        print("error: --parallel and --nproc must be >= 1", file=sys.stderr)
        return Exit.BAD_INPUT
    try:
        sweep = read_sweep(args.sweep, args.set)
        root = (args.root or REPO / "runs" / "sweeps" / sweep.name).resolve()
        found, problems = variants(sweep, world_size(args), root)
    except (SweepError, R.RecipeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return Exit.BAD_INPUT
    if problems and not args.dry_run or not found:  # before anything is written
        print(f"error: {problems}\nnothing was started or written", file=sys.stderr)
        return Exit.BAD_INPUT
    runs = runs_of(found, sweep, root)
    states = {r.dir: state(r.dir) for r in runs}
    axes = list(dict.fromkeys(k for g in sweep.grids for k in g))
    print(f"sweep {sweep.name}: {sweep.recipe}, {len(found)} variants x {len(sweep.seeds)} seeds = {len(runs)} runs "
          f"in {root}; baseline {found[0].name}")
    print("\n".join(table(["variant", *axes], [[v.name, *(_text(v.values[k]) for k in axes)] for v in found])))
    print("runs: " + tally(states))
    if args.dry_run:
        print("\n".join(f"  {r.label}: {states[r.dir]}" for r in runs))
        if args.gpus:
            print("\n".join(plan_lines(found, sweep, args.gpus, args.gpu)))
        if problems:  # as train.py --dry-run: the plan, then the verdict a launch would give
            print(f"error: {problems}", file=sys.stderr)
            return Exit.BAD_INPUT
        print("checks: every variant passed; a launch would start " + str(sum(
            s not in ("done", "running") for s in states.values())) + " runs")
        return Exit.DONE
    launcher = "slurm" if args.slurm else "local"

    def on_change():
        states.update({r.dir: state(r.dir) for r in runs})
        write_record(root, sweep, found, runs, states, launcher)

    todo = [r for r in runs if states[r.dir] not in ("done", "running")]
    on_change()
    print(f"starting {len(todo)}: {', '.join(r.label for r in todo) or 'nothing'}", flush=True)
    failed = launch_slurm(todo, sweep, args, on_change) if args.slurm else launch_local(todo, sweep, args, root,
                                                                                         on_change)
    on_change()
    print("runs: " + tally(states))
    if all(s == "done" for s in states.values()):
        print(f"compare: python -m train.report {root}")
    return 1 if failed else Exit.DONE


if __name__ == "__main__":
    sys.exit(main())
