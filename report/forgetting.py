"""The forgetting trade-off, drawn: a phase-2 sweep's variants on one plane with the phase-1 checkpoint
they started from and merges between the two, the Pareto front marked.

    python -m report.forgetting SWEEP_DIR [--merge-weights 0,0.25,0.5,0.75,1 | --no-merges]
                                [--merge-run RUN] [--general SET,... --code SET,...] [--device D] [--out DIR]

writes into ``SWEEP_DIR/forgetting/`` (or ``--out``) ``report.html`` with ``forgetting.png`` and the numbers
it drew embedded (``report.page.embedded_data``), ``forgetting.csv`` (a row a point), and prints the table.

Why: phase 2 trains on a code-heavy mix, and the general skills phase 1 taught lag behind (Kog's release says
so of the 2B). Two remedies cost nothing but a choice: keep a share of phase 1's data in phase 2 (replay: a
sweep over that share, e.g. ``recipes/sweeps/tiny-replay.toml``), and average phase 1's and phase 2's final
weights (``models.laneformer.merge``). Both buy general loss with code loss; the plane shows the price.

The plane: x is the held-out loss on the general sets, y on the phase-2 sets, both ``eval/val_loss/<set>`` as
the training loop scores them (lower is better; over several sets of one side: their plain mean). A set is a
phase-2 set when phase 2's mix (the sweep's baseline variant) gives its source a larger share than phase 1's
does, else general; ``--general``/``--code`` name them instead. Only sets every point was scored on are used.
A second panel puts CORE (higher is better) on x where every drawn point has it (the runs' ``[eval]
core_bundle``: merges are then scored on the same bundle and item count); nothing is drawn for CORE otherwise.

The points:

- each variant of the sweep at the token count every run reached with ``eval/val_loss`` (report.sweep's
  compared count; a run's value there logged or interpolated), the mean over its seeds (the seeds drawn
  small), labelled by its replay share where its mix is phase 2's moved towards phase 1's: the share ``r``
  with ``mix = (1 - r) x baseline mix + r x phase-1 mix``, source by source (else by its name);
- phase 1: the checkpoint the runs started from (``[checkpoint] init_from``, one for every run), at its own
  eval of that step (scored with ``eval.run`` when there is none);
- merges: ``python -m models.laneformer.merge`` of that checkpoint and one phase-2 run's latest checkpoint
  (``--merge-run``: a run dir's or a variant's name; default the baseline variant's first seed), ``w`` the
  phase-2 weight (0: phase 1's weights, 1: the phase-2 run's), each written as an HF export into
  ``OUT/merges/w<w>/`` and scored with ``python -m eval.run --loss-by-position 1 --held-out NAME=DIR``
  per set (one bucket of the run's seq_len over its first val_samples rows: the loop's number, the same
  rows, eval.position_loss), its output in ``OUT/merges/w<w>.log``. ``OUT/merges/w<w>.json`` keeps the
  scores with the checkpoints and weights they came from; a later report reuses them while those match.

A point is on the Pareto front when no other point is at least as good on both axes and better on one
(the seeds' own points are not candidates: their variant's mean is). Bad input or an unreadable sweep: exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import html
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import rundir
from rundir.table import text_table
from train.metric_names import VAL_LOSS, per_set
from report.runs import ReportError, Run, read_run
from report.sweep import SweepRun, common_tokens, read_sweep, value_at

FIGURE = "forgetting"
POINTS_FILE = "forgetting.csv"
MERGES_DIR = "merges"
MERGE_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
COLORS = ["C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9"]  # the variants' (red marks the front, gray the merges)
POINT_FIELDS = ["label", "kind", "general", "code", "core", "on_front", "on_core_front", "replay", "weight", "source"]


@dataclass
class Point:
    label: str
    kind: str  # "phase 1", "variant", "seed" (one seed of a variant of several), "merge"
    general: float  # held-out loss on the general sets (their mean)
    code: float  # ... on the phase-2 sets
    core: float | None = None  # the CORE average where scored
    replay: float | None = None  # a variant's share of phase 1's mix
    weight: float | None = None  # a merge's phase-2 weight
    source: str = ""  # the run dir or checkpoint it was scored from
    on_front: bool = False
    on_core_front: bool = False
    sets: dict[str, float] = field(default_factory=dict)  # each set's loss


@dataclass
class Plane:
    points: list[Point]
    general: list[str]  # the general sets
    code: list[str]  # the phase-2 sets
    tokens: int  # the phase-2 token count the variants are read at
    phase1: str  # "<run> step N"
    core_key: str | None = None  # the CORE metric drawn, if every point has it
    notes: list[str] = field(default_factory=list)


# ---- the rules ---------------------------------------------------------------------------------


def pareto_front(values: list[tuple[float, ...]], higher_is_better: tuple[bool, ...]) -> list[bool]:
    """Whether each point is on the front: no other point is at least as good on every axis and better on
    one. Equal points do not dominate each other (both stay on the front)."""
    signs = [-1.0 if h else 1.0 for h in higher_is_better]  # minimise every axis
    keyed = [tuple(s * v for s, v in zip(signs, p)) for p in values]

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [not any(dominates(other, p) for j, other in enumerate(keyed) if j != i) for i, p in enumerate(keyed)]


def replay_share(mix: dict[str, float], base: dict[str, float], phase1: dict[str, float]) -> float | None:
    """The share ``r`` of phase 1's mix in ``mix``: ``mix = (1 - r) x base + r x phase1`` source by source
    (a source a mix lacks: share 0), or None when ``mix`` is not on that line (within 1e-6) or the two ends
    are one mix."""
    names = sorted(set(mix) | set(base) | set(phase1))
    d = [phase1.get(n, 0.0) - base.get(n, 0.0) for n in names]
    m = [mix.get(n, 0.0) - base.get(n, 0.0) for n in names]
    norm = sum(x * x for x in d)
    if norm < 1e-12:
        return None
    r = sum(x * y for x, y in zip(m, d)) / norm
    return r if max(abs(x - r * y) for x, y in zip(m, d)) <= 1e-6 else None


def split_sets(sets: list[str], phase1: dict[str, float], phase2: dict[str, float]) -> tuple[list[str], list[str]]:
    """(general, phase-2) sets: a set is phase 2's when its source's planned share in phase 2 exceeds its share
    in phase 1 (a source a mix lacks: 0; a held-out folder that is no source: general)."""
    code = [s for s in sets if phase2.get(s, 0.0) > phase1.get(s, 0.0) + 1e-12]
    return [s for s in sets if s not in code], code


def validation_sets(recipe: dict) -> dict[str, str]:
    """The held-out sets a run validated on, from its resolved recipe.toml (paths absolute): each source
    with a held_out, named as the source (``<path>/held_out``), then each ``[eval] val_sources`` folder by
    its name: train.recipe.validation_sets' rule, read back from what the run recorded."""
    from data.held_out import held_out_dir

    sets = {s["name"]: str(held_out_dir(s["path"])) for s in recipe["data"]["sources"] if s.get("held_out")}
    sets.update({Path(v).name: v for v in recipe.get("eval", {}).get("val_sources", [])})
    return sets


