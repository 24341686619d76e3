"""The report's figures: matplotlib ``Figure`` objects drawn off-screen (Agg, no pyplot state),
saved as PNGs, each with the series it drew, so that the page can embed them as data and a
test can compare them with the run's own files.

Every figure is against tokens (bottom axis; several runs share it, phase 2 after
phase 1) and, for one run, steps (top axis). A figure with nothing to draw is left
out with a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path

from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import EngFormatter, FuncFormatter

from eval.spec import EvalSpec
from rundir import PLAN_FILE
from train.metric_names import VAL_BPB, VAL_LOSS, at_length, bucket_of, per_set
from train.preference.metrics import EVAL_ACCURACY, REWARDS_ACCURACY, REWARDS_CHOSEN, REWARDS_MARGIN, REWARDS_REJECTED
from report.runs import Run

CAUSE_COLORS = {"preempted": "tab:orange", "crash": "tab:red", "stall": "tab:brown", "restart": "tab:gray",
                "rollback": "tab:purple"}
SMOOTHING = 0.9  # the most weight of the debiased exponential moving average (TensorBoard's slider)
EVALPLUS_KEYS = ("humaneval/pass@1", "humaneval+/pass@1", "mbpp/pass@1", "mbpp+/pass@1")


@dataclass
class Figure:
    name: str  # the PNG's stem
    title: str
    data: dict = field(default_factory=dict)  # what was drawn: label -> {"steps", "tokens", "values"} and markers
    note: str = ""  # why it is missing, or what it leaves out


def smoothing(n: int) -> float:
    """An EMA weight that spans about 5% of ``n`` logged points, between 0.6 and ``SMOOTHING``."""
    return min(SMOOTHING, max(0.6, 1 - 20 / n)) if n else 0.0


def smooth(values: list[float], weight: float) -> list[float]:
    out, ema, norm = [], 0.0, 0.0
    for v in values:
        if v != v:  # a skipped step's NaN does not poison the average
            out.append(out[-1] if out else v)
            continue
        ema, norm = weight * ema + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(ema / norm)
    return out


class Drawing:
    """One figure being drawn: its axes, the series recorded as drawn, and the file it becomes."""

    def __init__(self, runs: list[Run], name: str, title: str, panels: int = 1, cols: int = 1,
                 size: tuple[float, float] = (8, 3.6)):
        self.runs, self.figure, self.legends = runs, Figure(name, title), True
        rows = -(-panels // cols)
        self.mpl = MplFigure(figsize=(size[0], size[1] * rows if panels > 1 else size[1]), layout="constrained")
        self.axes = [self.mpl.add_subplot(rows, cols, i + 1) for i in range(panels)]
        for ax in self.axes:
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            ax.grid(alpha=0.3)
        self.mpl.suptitle(title)

    def color(self, run: Run) -> str:
        return f"C{self.runs.index(run)}"

    def label(self, run: Run, what: str) -> str:
        return f"{run.name}: {what}" if len(self.runs) > 1 else what

    def line(self, ax, run: Run, steps: list[int], values: list[float], what: str, **style) -> None:
        tokens = [run.tokens(s) for s in steps]
        label = self.label(run, what)
        ax.plot(tokens, values, label=label, **{"color": self.color(run), **style})
        self.figure.data[label] = {"steps": steps, "tokens": tokens, "values": values}

    def axis_labels(self, ax, ylabel: str) -> None:
        """Tokens from the first run's start to the last run's planned end; steps on top for one run."""
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        end = max(run.tokens(run.planned_steps) for run in self.runs)
        ax.set_xlim(min(run.offset for run in self.runs) - 0.02 * end, end * 1.02)
        if len(self.runs) == 1 and ax.has_data():  # one run: its steps on top
            run = self.runs[0]
            top = ax.secondary_xaxis("top", functions=(lambda t: (t - run.offset) / run.tokens_per_step,
                                                       lambda s: run.offset + s * run.tokens_per_step))
            top.set_xlabel("step")

    def restarts(self, ax) -> None:
        marks = []
        for run in self.runs:
            for r in run.restarts:
                x = run.tokens(r.step)
                ax.axvline(x, color=CAUSE_COLORS[r.cause], linestyle=":", linewidth=1.2)
                ax.annotate(r.cause, (x, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                            ha="right", fontsize=7, color=CAUSE_COLORS[r.cause])
                marks.append({"run": run.name, "step": r.step, "tokens": x, "cause": r.cause})
        self.figure.data["restarts"] = marks

    def save(self, out: Path) -> Figure:
        for ax in self.axes:
            if self.legends and ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best")
        self.mpl.savefig(out / f"{self.figure.name}.png", dpi=90)
        return self.figure


def loss(runs: list[Run], out: Path) -> Figure:
    d = Drawing(runs, "loss", "training loss and learning rate")
    ax = d.axes[0]
    lr_ax = ax.twinx()
    for run in runs:
        steps, values = run.series("loss_metrics/global_avg_loss")
        d.line(ax, run, steps, values, "loss", alpha=0.35, linewidth=0.8)
        weight = smoothing(len(values))
        d.line(ax, run, steps, smooth(values, weight), f"loss, smoothed (EMA {weight:.2f})", linewidth=1.6)
        lr_key = next(iter(run.keys("lr/")), None)
        if lr_key:
            d.line(lr_ax, run, *run.series(lr_key), "learning rate", linestyle="--", linewidth=1, alpha=0.7)
    lr_ax.set_ylabel("learning rate")
    lr_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    d.axis_labels(ax, "loss (nats/token)")
    lines = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    d.mpl.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="outside lower center",
                 ncols=min(len(lines), 4))
    d.legends = False
    return d.save(out)


def grad_norm(runs: list[Run], out: Path) -> Figure:
    d = Drawing(runs, "grad_norm", "gradient norm (before clipping), skipped steps marked")
    ax, skips = d.axes[0], []
    for run in runs:
        steps, values = run.series("grad_norm")
        d.line(ax, run, steps, values, "grad norm", linewidth=1)
        norm_at = dict(zip(steps, values))
        before = 0
        for step, count in zip(*run.series("skipped_steps")):
            if count > before:  # the counter rose since the previous logging step
                skips.append({"run": run.name, "step": step, "tokens": run.tokens(step), "skipped": int(count - before)})
                ax.scatter([run.tokens(step)], [norm_at.get(step, 0.0)], marker="x", color="tab:red", zorder=3,
                           label="skipped steps" if len(skips) == 1 else None)
            before = count
    d.figure.data["skipped"] = skips
    d.figure.note = "a skip is marked at the logging step where the skip count rose"
    d.axis_labels(ax, "grad norm")
    return d.save(out)


def throughput(runs: list[Run], out: Path) -> Figure:
    d = Drawing(runs, "throughput", "tokens/s per GPU and MFU, restarts and preemptions marked")
    ax = d.axes[0]
    mfu_ax = None
    for run in runs:
        d.line(ax, run, *run.series("throughput(tps)"), "tokens/s/GPU", linewidth=1)
        if run.keys("mfu(%)"):
            mfu_ax = mfu_ax or ax.twinx()
            d.line(mfu_ax, run, *run.series("mfu(%)"), "MFU %", linestyle="--", linewidth=1)
    if mfu_ax is not None:
        mfu_ax.set_ylabel("MFU (%)")
    d.restarts(ax)
    d.axis_labels(ax, "tokens/s per GPU")
    d.figure.note = "; ".join(n for run in runs for n in run.notes if n.startswith("MFU"))
    return d.save(out)


def memory(runs: list[Run], out: Path) -> Figure:
    d = Drawing(runs, "memory", "peak memory per GPU against the plan")
    ax, notes = d.axes[0], []
    for run in runs:
        d.line(ax, run, *run.series("memory/max_reserved(GiB)"), "max reserved", linewidth=1.2)
        d.line(ax, run, *run.series("memory/max_active(GiB)"), "max active", linestyle="--", linewidth=1)
        plan = run.path / PLAN_FILE
        if plan.exists():
            p = json.loads(plan.read_text())
            peak = p["memory"]["peak_gib"]
            ax.axhline(peak, color=d.color(run), linestyle=":", linewidth=1.5,
                       label=d.label(run, f"plan: {peak:.1f} GiB on {p['gpus']} x {p['gpu']}"))
            d.figure.data[d.label(run, "plan")] = {"peak_gib": peak, "gpu": p["gpu"], "gpus": p["gpus"]}
        else:
            notes.append(f"{run.name}: no memory plan in the run dir (python -m report {run.path} "
                         f"--plan-gpu h100 --gpus N computes it once)")
    d.figure.note = "; ".join(notes)
    d.axis_labels(ax, "GiB")
    return d.save(out)


def _eval_panels(runs: list[Run], out: Path, name: str, title: str, keys: list[tuple[str, str]], cols: int,
                 missing: str) -> Figure:
    """One small panel per (key, panel title); only a note when no run has any of them."""
    keys = [(k, t) for k, t in keys if any(run.eval_series(k)[0] for run in runs)]
    if not keys:
        return Figure(name, title, note=missing)
    d = Drawing(runs, name, title, panels=len(keys), cols=min(cols, len(keys)),
                size=(min(cols, len(keys)) * 3.2, 2.6))
    for ax, (key, panel) in zip(d.axes, keys):
        for run in runs:
            steps, values = run.eval_series(key)
            if steps:
                d.line(ax, run, steps, values, key, marker="o", markersize=3)
        ax.set_title(panel, fontsize=8)
        ax.tick_params(labelsize=7)
        d.axis_labels(ax, "")
    d.legends = len(runs) > 1  # one run: each panel's title says what it is
    return d.save(out)


def evals(runs: list[Run], out: Path) -> list[Figure]:
    """Validation (over every held-out set, then a panel per set: phase 2 continues phase 1's
    lines on the token axis), CORE (the average, then a panel per task), lm-eval tasks, HumanEval+/MBPP+."""
    val = _eval_panels(runs, out, "validation", "validation loss and bits per byte, every held-out set",
                       [(VAL_LOSS, "loss (nats/token)"), (VAL_BPB, "bits per byte")], 2,
                       "no validation in evals/step-N.json ([data] held_out, [eval] val_sources)")
    sets = sorted({k.removeprefix(per_set(VAL_LOSS, "")) for run in runs for k in run.eval_keys(per_set(VAL_LOSS, ""))})
    per_source = _eval_panels(runs, out, "validation_sets", "validation loss (nats/token) per held-out set",
                              [(per_set(VAL_LOSS, name), name) for name in sets], 4,
                              "no per-set validation in evals/step-N.json ([data] held_out)")
    core_keys = sorted({k for run in runs for k in run.eval_keys("core/")})
    average = [(k, k.removeprefix("core/")) for k in core_keys if "CORE_" in k]
    tasks = [(k, k.split("/")[1]) for k in core_keys if k.endswith("/acc")]
    core = _eval_panels(runs, out, "core", "CORE: the average (centered), then accuracy per task", average + tasks, 6,
                        "no CORE in evals/step-N.json ([eval] core_bundle)")
    lm_keys = sorted({k for run in runs for k in run.eval_keys("lm_eval/")})
    lm = _eval_panels(runs, out, "lm_eval", "lm-eval tasks", [(k, k.removeprefix("lm_eval/")) for k in lm_keys], 4,
                      "no lm-eval tasks in evals/step-N.json ([eval] lm_eval_tasks)")
    code = _eval_panels(runs, out, "code", "HumanEval+ / MBPP+ pass@1", [(k, k) for k in EVALPLUS_KEYS], 4,
                        "no HumanEval+/MBPP+ in evals/step-N.json ([eval] evalplus)")
    return [val, per_source, core, lm, code]


def validation_lengths(runs: list[Run], out: Path) -> Figure:
    """The validation loss over every held-out set at each length the run validated at (its seq_len and
    ``[eval] val_seq_lens``): a long-context phase's short-context loss beside its long one."""
    lengths = {run.name: EvalSpec(val_seq_lens=run.recipe.get("eval", {}).get("val_seq_lens", [])).lengths(run.seq_len)
               for run in runs}
    title = "validation loss (nats/token) at each validation length"
    if all(len(n) == 1 for n in lengths.values()):
        return Figure("validation_lengths", title, note="one validation length a run ([eval] val_seq_lens)")
    d = Drawing(runs, "validation_lengths", title)
    ax = d.axes[0]
    for run in runs:
        for style, length in zip(cycle(("-", "--", ":", "-.")), lengths[run.name]):
            d.line(ax, run, *run.eval_series(at_length(VAL_LOSS, length, run.seq_len)), f"at {length:,}",
                   linestyle=style, marker="o", markersize=3)
    d.axis_labels(ax, "loss (nats/token)")
    return d.save(out)


