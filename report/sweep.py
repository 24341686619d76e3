"""A sweep compared: every run at equal tokens on the sweep's metric, each variant against the baseline
and seed noise.

    python -m report runs/sweeps/NAME [--out DIR]     (a dir with launch.sweep's sweep.json)

writes into the sweep dir (or ``--out``):

- ``comparison.csv``: a row per run, ``variant,seed,run_dir,tokens,at,train_loss,val_loss,val_bpb,
  pref_loss,pref_accuracy,tokens_per_s``, its values at the compared token count (``at``: the step the
  compared metric was logged at, or the two steps it was interpolated between);
- ``summary.csv``: a row per variant, ``variant,n,metric,mean,std,delta_vs_baseline,sigmas,dof,verdict``;
- ``report.html``: that table, then every run's curves coloured by variant (CORE too where evaluated);

and prints the summary with the metric and the token count it compares at.

The metric: the sweep file's ``metric`` (recorded in sweep.json), else held-out preference accuracy
(``eval/pref_accuracy``) for preference runs and validation loss (``eval/val_loss``) for the others
(report/comparable.py). Which way is better is the metric's: lower for a loss, higher for accuracy.
A metric on the scale of the run's own loss function (training loss, ``eval/pref_loss``) is compared
only when every run's loss is on one scale: two preference runs of another loss type or another beta
never are, and the report says why.

Equal tokens: a run's token axis is its step x the tokens per step of its own ``recipe.toml``
(``global_batch x seq_len``, report/runs.py), so variants of different batch or sequence
length line up. The compared token count is the largest one every run reached with the metric: the
smallest of the runs' last token counts with it. Each run's value there is the one it logged at that
token count, else the linear interpolation between the two logged points around it (said in ``at`` and
in a note); every column is read the same way. When some run has no value of the metric, or the runs'
token ranges of it do not overlap, the runs are compared on training loss the same way if their losses
are on one scale, and the table says so; if they are not, the runs that logged the metric are compared
and the others are named as left out.

Seed noise, honestly: a variant with values ``x_1..x_n`` (one per seed) against the baseline's
``y_1..y_m`` differs by ``delta = mean(x) - mean(y)``; ``sigmas`` is Welch's t,
``delta / sqrt(s_x^2/n + s_y^2/m)``, with the Welch-Satterthwaite degrees of freedom
(``scipy.stats.ttest_ind(equal_var=False)``): a variant may change the seed spread itself (an
unstable one scatters more), so the two variances are not pooled. A difference is ``within seed
noise`` unless ``|sigmas|`` exceeds Student's t at 95% two-sided for those degrees of freedom
(``scipy.stats.t.ppf(0.975, dof)``: 4.30 at 2, 2.78 at 4): with few seeds the noise estimate is
itself noisy, and a plain 2-sigma rule would call chance a result. A variant or baseline with one
seed has no spread of its own to estimate: its delta is given without a verdict.
"""

from __future__ import annotations

import bisect
import csv
import html
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from rundir import COMPARISON_FILE, RECIPE_FILE, REPORT_PAGE, SUMMARY_FILE, SWEEP_FILE
from rundir.table import text_table
from train.metric_names import VAL_BPB, VAL_LOSS
from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS
from train.recipe.objective import PREFERENCE, objective_of
from report.comparable import METRICS, TRAIN, Metric, default_metric, scale_difference
from report.runs import ReportError, Run, read_run

TPS = "throughput(tps)"  # torchtitan's name
COLUMNS = {"train_loss": TRAIN, "val_loss": VAL_LOSS, "val_bpb": VAL_BPB, "pref_loss": EVAL_LOSS,
           "pref_accuracy": EVAL_ACCURACY, "tokens_per_s": TPS}  # comparison.csv's column -> the metric
COMPARISON_FIELDS = ["variant", "seed", "run_dir", "tokens", "at", *COLUMNS]
SUMMARY_FIELDS = ["variant", "n", "metric", "mean", "std", "delta_vs_baseline", "sigmas", "dof", "verdict"]