# ---- the points --------------------------------------------------------------------------------


def core_key_of(names: list) -> str | None:
    """The CORE average every one of ``names`` (metric names, or dicts of metrics) has (eval.core:
    ``core/CORE_<v>``, else the partial one), or None."""
    common = set.intersection(*(set(m) for m in names)) if names else set()
    keys = sorted(k for k in common if k.startswith("core/") and "CORE_" in k)
    return next((k for k in keys if not k.startswith("core/partial")), keys[0] if keys else None)


def phase1_of(runs: list[SweepRun]) -> tuple[Path, Run | None, int | None]:
    """The checkpoint every run started from (``[checkpoint] init_from``), the run it belongs to (None: an
    import or export) and its step."""
    starts = {r.run.recipe.get("checkpoint", {}).get("init_from") for r in runs}
    if None in starts or "" in starts:
        left = [r.run.path.name for r in runs if not r.run.recipe.get("checkpoint", {}).get("init_from")]
        raise ReportError(f"not a phase-2 sweep: {', '.join(left)} started from no checkpoint ([checkpoint] init_from)")
    if len(starts) > 1:
        raise ReportError(f"the runs started from different checkpoints ({', '.join(sorted(starts))}): one phase 1 "
                          "a plane")
    source = Path(starts.pop())
    step = rundir.step_number(source)
    run_dir = rundir.run_of(source) if step is not None else (source if (source / rundir.RECIPE_FILE).is_file() else None)
    if run_dir is None or not (run_dir / rundir.RECIPE_FILE).is_file():
        return source, None, None
    if step is None:  # a run dir: its latest complete checkpoint, as train.py's init_from takes it
        step = rundir.latest_complete_step(run_dir)
    return rundir.step_dir(run_dir, step) if step is not None else source, read_run(run_dir), step


