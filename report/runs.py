"""A run dir, read for the report: metrics by step, evals, restarts, checkpoints, the plan.

Everything comes from what the run itself wrote (``rundir``'s layout): the
resolved ``recipe.toml``, ``metrics.jsonl``, ``evals/step-N.json``, the launch
records (``launcher/attempts.jsonl`` from the launchers, ``launches/NNN/``
from every start) and the checkpoints. Tokens are ``step x tokens per
step`` of the recipe, not torchtitan's ``n_tokens_seen``, whose per-rank part
is restored as saved: a run resumed on another world size would count wrong.
Unreadable files raise ``ReportError`` naming the file (and line).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import rundir
from train.metric_names import LAUNCH, PARAMETERS



class ReportError(ValueError):
    """A run dir the report cannot read; the message names the file."""


@dataclass
class Restart:
    step: int  # the step training went on from
    cause: str  # "preempted", "crash", "restart" (why is not recorded) or "rollback" (health.rollback)
    time: str | None = None


@dataclass
class Run:
    path: Path
    recipe: dict  # the resolved recipe.toml as TOML
    rows: dict[int, dict]  # step -> every metric logged for it (a replayed step: the latest values)
    evals: dict[int, dict]  # step -> evals/step-N.json
    restarts: list[Restart]
    offset: int = 0  # tokens before step 0 (phase 2 after phase 1)
    started_from: tuple[Run, int] | None = None  # the listed run and its step this one started from
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.recipe.get("run", {}).get("name") or self.path.name

    @property
    def seq_len(self) -> int:
        return self.recipe["training"]["seq_len"]

    @property
    def tokens_per_step(self) -> int:
        t = self.recipe["training"]
        return t["global_batch"] * t["seq_len"]

    @property
    def planned_steps(self) -> int:
        return self.recipe["training"]["steps"]

    @property
    def last_step(self) -> int:
        return max(self.rows, default=0)

    def tokens(self, step: float) -> float:
        return self.offset + step * self.tokens_per_step

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, in step order."""
        pairs = [(s, _number(r[key])) for s, r in sorted(self.rows.items()) if key in r]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def keys(self, prefix: str) -> list[str]:
        return sorted({k for r in self.rows.values() for k in r if k.startswith(prefix)})

    def eval_series(self, key: str) -> tuple[list[int], list[float]]:
        pairs = [(s, _number(e["metrics"][key])) for s, e in sorted(self.evals.items()) if key in e["metrics"]]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def eval_keys(self, prefix: str) -> list[str]:
        return sorted({k for e in self.evals.values() for k in e["metrics"] if k.startswith(prefix)})

    def planned_shares(self) -> dict[str, float]:
        """Each source's planned share of the tokens: its weight's share, or its token budget's."""
        sources = self.recipe["data"]["sources"]
        total = self.planned_steps * self.tokens_per_step
        weights = sum(s.get("weight") or 0.0 for s in sources)
        budgets = sum(s.get("tokens") or 0 for s in sources)
        free = max(0.0, 1 - budgets / total) if total else 0.0  # what weighted sources share
        return {s["name"]: (s["tokens"] / total if s.get("tokens") else free * s["weight"] / weights)
                for s in sources}


def _number(value) -> float:
    """A metric value; MetricsJsonl writes non-finite floats as strings ("nan", "inf")."""
    return float(value)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ReportError(f"{path}: not valid JSON: {e}") from None


