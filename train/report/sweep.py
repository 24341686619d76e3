"""A sweep compared: every run at equal tokens, each variant against the baseline and seed noise.

    python -m train.report runs/sweeps/NAME [--out DIR]     (a dir with launch.sweep's sweep.json)

writes into the sweep dir (or ``--out``):

- ``comparison.csv``: a row per run, ``variant,seed,run_dir,tokens,train_loss,val_loss,val_bpb,
  tokens_per_s``, the values its ``metrics.jsonl`` holds at the compared step;
- ``summary.csv``: a row per variant, ``variant,n,val_loss_mean,val_loss_std,delta_vs_baseline,
  sigmas,verdict``;
- ``report.html``: that table, then every run's curves coloured by variant (CORE too where evaluated);

and prints the summary with the token count it compares at.

Equal tokens: the compared step is the last step at which every run logged a validation loss
(``eval/val_loss``; runs cut at different steps are compared where all have data). When some run
has no validation at all, the runs are compared on training loss at the last step every run
logged one, and the table says so (the columns keep their names).

Seed noise, honestly: a variant with losses ``x_1..x_n`` (one per seed) against the baseline's
``y_1..y_m`` differs by ``delta = mean(x) - mean(y)``; its standard error is the two-sample
one, ``se = s_p * sqrt(1/n + 1/m)``, with ``s_p`` the seed standard deviation pooled over the
two variants (``n + m - 2`` degrees of freedom); ``sigmas = delta / se``. A difference is
``within seed noise`` unless ``|sigmas|`` exceeds Student's t at 95% two-sided for those
degrees of freedom (4.30 for 2 seeds each, 2.45 for 4): with few seeds the noise estimate is
itself noisy, and a plain 2-sigma rule would call chance a result. Lower loss is better.
"""

from __future__ import annotations

import csv
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rundir import COMPARISON_FILE, RECIPE_FILE, REPORT_PAGE, SUMMARY_FILE, SWEEP_FILE
from rundir.table import text_table
from train.report.runs import ReportError, Run, read_run

TRAIN, VAL, BPB, TPS = "loss_metrics/global_avg_loss", "eval/val_loss", "eval/val_bpb", "throughput(tps)"
COMPARISON_FIELDS = ["variant", "seed", "run_dir", "tokens", "train_loss", "val_loss", "val_bpb", "tokens_per_s"]
SUMMARY_FIELDS = ["variant", "n", "val_loss_mean", "val_loss_std", "delta_vs_baseline", "sigmas", "verdict"]
# Student's t, 97.5% quantile (95% two-sided) by degrees of freedom; beyond the table: the normal's
# 1.96. Standard table values (tests/train/test_sweep_report.py checks them against scipy.stats.t).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def is_sweep(path: Path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


def t_critical(dof: int) -> float:
    """The 95% two-sided threshold for ``dof`` degrees of freedom (the next smaller tabled dof: conservative)."""
    return T_975[max(d for d in T_975 if d <= dof)] if dof <= max(T_975) else 1.96


@dataclass
class SweepRun:
    variant: str
    seed: int
    run: Run


@dataclass
class Comparison:
    step: int
    tokens: int
    metric: str  # VAL, or TRAIN when some run has no validation
    rows: list[dict]  # COMPARISON_FIELDS
    summary: list[dict]  # SUMMARY_FIELDS
    notes: list[str]