def variant_points(runs: list[SweepRun], record: dict, tokens: int, phase1_mix: dict[str, float] | None,
                   core_key: str | None) -> list[Point]:
    """Each variant at ``tokens`` (its seeds' mean), and its seeds where it has several."""
    order = [v["name"] for v in record.get("variants", [])] or list(dict.fromkeys(r.variant for r in runs))
    base = _baseline(runs, record).planned_shares()
    points = []
    for variant in order:
        seeds = [r for r in runs if r.variant == variant]
        if not seeds:
            continue
        read = [read_point(r.run, tokens, core_key) for r in seeds]
        share = replay_share(seeds[0].run.planned_shares(), base, phase1_mix) if phase1_mix else None
        label = f"replay {share:.3g}" if share is not None else variant
        common = set.intersection(*(set(s) for s, _ in read))  # the sets every seed logged
        sets = {k: statistics.fmean(s[k] for s, _ in read) for k in sorted(common)}
        cores = [c for _, c in read if c is not None]
        points.append(Point(label, "variant", 0.0, 0.0, statistics.fmean(cores) if len(cores) == len(read) else None,
                            replay=share, source=str(seeds[0].run.path) if len(seeds) == 1 else variant, sets=sets))
        if len(seeds) > 1:
            points += [Point(f"{label} seed {r.seed}", "seed", 0.0, 0.0, c, replay=share, source=str(r.run.path),
                             sets=s) for r, (s, c) in zip(seeds, read)]
    return points


def read_point(run: Run, tokens: int, core_key: str | None) -> tuple[dict[str, float], float | None]:
    """Each held-out set's loss of ``run`` at ``tokens`` (logged there or interpolated), and its CORE."""
    prefix = per_set(VAL_LOSS, "")
    names = [k.removeprefix(prefix) for k in run.keys(prefix) if "/" not in k.removeprefix(prefix)]
    sets = {n: v for n in names if (v := value_at(run, per_set(VAL_LOSS, n), tokens)[0]) is not None}
    return sets, (value_at(run, core_key, tokens)[0] if core_key else None)


def eval_metrics(run: Run, step: int) -> dict[str, float] | None:
    found = run.evals.get(step)
    return None if found is None else {k: float(v) for k, v in found["metrics"].items()}


def set_losses(metrics: dict[str, float]) -> dict[str, float]:
    prefix = per_set(VAL_LOSS, "")
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix) and "/" not in
            k.removeprefix(prefix)}


# ---- scoring a checkpoint with the existing commands --------------------------------------------