def read_run(path: Path) -> Run:
    """Read one run dir; raises ReportError naming the file that cannot be read."""
    path = Path(path)
    recipe_file = path / rundir.RECIPE_FILE
    if not recipe_file.is_file():
        raise ReportError(f"{recipe_file}: not found: {path} is not a run dir (train.py writes it at launch)")
    try:
        recipe = rundir.recorded_recipe(path)  # the one raw reader of a run's recipe.toml
    except tomllib.TOMLDecodeError as e:
        raise ReportError(f"{recipe_file}: not valid TOML: {e}") from None
    for table, key in (("training", "global_batch"), ("training", "seq_len"), ("training", "steps"),
                       ("data", "sources")):
        if key not in recipe.get(table, {}):
            raise ReportError(f"{recipe_file}: [{table}] {key}: missing (not a recipe train.py resolved)")
    try:
        rows: dict[int, dict] = {}
        for row in rundir.read_metrics(path):
            rows.setdefault(row["step"], {}).update(row)
        attempts = rundir.read_jsonl(rundir.attempts_file(path))
    except (ValueError, KeyError) as e:
        raise ReportError(str(e) if isinstance(e, ValueError) else f"{path / rundir.METRICS_FILE}: a row without "
                          f"{e}") from None
    evals = {step: _read_json(f) for step, f in rundir.eval_files(path).items()}
    from health.rollback import read_rollbacks

    rollbacks = [Restart(r["to_step"], "rollback", r["time"]) for r in read_rollbacks(path)]
    run = Run(path, recipe, rows, evals, sorted(restarts(attempts, rows) + rollbacks, key=lambda r: r.step))
    if any("mfu(%)" not in r for r in rows.values() if "throughput(tps)" in r):
        run.notes.append("MFU: not logged (torchtitan logs it on GPUs only)")
    return run


def restarts(attempts: list[dict], rows: dict[int, dict]) -> list[Restart]:
    """Every start after the first. Where it is: the launch number the report callback logs at each
    process's first step (every launcher, plain torchrun too), else the launchers' start records;
    why: the launchers' record of how the start before it ended (preempted, crash), if any."""
    recorded, cause, starts = [], None, 0
    for event in attempts:
        if event.get("event") == "end":
            cause = event.get("cause")
        elif event.get("event") == "start":
            starts += 1
            if starts > 1:
                recorded.append(Restart(event["step"], cause if cause in ("preempted", "crash", "stall") else "restart",
                                        event.get("time")))
            cause = None
    logged = [step - 1 for step, r in sorted(rows.items()) if r.get(LAUNCH, 1) > 1]
    if not logged:
        return recorded
    why = {r.step: r for r in recorded}
    return [why.get(step, Restart(step, "restart")) for step in logged]


def continue_runs(runs: list[Run]) -> None:
    """Put a run that started from another listed run's checkpoint (phase 2 from phase 1)
    after it on the token axis, and remember where it started (the phase comparison's before)."""
    by_path = {r.path.resolve(): r for r in runs}
    for run in runs:
        source = run.recipe.get("checkpoint", {}).get("init_from")
        if not source:
            continue
        source = Path(source).resolve()
        step = rundir.step_number(source)
        parent = by_path.get(source) or (by_path.get(source.parent.parent) if step is not None else None)
        if parent is not None and parent is not run:
            at = step if step is not None else (rundir.latest_complete_step(parent.path) or parent.last_step)
            run.offset = int(parent.tokens(at))
            run.started_from = (parent, at)