def t_critical(dof: float) -> float:
    """The 95% two-sided threshold of Student's t with ``dof`` (Welch's: fractional) degrees of freedom."""
    return float(stats.t.ppf(0.975, dof))


@dataclass
class SweepRun:
    variant: str
    seed: int
    run: Run


@dataclass
class Comparison:
    tokens: int  # the token count every run is read at
    metric: Metric  # the sweep's, or training loss when the runs cannot be compared on it
    rows: list[dict]  # COMPARISON_FIELDS
    summary: list[dict]  # SUMMARY_FIELDS
    notes: list[str]


def read_sweep(folder: Path) -> tuple[dict, list[SweepRun], list[str]]:
    """sweep.json and every run that has started (read with report.runs); notes name the others."""
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


def value_at(run: Run, key: str, tokens: int) -> tuple[float | None, str]:
    """``run``'s ``key`` at ``tokens`` and where it comes from: the value logged at that token count
    (``step N``), else the linear interpolation between the logged points around it (``steps N-M,
    interpolated``); None outside the range the run logged it in."""
    steps, values = run.series(key)
    xs = [run.tokens(s) for s in steps]
    if not xs or not xs[0] <= tokens <= xs[-1]:
        return None, ""
    i = bisect.bisect_left(xs, tokens)
    at = f"step {steps[i]}" if xs[i] == tokens else f"steps {steps[i - 1]}-{steps[i]}, interpolated"
    return float(np.interp(tokens, xs, values)), at


def common_tokens(runs: list[SweepRun], key: str) -> tuple[int | None, str]:
    """The largest token count inside every run's logged range of ``key`` (the smallest of the runs' last
    ones), or None and why there is none."""
    spans = [[r.run.tokens(s) for s in r.run.series(key)[0]] for r in runs]
    if missing := [r.run.path.name for r, xs in zip(runs, spans) if not xs]:
        return None, f"no {key} in {', '.join(missing)}"
    last = min(xs[-1] for xs in spans)
    if max(xs[0] for xs in spans) <= last:
        return int(last), ""
    return None, f"the runs' {key} token ranges do not overlap: " + ", ".join(
        f"{r.run.path.name} {xs[0]:,}-{xs[-1]:,}" for r, xs in zip(runs, spans))


def compared_tokens(runs: list[SweepRun], metric: Metric) -> tuple[int, Metric, list[SweepRun], list[str]]:
    """(tokens, the metric, the runs compared, notes saying why): ``metric`` where every run has it; else
    the training loss, if the runs' losses are on one scale; else ``metric`` in the runs that logged it,
    the others left out. A metric on the runs' own loss scale is never used across scales."""
    differ = scale_difference([r.run.recipe for r in runs])
    own = " or ".join(f"{m.label} ({m.key})" for m in METRICS.values() if m.own_scale)
    notes = [f"the runs' losses are not on one scale ({differ}): never compared on {own}"] if differ else []
    usable = [m for m in dict.fromkeys((metric, METRICS[TRAIN])) if not (m.own_scale and differ)]
    problems = []
    for m in usable:
        tokens, problem = common_tokens(runs, m.key)
        if tokens is not None:
            fell_back = [f"compared on {m.label}, not {metric.label}: {'; '.join(problems)}"] if m != metric else []
            return tokens, m, runs, notes + fell_back
        problems.append(problem)
    logged = [r for r in runs if r.run.series(metric.key)[0]]
    if metric in usable and 0 < len(logged) < len(runs):
        tokens, problem = common_tokens(logged, metric.key)
        if tokens is not None:
            instead = f"; training loss could not stand in: {problems[1]}" if len(problems) > 1 else ""
            return tokens, metric, logged, notes + [f"left out of the comparison: {problems[0]}{instead}"]
        problems.append(problem)
    raise ReportError(f"no token count at which every run logged {metric.key}, or a training loss on one "
                      f"scale: {'; '.join(notes + problems)}")