@dataclass
class Scoring:
    """How the runs scored their held-out sets (and CORE), for a checkpoint to be scored alike."""
    sets: dict[str, str]  # name -> held-out folder
    seq_len: int
    val_samples: int
    core: list[str] = field(default_factory=list)  # eval.run's CORE flags, when the runs scored CORE
    device: str | None = None

    @classmethod
    def of(cls, recipe: dict, device: str | None) -> Scoring:
        ev = recipe.get("eval", {})
        core = []
        if ev.get("core_bundle"):
            core = ["--core", ev["core_bundle"]]
            if ev.get("core_max_per_task") is not None:
                core += ["--max-per-task", str(ev["core_max_per_task"])]
            if ev.get("core_tasks"):
                core += ["--core-tasks", ",".join(ev["core_tasks"])]
        return cls(validation_sets(recipe), recipe["training"]["seq_len"], ev.get("val_samples", 64), core, device)

    def evaluate(self, checkpoint: Path, log: Path) -> dict[str, float]:
        """``eval/val_loss/<set>`` of every set (and CORE's metrics), by ``python -m eval.run`` in this process:
        ``--loss-by-position 1`` on one set at a time is that set's mean loss over its first val_samples rows
        of seq_len, as the loop scores it. Its output goes to ``log``; a failure raises ReportError naming it."""
        from eval.run import main as eval_run

        device = ["--device", self.device] if self.device else []
        metrics: dict[str, float] = {}
        with open(log, "a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            for name, folder in self.sets.items():
                args = ["--checkpoint", str(checkpoint), "--loss-by-position", "1", "--held-out", f"{name}={folder}",
                        "--seq-len", str(self.seq_len), "--val-samples", str(self.val_samples), *device]
                print(f"$ python -m eval.run {' '.join(args)}", flush=True)
                (loss,) = _run(eval_run, args, log).values()
                metrics[per_set(VAL_LOSS, name)] = loss
            if self.core:
                args = ["--checkpoint", str(checkpoint), *self.core, *device]
                print(f"$ python -m eval.run {' '.join(args)}", flush=True)
                metrics.update(_run(eval_run, args, log))
        return metrics


def _run(eval_run, args: list[str], log: Path) -> dict[str, float]:
    try:
        out = eval_run(args)
    except SystemExit as e:
        raise ReportError(f"python -m eval.run {' '.join(args)}: exit {e.code} (its output: {log})") from None
    if out is None:
        raise ReportError(f"python -m eval.run {' '.join(args)}: no result (not rank 0?)")
    return out["metrics"]


def merge_points(phase1: Path, phase2: Path, weights: list[float], scoring: Scoring, out: Path,
                 notes: list[str]) -> list[Point]:
    """A merge of ``phase1`` and ``phase2`` per weight (``w``: phase 2's), each written by
    ``models.laneformer.merge`` and scored by ``eval.run`` (Scoring.evaluate), or read back from its record
    when the same checkpoints, weights and sets made it."""
    from models.laneformer.merge import main as merge

    folder = out / MERGES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    points = []
    for w in weights:
        name = f"w{w:g}"  # a folder name transformers takes as a module name (no "=")
        record_file, export, log = folder / f"{name}.json", folder / name, folder / f"{name}.log"
        inputs = {"checkpoints": [str(phase1), str(phase2)], "weights": [1 - w, w], "sets": scoring.sets,
                  "seq_len": scoring.seq_len, "val_samples": scoring.val_samples, "core": scoring.core}
        record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        if record.get("inputs") == inputs:
            notes.append(f"merge w={w:g}: scores reused from {record_file}")
        else:
            log.write_text("")
            args = [str(export), str(phase1), str(phase2), "--weights", f"{1 - w!r},{w!r}", "--overwrite"]
            with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                print(f"$ python -m models.laneformer.merge {' '.join(args)}", flush=True)
                code = merge(args)
            if code != 0:
                raise ReportError(f"python -m models.laneformer.merge {' '.join(args)}: exit {code} (its output: {log})")
            record = {"inputs": inputs, "metrics": scoring.evaluate(export, log)}
            record_file.write_text(json.dumps(record, indent=1) + "\n")
        points.append(Point(f"merge w={w:g}", "merge", 0.0, 0.0, weight=w, source=str(export),
                            sets=set_losses(record["metrics"]), **_core(record["metrics"])))
    return points


def _core(metrics: dict[str, float]) -> dict:
    key = core_key_of([metrics])
    return {"core": metrics[key]} if key else {}


# ---- the plane ---------------------------------------------------------------------------------


def plane(folder: Path, out: Path, weights: list[float], merge_run: str | None = None,
          general: list[str] | None = None, code: list[str] | None = None, device: str | None = None) -> Plane:
    """Every point, its sets split and averaged, the fronts marked (see the module's docstring)."""
    record, runs, notes = read_sweep(Path(folder))
    checkpoint, parent, step = phase1_of(runs)
    tokens, problem = common_tokens(runs, VAL_LOSS)
    if tokens is None:
        raise ReportError(f"{folder}: no token count at which every run logged {VAL_LOSS}: {problem}")
    scoring = Scoring.of(_merge_run(runs, record, merge_run).run.recipe, device)
    logged = eval_metrics(parent, step) if parent is not None and step is not None else None
    if logged is None:
        out.mkdir(parents=True, exist_ok=True)
        notes.append(f"phase 1 ({checkpoint}) has no eval of its own at that step: scored with python -m eval.run")
        logged = scoring.evaluate(checkpoint, out / "phase1.log")
    phase1_label = f"{parent.name} step {step:,}" if parent is not None and step is not None else str(checkpoint)
    core_key = core_key_of([logged, *(r.run.keys("core/") for r in runs)])
    points = [Point(f"phase 1 ({phase1_label})", "phase 1", 0.0, 0.0, logged.get(core_key) if core_key else None,
                    source=str(checkpoint), sets=set_losses(logged))]
    points += variant_points(runs, record, tokens, parent.planned_shares() if parent is not None else None, core_key)
    if weights:
        chosen = _merge_run(runs, record, merge_run)
        latest = rundir.latest_complete_step(chosen.run.path)
        if latest is None:
            raise ReportError(f"{chosen.run.path}: no complete checkpoint to merge")
        if chosen.run.tokens(latest) != tokens:
            notes.append(f"merges use {chosen.run.path.name}'s checkpoint at step {latest:,} "
                         f"({chosen.run.tokens(latest):,.0f} tokens), the variants are read at {tokens:,}")
        points += merge_points(checkpoint, rundir.step_dir(chosen.run.path, latest), weights, scoring, out, notes)
        notes.append(f"merges: phase 1 ({phase1_label}) with {chosen.run.path.name} step {latest:,}; w is phase 2's weight")
    scored = [p for p in points if p.kind != "seed"]
    common = sorted(set.intersection(*(set(p.sets) for p in points)))
    if general or code:
        unknown = [s for s in (general or []) + (code or []) if s not in common]
        if unknown:
            raise ReportError(f"--general/--code: {', '.join(unknown)}: not a held-out set every point was scored on "
                              f"({', '.join(common)})")
        general_sets = general or [s for s in common if s not in (code or [])]
        code_sets = code or [s for s in common if s not in general_sets]
    else:
        general_sets, code_sets = split_sets(common, parent.planned_shares() if parent is not None else {},
                                             _baseline(runs, record).planned_shares())
    if not general_sets or not code_sets:
        raise ReportError(f"the held-out sets every point has ({', '.join(common) or 'none'}) do not split into general "
                          f"and phase-2 sets (general: {', '.join(general_sets) or 'none'}; phase 2: "
                          f"{', '.join(code_sets) or 'none'}): name them with --general and --code")
    for p in points:
        p.general = statistics.fmean(p.sets[s] for s in general_sets)
        p.code = statistics.fmean(p.sets[s] for s in code_sets)
    for p, on in zip(scored, pareto_front([(p.general, p.code) for p in scored], (False, False))):
        p.on_front = on
    if core_key and all(p.core is not None for p in scored):
        for p, on in zip(scored, pareto_front([(p.core or 0.0, p.code) for p in scored], (True, False))):
            p.on_core_front = on
    else:
        if core_key:
            notes.append(f"CORE ({core_key}) is not drawn: "
                         f"{', '.join(p.label for p in scored if p.core is None)} have none")
        core_key = None
    return Plane(points, general_sets, code_sets, tokens, phase1_label, core_key, notes)


def _baseline(runs: list[SweepRun], record: dict) -> Run:
    """The baseline variant's first run (its mix is phase 2's), else the first run."""
    return next((r.run for r in sorted(runs, key=lambda r: r.seed) if r.variant == record["baseline"]), runs[0].run)


def _merge_run(runs: list[SweepRun], record: dict, name: str | None) -> SweepRun:
    """The run merges take their phase-2 checkpoint from: a run dir's name, or a variant's (its first seed);
    default the baseline variant's first seed."""
    wanted = name or record["baseline"]
    found = [r for r in runs if r.run.path.name == wanted] or sorted(
        (r for r in runs if r.variant == wanted), key=lambda r: r.seed)
    if not found:
        raise ReportError(f"--merge-run {wanted}: neither a run nor a variant of the sweep "
                          f"({', '.join(r.run.path.name for r in runs)})")
    return found[0]


# ---- the table, the figure and the page --------------------------------------------------------


def lines(p: Plane) -> list[str]:
    head = (f"held-out loss (eval/val_loss/<set>, lower is better) at {p.tokens:,} phase-2 tokens; general: "
            f"{', '.join(p.general)}; phase 2: {', '.join(p.code)}; against phase 1 ({p.phase1}); "
            "front: on the Pareto front (no other point at least as good on both and better on one)")
    first = next(q for q in p.points if q.kind == "phase 1")
    header = ["point", "general", "phase 2", "general vs phase 1", "phase 2 vs phase 1",
              *(["CORE"] if p.core_key else []), "front"]
    rows = [[q.label, f"{q.general:.4f}", f"{q.code:.4f}", f"{q.general - first.general:+.4f}",
             f"{q.code - first.code:+.4f}", *([_fmt(q.core)] if p.core_key else []),
             "yes" if q.on_front else ("" if q.kind == "seed" else "no")] for q in p.points]
    return [head, *text_table(header, rows), *p.notes]


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def draw(p: Plane, out: Path):
    """forgetting.png: the loss plane (and CORE's beside it), every point labelled, the front marked."""
    from matplotlib.ticker import ScalarFormatter

    from report.figures import Drawing

    panels = [("general", f"general held-out loss ({', '.join(p.general)})", "on_front", False)]
    if p.core_key:
        panels.append(("core", f"{p.core_key} (higher is better)", "on_core_front", True))
    d = Drawing([], FIGURE, "forgetting: phase 2's held-out loss against the general one (front: red)",
                panels=len(panels), cols=len(panels), size=(6.4 * len(panels), 5.2))
    variants = [q for q in p.points if q.kind == "variant"]
    for ax, (x, xlabel, front_of, higher) in zip(d.axes, panels):
        ax.xaxis.set_major_formatter(ScalarFormatter(useOffset=False))
        ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
        for q in p.points:
            xv = getattr(q, x)
            if xv is None:
                continue
            if q.kind == "phase 1":
                ax.scatter([xv], [q.code], marker="*", s=220, color="black", zorder=4, label=q.label)
            elif q.kind == "variant":
                ax.scatter([xv], [q.code], marker="o", s=60, zorder=3, label=q.label,
                           color=COLORS[variants.index(q) % len(COLORS)])
            elif q.kind == "seed":
                parent = next((v for v in variants if q.label.startswith(v.label + " seed")), None)
                ax.scatter([xv], [q.code], marker=".", s=25, alpha=0.6,
                           color=COLORS[variants.index(parent) % len(COLORS)] if parent else "gray")
            else:
                ax.scatter([xv], [q.code], marker="D", s=36, color="tab:gray", zorder=3)
            if q.kind in ("phase 1", "variant"):
                ax.annotate(q.label, (xv, q.code), textcoords="offset points", xytext=(5, 4), fontsize=7)
        merges = sorted((q for q in p.points if q.kind == "merge" and getattr(q, x) is not None),
                        key=lambda q: q.weight or 0.0)
        for i, q in enumerate(merges):  # below and above in turn: neighbours' labels and the ends' stay apart
            ax.annotate(q.label.removeprefix("merge "), (getattr(q, x), q.code), textcoords="offset points",
                        xytext=(5, -11 if i % 2 == 0 else 5), fontsize=7, color="dimgray")
        if merges:
            ax.plot([getattr(q, x) for q in merges], [q.code for q in merges], linestyle="--", color="tab:gray",
                    linewidth=1, label="merges (w: phase 2's weight)")
        front = sorted((q for q in p.points if getattr(q, front_of)), key=lambda q: getattr(q, x), reverse=higher)
        ax.plot([getattr(q, x) for q in front], [q.code for q in front], color="tab:red", linewidth=1.2, zorder=2,
                label="Pareto front")
        ax.scatter([getattr(q, x) for q in front], [q.code for q in front], s=170, facecolors="none",
                   edgecolors="tab:red", linewidths=1.4, zorder=5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"phase-2 held-out loss ({', '.join(p.code)})")
        if higher:
            ax.invert_xaxis()  # better to the left on both panels
        ax.legend(fontsize=7, loc="best")
    d.legends = False
    d.figure.data = {"tokens": p.tokens, "general_sets": p.general, "code_sets": p.code, "phase1": p.phase1,
                     "core_key": p.core_key, "points": [point_row(q) for q in p.points],
                     "front": [q.label for q in p.points if q.on_front],
                     "core_front": [q.label for q in p.points if q.on_core_front]}
    d.figure.note = ("x: the mean loss over the general sets; y: over the phase-2 sets; variants at equal tokens; "
                     "merges: w is the phase-2 checkpoint's weight")
    return d.save(out)


def point_row(q: Point) -> dict:
    row = asdict(q)
    row.pop("sets")
    return {**row, "sets": q.sets}


def write_forgetting_report(folder: Path, out: Path | None = None, weights: list[float] = list(MERGE_WEIGHTS),
                            merge_run: str | None = None, general: list[str] | None = None,
                            code: list[str] | None = None, device: str | None = None) -> tuple[Path, list[str]]:
    """report.html, forgetting.png and forgetting.csv in ``out`` (default SWEEP_DIR/forgetting); returns the
    page and the lines printed."""
    from report.page import STYLE, data_script, figure_sections, html_table

    folder = Path(folder)
    out = Path(out) if out is not None else folder / FIGURE
    out.mkdir(parents=True, exist_ok=True)
    p = plane(folder, out, weights, merge_run, general, code, device)
    printed = lines(p)
    figure = draw(p, out)
    with open(out / POINTS_FILE, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=POINT_FIELDS)
        w.writeheader()
        for q in p.points:
            row = asdict(q)
            w.writerow({k: "" if row[k] is None else row[k] for k in POINT_FIELDS})
    name = json.loads((folder / rundir.SWEEP_FILE).read_text()).get("name", folder.name)
    table = html_table(POINT_FIELDS, [asdict(q) for q in p.points])
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>forgetting: {html.escape(name)}</title>",
             f"<style>{STYLE}</style></head><body><h1>forgetting: sweep {html.escape(name)}</h1>",
             "<pre>" + html.escape("\n".join(printed)) + "</pre>", "<h2>points</h2>", table,
             *figure_sections([figure]), data_script({FIGURE: figure.data}), "</body></html>\n"]
    page = out / rundir.REPORT_PAGE
    tmp = page.with_name(f".{rundir.REPORT_PAGE}.tmp")
    tmp.write_text("\n".join(parts))
    tmp.replace(page)
    return page, printed