def latest_by_position(run: Run) -> tuple[int, list[tuple[int, int, float]]] | None:
    """The run's latest eval with a loss by position: (step, [(start, end, loss), ...] by position)."""
    for step in sorted(run.evals, reverse=True):
        metrics = run.evals[step]["metrics"]
        buckets = sorted((*span, float(v)) for k, v in metrics.items() if (span := bucket_of(k)))
        if buckets:
            return step, buckets
    return None


def position_loss(runs: list[Run], out: Path) -> Figure:
    """Held-out loss against the position in the document (eval.position_loss) at each run's latest eval
    that has it, every run on one figure (a base model and its long-context phase), each bucket drawn at
    its middle, with a dotted line where each run's training length ends: past it, a model that does not
    use the context shows it here first."""
    drawn = [(run, found) for run in runs if (found := latest_by_position(run))]
    title = "held-out loss by position in the document"
    if not drawn:
        return Figure("position_loss", title, note="no loss by position in evals/step-N.json ([eval] position_buckets)")
    d = Drawing(runs, "position_loss", title)
    ax = d.axes[0]
    for run, (step, buckets) in drawn:
        label = d.label(run, f"step {step:,}")
        ax.plot([(a + b) / 2 for a, b, _ in buckets], [v for *_, v in buckets], marker="o", markersize=3,
                color=d.color(run), label=label)
        ax.axvline(run.seq_len, color=d.color(run), linestyle=":", linewidth=1.2)
        d.figure.data[label] = {"step": step, "start": [a for a, _, _ in buckets], "end": [b for _, b, _ in buckets],
                                "values": [v for *_, v in buckets], "seq_len": run.seq_len}
    ax.set_xlabel("position in the document (tokens; dotted: the run's training length)")
    ax.set_ylabel("loss (nats/token)")
    return d.save(out)