def compare(runs: list[SweepRun], baseline: str, order: list[str], metric: Metric) -> Comparison:
    tokens, metric, compared, notes = compared_tokens(runs, metric)
    rows = []
    for r in runs:
        read = {column: value_at(r.run, key, tokens)[0] for column, key in COLUMNS.items()}
        rows.append({"variant": r.variant, "seed": r.seed, "run_dir": str(r.run.path), "tokens": tokens,
                     "at": value_at(r.run, metric.key, tokens)[1], **read})
    if len(per_step := sorted({r.run.tokens_per_step for r in runs})) > 1:
        notes.append(f"the runs differ in tokens per step ({', '.join(f'{t:,}' for t in per_step)}): each is read "
                     f"at {tokens:,} tokens, whatever its step")
    if between := [f"{Path(row['run_dir']).name} ({row['at'].removesuffix(', interpolated')})" for row in rows
                   if row["at"].endswith("interpolated")]:
        notes.append(f"interpolated linearly between two logged points at {tokens:,} tokens: {', '.join(between)}")
    column = next(c for c, key in COLUMNS.items() if key == metric.key)
    paths = {r.run.path for r in compared}
    values = {v: [row[column] for row, r in zip(rows, runs) if r.variant == v and r.run.path in paths]
              for v in order}
    summary = [summarize(v, values[v], values.get(baseline, []), v == baseline, metric) for v in order
               if any(r.variant == v for r in runs)]
    return Comparison(tokens, metric, rows, summary, notes)


def summarize(variant: str, xs: list[float], base: list[float], is_baseline: bool, metric: Metric) -> dict:
    """One summary row: the variant's seeds against the baseline's (see the module's docstring)."""
    mean = statistics.fmean(xs) if xs else None
    row = {"variant": variant, "n": len(xs), "metric": metric.key, "mean": mean,
           "std": statistics.stdev(xs) if len(xs) > 1 else None, "delta_vs_baseline": None,
           "sigmas": None, "dof": None, "verdict": "baseline" if is_baseline else ""}
    if not xs:
        row["verdict"] = f"not compared: no {metric.key} logged (left out)"
        return row
    if is_baseline:
        row["delta_vs_baseline"] = 0.0
        return row
    if not base:
        row["verdict"] = "no baseline run to compare with"
        return row
    delta = row["delta_vs_baseline"] = mean - statistics.fmean(base)
    said = _signed(delta, metric)
    if single := [who for who, seeds in ((variant, xs), ("the baseline", base)) if len(seeds) < 2]:
        row["verdict"] = f"{said}; no seed-noise estimate ({' and '.join(single)}: one seed; run more seeds)"
        return row
    if statistics.stdev(xs) == statistics.stdev(base) == 0:  # no spread at all: Welch's t is undefined
        row["sigmas"] = 0.0 if delta == 0 else math.copysign(math.inf, delta)
        row["verdict"] = "within seed noise" if delta == 0 else f"{said} (no seed spread)"
        return row
    welch = stats.ttest_ind(xs, base, equal_var=False)
    sigmas = row["sigmas"] = float(welch.statistic)
    row["dof"] = float(welch.df)
    row["verdict"] = ("within seed noise" if abs(sigmas) < t_critical(row["dof"])
                      else f"{said} ({abs(sigmas):.1f} sigma)")
    return row


def _signed(delta: float, metric: Metric) -> str:
    return f"{'better' if (delta > 0) == metric.higher_is_better else 'worse'} by {abs(delta):.3f}"


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row[k] is None else (repr(row[k]) if isinstance(row[k], float) else row[k])
                        for k in fields})