# ---- the command -------------------------------------------------------------------------------


def parse_weights(text: str) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a comma-separated list of numbers") from None
    if not all(0 <= w <= 1 for w in weights):
        raise argparse.ArgumentTypeError(f"{text!r}: each weight must be in [0, 1] (phase 2's share of the merge)")
    return list(dict.fromkeys(weights))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m report.forgetting", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, metavar="SWEEP_DIR", help="a phase-2 sweep's dir (launch.sweep's sweep.json)")
    p.add_argument("--merge-weights", type=parse_weights, default=list(MERGE_WEIGHTS), metavar="W,W,...",
                   help="phase 2's weight in each merge with phase 1 (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--no-merges", action="store_true", help="draw the sweep and phase 1 only")
    p.add_argument("--merge-run", metavar="RUN", help="the phase-2 run merged: a run dir's or a variant's name "
                   "(default: the baseline variant's first seed)")
    p.add_argument("--general", type=lambda s: s.split(","), metavar="SET,...", help="the general held-out sets (x)")
    p.add_argument("--code", type=lambda s: s.split(","), metavar="SET,...", help="the phase-2 held-out sets (y)")
    p.add_argument("--device", help="where eval.run scores merges (default: CUDA when present)")
    p.add_argument("--out", type=Path, help="where report.html, forgetting.png/.csv and merges/ go "
                   "(default SWEEP_DIR/forgetting)")
    args = p.parse_args(argv)
    try:
        path, printed = write_forgetting_report(args.sweep, args.out, [] if args.no_merges else args.merge_weights,
                                                args.merge_run, args.general, args.code, args.device)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(printed))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