def preference(runs: list[Run], out: Path) -> Figure:
    """A preference run's rewards (train.preference.metrics) at its logging steps, and its accuracies:
    the training pairs' and, at the eval's steps, the held-out pairs'."""
    d = Drawing(runs, "preference", "preference rewards and accuracy (held-out pairs: markers)", panels=2, cols=2,
                size=(9.6, 3.2))
    rewards, accuracy = d.axes
    for run in runs:
        for key, style in ((REWARDS_CHOSEN, "-"), (REWARDS_REJECTED, ":"), (REWARDS_MARGIN, "--")):
            d.line(rewards, run, *run.series(key), key, linestyle=style)
        d.line(accuracy, run, *run.series(REWARDS_ACCURACY), REWARDS_ACCURACY)
        if run.eval_series(EVAL_ACCURACY)[0]:
            d.line(accuracy, run, *run.eval_series(EVAL_ACCURACY), EVAL_ACCURACY, marker="o", linestyle="--")
    d.axis_labels(rewards, "reward (beta x log-ratio)")
    d.axis_labels(accuracy, "share of pairs")
    accuracy.set_ylim(0, 1)
    return d.save(out)


def data_mix(runs: list[Run], out: Path) -> Figure:
    d = Drawing(runs, "data_mix", "realized share of each data source (solid) against its planned share (dashed)")
    ax = d.axes[0]
    for run in runs:
        keys = run.keys("data/tokens/")
        sources = [k.removeprefix("data/tokens/") for k in keys]
        rows = [(s, r) for s, r in sorted(run.rows.items()) if any(k in r for k in keys)]
        planned = run.planned_shares()
        for i, (key, source) in enumerate(zip(keys, sources)):
            steps = [s for s, _ in rows]
            shares = [r.get(key, 0) / (sum(r.get(k, 0) for k in keys) or 1) for _, r in rows]
            style = {"color": f"C{(d.runs.index(run) * 5 + i) % 10}"}
            d.line(ax, run, steps, shares, f"{source} realized", **style)
            if source in planned:
                ax.axhline(planned[source], linestyle="--", linewidth=1, **style)
                d.figure.data[d.label(run, f"{source} planned")] = planned[source]
    d.axis_labels(ax, "share of tokens")
    d.restarts(ax)  # a spike rollback's skipped data is not in the shares: marked where it went back to
    ax.set_ylim(0, 1)
    return d.save(out)