def read_sweep(folder: Path) -> tuple[dict, list[SweepRun], list[str]]:
    """sweep.json and every run that has started (read with train.report.runs); notes name the others."""
    folder = Path(folder)
    try:
        record = json.loads((folder / SWEEP_FILE).read_text())
        listed = [(r["variant"], r["seed"], folder / r["run_dir"]) for r in record["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ReportError(f"{folder / SWEEP_FILE}: not a sweep record launch.sweep wrote ({e})") from None
    runs, notes = [], []
    for variant, seed, path in listed:
        if not (path / RECIPE_FILE).is_file():
            notes.append(f"{path.name}: not started; left out")
            continue
        run = read_run(path)
        if not run.rows:
            notes.append(f"{path.name}: nothing logged yet; left out")
            continue
        runs.append(SweepRun(variant, seed, run))
    if not runs:
        raise ReportError(f"{folder}: no run of the sweep has logged anything yet")
    return record, runs, notes


def compared_step(runs: list[SweepRun]) -> tuple[int, str]:
    """(step, metric): the last step at which every run logged ``VAL``, else ``TRAIN``."""
    for metric in (VAL, TRAIN):
        steps = [set(r.run.series(metric)[0]) for r in runs]
        if all(steps) and (common := set.intersection(*steps)):
            return max(common), metric
    raise ReportError("no step at which every run logged a training loss: "
                      + ", ".join(f"{r.run.path.name} up to step {r.run.last_step}" for r in runs))


def _value(run: Run, step: int, key: str):
    value = run.rows.get(step, {}).get(key)
    return None if value is None else float(value)


def compare(runs: list[SweepRun], baseline: str, order: list[str]) -> Comparison:
    step, metric = compared_step(runs)
    tokens = {r.run.tokens(step) for r in runs}
    notes = []
    if len(tokens) > 1:
        notes.append(f"the runs differ in tokens per step: step {step} is {sorted(tokens)} tokens")
    rows = [{"variant": r.variant, "seed": r.seed, "run_dir": str(r.run.path), "tokens": int(r.run.tokens(step)),
             "train_loss": _value(r.run, step, TRAIN), "val_loss": _value(r.run, step, VAL),
             "val_bpb": _value(r.run, step, BPB), "tokens_per_s": _value(r.run, step, TPS)} for r in runs]
    key = "val_loss" if metric == VAL else "train_loss"
    losses = {v: [row[key] for row in rows if row["variant"] == v and row[key] is not None] for v in order}
    summary = [summarize(v, losses[v], losses.get(baseline, []), v == baseline) for v in order if losses[v]]
    if metric == TRAIN:
        notes.append("no validation loss in every run: compared on training loss (val_loss_* columns hold it)")
    return Comparison(step, int(max(tokens)), metric, rows, summary, notes)


def _std(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def summarize(variant: str, xs: list[float], base: list[float], is_baseline: bool) -> dict:
    """One summary row: the variant's seeds against the baseline's (see the module's docstring)."""
    mean, std = sum(xs) / len(xs), _std(xs)
    row = {"variant": variant, "n": len(xs), "val_loss_mean": mean, "val_loss_std": std,
           "delta_vs_baseline": None, "sigmas": None, "verdict": "baseline" if is_baseline else ""}
    if is_baseline:
        row["delta_vs_baseline"] = 0.0
        return row
    if not base:
        row["verdict"] = "no baseline run to compare with"
        return row
    delta = mean - sum(base) / len(base)
    row["delta_vs_baseline"] = delta
    dof = len(xs) + len(base) - 2
    if dof < 1:
        row["verdict"] = f"{_signed(delta)}; no seed-noise estimate (one seed each: run more seeds)"
        return row
    pooled = ((len(xs) - 1) * (std or 0.0) ** 2 + (len(base) - 1) * (_std(base) or 0.0) ** 2) / dof
    se = math.sqrt(pooled * (1 / len(xs) + 1 / len(base)))
    sigmas = delta / se if se > 0 else (0.0 if delta == 0 else math.copysign(math.inf, delta))
    row["sigmas"] = sigmas
    row["verdict"] = ("within seed noise" if abs(sigmas) < t_critical(dof)
                      else f"{_signed(delta)} ({abs(sigmas):.1f} sigma)")
    return row


def _signed(delta: float) -> str:
    return f"{'worse' if delta > 0 else 'better'} by {abs(delta):.3f}"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    return str(value)


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row[k] is None else (repr(row[k]) if isinstance(row[k], float) else row[k])
                        for k in fields})


def summary_lines(c: Comparison) -> list[str]:
    """The summary table as printed, with where it compares."""
    what = "validation loss" if c.metric == VAL else "training loss"
    header = ["variant", "n", "mean", "std", "delta", "sigmas", "verdict"]
    rows = [[r["variant"], str(r["n"]), f"{r['val_loss_mean']:.4f}", _fmt(r["val_loss_std"], ".4f"),
             _fmt(r["delta_vs_baseline"], "+.4f"), _fmt(r["sigmas"], "+.1f"), r["verdict"]] for r in c.summary]
    return [f"{what} at step {c.step:,} = {c.tokens:,} tokens (the last step every run reached with it); "
            f"sigma: the two-sample standard error from the seeds of the variant and the baseline; "
            f"within seed noise: |sigmas| below Student's t at 95%", *text_table(header, rows), *c.notes]


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def write_sweep_report(folder: Path, out: Path | None = None) -> tuple[Path, list[str]]:
    """comparison.csv, summary.csv and report.html in ``out`` (default: the sweep dir); returns the
    page and the lines to print (the summary, and the scaling fit when the sweep varies model size)."""
    from train.report.scaling import scaling_lines

    folder = Path(folder)
    record, runs, notes = read_sweep(folder)
    order = [v["name"] for v in record.get("variants", [])] or list(dict.fromkeys(r.variant for r in runs))
    c = compare(runs, record["baseline"], order)
    c.notes += notes
    out = Path(out) if out is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / COMPARISON_FILE, COMPARISON_FIELDS, c.rows)
    write_csv(out / SUMMARY_FILE, SUMMARY_FIELDS, c.summary)
    lines = summary_lines(c)
    fit = scaling_lines([r.run for r in runs], c.metric)
    lines += fit
    page = out / REPORT_PAGE
    page.write_text(sweep_page(record["name"], runs, c, lines, out))
    return page, lines