def header(run: Run) -> list[tuple[str, str]]:
    """The facts at the top of the report, (name, value) in order."""
    path = run.path
    first_line = (path / rundir.RECIPE_FILE).read_text().splitlines()[0]
    source = first_line.removeprefix("# resolved from ").strip() if first_line.startswith("#") else ""
    launches = sorted(p for p in (path / rundir.LAUNCHES_DIR).glob("[0-9]*") if p.is_dir())
    commit = "unknown"
    if launches:
        last = launches[-1]
        if (last / rundir.GIT_COMMIT_FILE).exists():
            commit = (last / rundir.GIT_COMMIT_FILE).read_text().strip()[:12]
        if (last / rundir.GIT_STATUS_FILE).exists() and (last / rundir.GIT_STATUS_FILE).read_text().strip():
            commit += f" + uncommitted changes ({last.relative_to(path) / rundir.GIT_DIFF_FILE})"
    step, planned = run.last_step, run.planned_steps
    seen, total = run.tokens(step) - run.offset, planned * run.tokens_per_step
    steps = rundir.complete_steps(path)
    milestones = sorted(set(run.recipe.get("checkpoint", {}).get("milestones", [])) & set(steps))
    export = Path(run.recipe.get("checkpoint", {}).get("export_dir") or path / rundir.EXPORT_DIR)
    eta = "finished" if step >= planned else "unknown"
    if step < planned and (eta_s := run.series("progress/eta_s")[1]):
        eta = _duration(eta_s[-1]) + " (at the last logged step)"
    return [
        ("recipe", f"{run.name} ({source})" if source else run.name),
        ("commit", commit),
        ("parameters", parameters(run)),
        ("tokens seen", f"{_human(seen)} of {_human(total)} planned ({seen / total:.1%}); step {step:,} of "
                        f"{planned:,}" if total else "unknown"),
        ("wall time", wall_time(path, launches)),
        ("ETA", eta),
        ("launches", f"{len(launches)}; restarts: {len(run.restarts)}"
                     + "".join(f", {r.cause} at step {r.step}" for r in run.restarts[:10])),
        ("goodput", goodput(path)),
        ("latest checkpoint", f"step {steps[-1]:,} ({rundir.step_dir(path, steps[-1])})" if steps else "none"),
        ("milestone checkpoints", ", ".join(f"step {s:,}" for s in milestones) or "none"),
        ("last export", f"{export} ({_mtime(export / 'config.json')})" if (export / "config.json").exists()
                        else "none"),
        ("decontamination", decontamination(run)),
    ]


def decontamination(run: Run) -> str:
    """Documents each source's tokenization dropped as benchmark overlap, by its manifest (data.decontaminate)."""
    from data.shards import ShardError, load_manifest

    sources, done = run.recipe["data"]["sources"], []
    for source in sources:
        path = Path(source["path"]) if Path(source["path"]).is_absolute() else rundir.REPO / source["path"]
        try:
            entry = load_manifest(path).get("decontamination")
        except ShardError:  # not on this machine: say so rather than "none"
            done.append(f"{source['name']}: no manifest here")
            continue
        if entry:
            dropped = ", ".join(f"{b} {n:,}" for b, n in entry["dropped"].items())
            done.append(f"{source['name']}: {dropped} documents dropped ({entry['n_grams']}-grams)")
    return "; ".join(done) or f"none of the {len(sources)} sources"


def goodput(path: Path) -> str:
    """Productive training over wall time since the first launch, and what each cause cost (health.goodput)."""
    from health.goodput import lines

    text = " ".join(line.strip() for line in lines(path)[:2]).removeprefix("goodput: ")
    return text or "unknown (no launcher record)"


def parameters(run: Run) -> str:
    """The model's parameter count: as the run logged it, else (a run from before the report
    callback) from laneformer_config.json on the meta device."""
    if logged := run.series(PARAMETERS)[1]:
        return f"{int(logged[-1]):,}"
    path = run.path
    try:
        import torch

        from models.laneformer import read_native_config

        with torch.device("meta"):
            model = read_native_config(path).build()
        return f"{sum(p.numel() for p in model.parameters()):,}"
    except Exception as e:  # a config of another version: the report still goes on
        return f"unknown ({path / rundir.MODEL_CONFIG_FILE}: {type(e).__name__}: {e})"


def wall_time(path: Path, launches: list[Path]) -> str:
    """From the first launch's start to the last metric written."""
    metrics = path / rundir.METRICS_FILE
    if not launches or not (launches[0] / rundir.STARTED_FILE).exists() or not metrics.exists():
        return "unknown"
    start = datetime.fromisoformat((launches[0] / rundir.STARTED_FILE).read_text().strip())
    return _duration(metrics.stat().st_mtime - start.timestamp()) + " (the first launch to the last metric)"


def _mtime(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "unknown"
    s = max(0, round(seconds))
    days, s = divmod(s, 86400)
    return (f"{days}d " if days else "") + f"{s // 3600}h {s // 60 % 60:02d}m {s % 60:02d}s"


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"