def stragglers(runs: list[Run], out: Path) -> Figure:
    """health.straggler's compute check per host at each logging step (the slowest rank of each host)."""
    d = Drawing(runs, "stragglers", "compute check per host (a straggler stands out; health.straggler)")
    ax = d.axes[0]
    for run in runs:
        for n, key in enumerate(sorted(run.keys("straggler/compute_s/"))):
            d.line(ax, run, *run.series(key), key.removeprefix("straggler/compute_s/"), linewidth=1,
                   color=f"C{n}" if len(runs) == 1 else d.color(run))
        if run.keys("straggler/compute_median_s"):
            d.line(ax, run, *run.series("straggler/compute_median_s"), "median of the ranks", linestyle="--",
                   linewidth=1, color="black")
    if not ax.has_data():
        d.figure.note = "no straggler check logged (one rank)"
    d.restarts(ax)
    d.axis_labels(ax, "seconds")
    return d.save(out)


def all_figures(runs: list[Run], out: Path) -> list[Figure]:
    preference_runs = [preference(runs, out)] if any(run.keys("pref/") for run in runs) else []
    return [loss(runs, out), grad_norm(runs, out), throughput(runs, out), memory(runs, out), *evals(runs, out),
            validation_lengths(runs, out), position_loss(runs, out), *preference_runs, data_mix(runs, out),
            stragglers(runs, out)]