def summary_lines(c: Comparison) -> list[str]:
    """The summary table as printed, with where it compares."""
    m = c.metric
    header = ["variant", "n", "mean", "std", "delta", "sigmas", "verdict"]
    rows = [[r["variant"], str(r["n"]), _fmt(r["mean"], ".4f"), _fmt(r["std"], ".4f"),
             _fmt(r["delta_vs_baseline"], "+.4f"), _fmt(r["sigmas"], "+.1f"), r["verdict"]] for r in c.summary]
    return [f"{m.label} at {c.tokens:,} tokens ({m.key}, {'higher' if m.higher_is_better else 'lower'} is better; "
            "the most every compared run reached with it; each run's value logged there or interpolated: "
            "comparison.csv's at); sigmas: Welch's t over the seeds of the variant and the baseline; "
            "within seed noise: |sigmas| below Student's t at 95% (Welch's dof)",
            *text_table(header, rows), *c.notes]


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def sweep_metric(record: dict, runs: list[SweepRun]) -> Metric:
    """The metric sweep.json records (the sweep file's), else the default for the runs' kind."""
    if not (key := record.get("metric")):
        return default_metric([r.run.recipe for r in runs])
    if key not in METRICS:
        raise ReportError(f"{SWEEP_FILE}: metric {key!r}: not one a sweep is compared on ({', '.join(METRICS)})")
    return METRICS[key]


def write_sweep_report(folder: Path, out: Path | None = None) -> tuple[Path, list[str]]:
    """comparison.csv, summary.csv and report.html in ``out`` (default: the sweep dir); returns the
    page and the lines to print (the summary, and the scaling fit when the sweep varies model size)."""
    from report.scaling import scaling_lines

    folder = Path(folder)
    record, runs, notes = read_sweep(folder)
    order = [v["name"] for v in record.get("variants", [])] or list(dict.fromkeys(r.variant for r in runs))
    c = compare(runs, record["baseline"], order, sweep_metric(record, runs))
    c.notes += notes
    out = Path(out) if out is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / COMPARISON_FILE, COMPARISON_FIELDS, c.rows)
    write_csv(out / SUMMARY_FILE, SUMMARY_FIELDS, c.summary)
    lines = summary_lines(c)
    if c.metric.key in (VAL_LOSS, TRAIN) and not any(objective_of(r.run.recipe) == PREFERENCE for r in runs):  # L(C): cross-entropy
        lines += scaling_lines([r.run for r in runs], c.metric.key)
    page = out / REPORT_PAGE
    page.write_text(sweep_page(record["name"], runs, c, lines, out))
    return page, lines


# ---- the page ----------------------------------------------------------------------------------


def sweep_page(name: str, runs: list[SweepRun], c: Comparison, lines: list[str], out: Path) -> str:
    from report.page import STYLE, data_script, figure_sections, html_table

    figures = sweep_figures(runs, out, c.metric)
    table, runs_table = html_table(SUMMARY_FIELDS, c.summary), html_table(COMPARISON_FIELDS, c.rows)
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>sweep {html.escape(name)}</title>",
             f"<style>{STYLE}</style></head><body><h1>sweep {html.escape(name)}</h1>",
             "<pre>" + html.escape("\n".join(lines)) + "</pre>", "<h2>summary</h2>", table,
             "<h2>runs</h2>", runs_table]
    parts += figure_sections(figures)
    parts.append(data_script({"summary": c.summary, "runs": c.rows, **{f.name: f.data for f in figures if f.data}}))
    return "\n".join(parts) + "\n</body></html>\n"


def sweep_figures(runs: list[SweepRun], out: Path, metric: Metric) -> list:
    """Training loss (smoothed), the compared metric where neither of the others is it, validation loss and
    CORE, every run coloured by its variant."""
    from report.figures import Drawing, Figure, smooth, smoothing

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
    if metric.key not in (TRAIN, VAL_LOSS):
        d = ByVariant(read, "compared", f"{metric.label} (compared), coloured by variant")
        for run in read:
            if (series := run.series(metric.key))[0]:
                d.line(d.axes[0], run, *series, metric.key, marker="o", markersize=3)
        d.axis_labels(d.axes[0], metric.key)
        figures.append(d.save(out))
    for name, title, prefix in (("validation", "validation loss, coloured by variant", VAL_LOSS),
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