# ---- the page ----------------------------------------------------------------------------------


def sweep_page(name: str, runs: list[SweepRun], c: Comparison, lines: list[str], out: Path) -> str:
    from train.report.page import STYLE, data_script, figure_sections

    figures = sweep_figures(runs, out)
    table = "<table><tr>" + "".join(f"<th>{f}</th>" for f in SUMMARY_FIELDS) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(r[f]))}</td>" for f in SUMMARY_FIELDS) + "</tr>"
        for r in c.summary) + "</table>"
    runs_table = "<table><tr>" + "".join(f"<th>{f}</th>" for f in COMPARISON_FIELDS) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(r[f]))}</td>" for f in COMPARISON_FIELDS) + "</tr>"
        for r in c.rows) + "</table>"
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>sweep {html.escape(name)}</title>",
             f"<style>{STYLE}</style></head><body><h1>sweep {html.escape(name)}</h1>",
             "<pre>" + html.escape("\n".join(lines)) + "</pre>", "<h2>summary</h2>", table,
             "<h2>runs</h2>", runs_table]
    parts += figure_sections(figures)
    parts.append(data_script({"summary": c.summary, "runs": c.rows, **{f.name: f.data for f in figures if f.data}}))
    return "\n".join(parts) + "\n</body></html>\n"


def sweep_figures(runs: list[SweepRun], out: Path) -> list:
    """Training loss (smoothed), validation loss and CORE, every run coloured by its variant."""
    from train.report.figures import Drawing, Figure, smooth, smoothing

    variants = list(dict.fromkeys(r.variant for r in runs))
    by_path = {r.run.path: r for r in runs}

    class ByVariant(Drawing):
        def color(self, run: Run) -> str:
            return f"C{variants.index(by_path[run.path].variant) % 10}"

        def label(self, run: Run, what: str) -> str:
            return f"{run.path.name}: {what}"

    read = [r.run for r in runs]
    d = ByVariant(read, "loss", "training loss (smoothed), coloured by variant")
    for run in read:
        steps, values = run.series(TRAIN)
        d.line(d.axes[0], run, steps, smooth(values, smoothing(len(values))), "loss", linewidth=1.2)
    d.axis_labels(d.axes[0], "loss (nats/token)")
    figures = [d.save(out)]
    for name, title, prefix in (("validation", "validation loss, coloured by variant", VAL),
                                ("core", "CORE (centered average), coloured by variant", "core/")):
        keys = [k for k in dict.fromkeys(k for r in read for k in r.eval_keys(prefix))
                if prefix != "core/" or "CORE_" in k]
        if not keys:
            figures.append(Figure(name, title, note=f"no {prefix} in the runs' evals"))
            continue
        d = ByVariant(read, name, title)
        for run in read:
            steps, values = run.eval_series(keys[0])
            if steps:
                d.line(d.axes[0], run, steps, values, keys[0], marker="o", markersize=3)
        d.axis_labels(d.axes[0], keys[0])
        figures.append(d.save(out))
    return figures
