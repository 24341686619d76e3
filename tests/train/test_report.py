"""The run report (report, train.callbacks.report): written by the run, its figures read back
against the run's own files, robust to what real run dirs hold, and opened as a person would.

Run dirs here are written by the project's own writers: the session's reference run
(a real 2-rank training run, ``tests/conftest.py``), copies of it, or ``record_launch`` and
``MetricsJsonl`` for the fast robustness cases.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.attempts import begin, end, exit_file
from rundir import METRICS_FILE, REPO
from tests.conftest import SHORT, losses, reference_run, train
from tests.requires import require
from train import recipe as R
from train.callbacks.metrics_file import MetricsJsonl
from report import ReportError, write_report
from report.page import embedded_data


def data_of(page: Path) -> dict:
    return embedded_data(page.read_text())


def copy_run(run: Path, dst: Path) -> Path:
    """A run dir without its checkpoints (the report reads none of their bytes)."""
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "wandb", "report", "hf"))
    return dst


def fake_run(tmp_path: Path, rows: list[dict], steps: int = 10, sets: tuple[str, ...] = ()) -> Path:
    """A run dir as train.py leaves it: the resolved recipe (tiny.toml with ``sets``), the model config and a
    launch record (train.snapshot), and ``rows`` logged through the trainer's MetricsJsonl."""
    from train.recipe import model_config
    from train.snapshot import record_launch

    recipe = R.load("tiny.toml", [f"run.output_dir={tmp_path / 'run'}", f"training.steps={steps}",
                                  "schedule.warmup_steps=2", *sets])
    record_launch(recipe, model_config(recipe))
    log = MetricsJsonl(recipe.output_dir / METRICS_FILE)
    for row in rows:
        log.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    log.close()
    return recipe.output_dir


def step_rows(steps, **extra) -> list[dict]:
    return [{"step": s, "loss_metrics/global_avg_loss": 9.0 - 0.1 * s, "grad_norm": 1.0 + s / 100,
             "throughput(tps)": 1000.0 + s, "memory/max_reserved(GiB)": 1.5, "lr/AdamW/0": 1e-3,
             "n_tokens_seen": s * 2048, **extra} for s in steps]


# ---- the reference run: the report it wrote, read back -----------------------------------


@pytest.mark.slow
def test_the_run_writes_its_report_and_the_figures_hold_its_numbers(reference, tmp_path_factory):
    from data.loader import build_mixture
    from data.tokenizer import Tokenizer
    from train.recipe import model_config

    run = reference_run(tmp_path_factory)
    page = run / "report" / "report.html"
    assert page.is_file(), (run / "report" / "refresh.log").read_text()
    for src in re.findall(r"<img src='([^']+)'", page.read_text()):
        assert (page.parent / src).stat().st_size > 0
    data = data_of(page)

    loss = data["loss"]["loss"]
    assert dict(zip(loss["steps"], loss["values"])) == losses(run)  # every logged step, exactly
    recipe = R.load(str(run / "recipe.toml"))
    assert loss["tokens"] == [s * recipe.tokens_per_step for s in loss["steps"]]

    # Realized shares against the loader's own counts at each logged step.
    mixture = build_mixture(recipe.data.sources, Tokenizer(recipe.data.tokenizer), recipe.training.seq_len,
                            recipe.run.seed, model_config(recipe).vocab_size, None)
    for source in ("prose", "code"):
        realized = data["data_mix"][f"{source} realized"]
        for step, share in zip(realized["steps"], realized["values"]):
            counts = mixture.consumed_tokens(step * recipe.training.global_batch)
            assert share == counts[source] / sum(counts.values())
        assert data["data_mix"][f"{source} planned"] == 0.5  # weights 0.5 and 0.5

    val = json.loads((run / "evals" / "step-20.json").read_text())["metrics"]["eval/val_loss"]
    assert data["validation"]["eval/val_loss"]["values"] == [val]
    assert data["throughput"]["restarts"] == []  # one uninterrupted start
    commit = next((run / "launches").glob("*/git-commit")).read_text().strip()[:12]
    assert f"<th>commit</th><td>{commit}" in page.read_text()
    assert "step 20 of 20" in page.read_text()


@pytest.mark.slow
def test_a_resume_on_one_rank_is_marked_and_keeps_one_token_axis(reference, tmp_path_factory, tmp_path):
    """The 2-rank reference run, resumed by plain torchrun on one rank from its step-16 checkpoint:
    the run's own report marks the restart where it resumed, and replayed steps show their
    latest values on the same token axis."""
    run = tmp_path / "run"
    shutil.copytree(reference_run(tmp_path_factory), run)
    shutil.rmtree(run / "checkpoints" / "step-20")
    (run / "report" / "report.html").unlink()
    result = train("tiny.toml", f"run.output_dir={run}", *SHORT, "logging.report=true", nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training starts at step 17" in result.stdout
    page = run / "report" / "report.html"
    assert result.stdout.rstrip().endswith(f"report: {page}")

    data = data_of(page)
    tokens_per_step = R.load(str(run / "recipe.toml")).tokens_per_step
    assert data["throughput"]["restarts"] == [{"run": "tiny", "step": 16, "tokens": 16 * tokens_per_step,
                                               "cause": "restart"}]
    loss = data["loss"]["loss"]
    assert dict(zip(loss["steps"], loss["values"])) == losses(run)
    assert loss["tokens"] == [s * tokens_per_step for s in range(1, 21)]


@pytest.mark.slow
def test_restarts_appear_where_the_launch_records_put_them(reference, tmp_path_factory, tmp_path):
    """The launchers' records (launch.attempts, as launch.local and the SLURM script write them):
    preempted with a checkpoint at step 8, a crash after one at step 12."""
    run = copy_run(reference_run(tmp_path_factory), tmp_path / "run")
    (run / "launcher" / "attempts.jsonl").unlink()

    def checkpoint(step):
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / ".metadata").write_text("")

    begin(run, "1")
    checkpoint(8)
    exit_file(run).write_text(json.dumps({"reason": "preempted", "step": 8}))
    assert end(run, "1", 75)["action"] == "restart"
    begin(run, "1")
    checkpoint(12)
    assert end(run, "1", 1)["cause"] == "crash"
    begin(run, "1")

    data = data_of(write_report([run]))
    tokens_per_step = R.load(str(run / "recipe.toml")).tokens_per_step
    assert data["throughput"]["restarts"] == [
        {"run": "tiny", "step": 8, "tokens": 8 * tokens_per_step, "cause": "preempted"},
        {"run": "tiny", "step": 12, "tokens": 12 * tokens_per_step, "cause": "crash"}]


@pytest.mark.slow
def test_the_report_command_imports_neither_torch_nor_scipy(reference, tmp_path_factory, tmp_path):
    """``python -m report RUN`` (run at the end of every run that draws it) reads the metric names
    from torch-free train.metric_names, and scipy only for a sweep: a run's report is half the start-up."""
    code = ("import sys; from report.__main__ import main; code = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'torchtitan', 'scipy') if m in sys.modules)); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", code, str(reference_run(tmp_path_factory)), "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == [str(tmp_path / "report.html"), "[]"]


@pytest.mark.slow
def test_two_runs_share_the_axes_and_phase_two_continues_phase_one(reference, tmp_path_factory, tmp_path):
    one = reference_run(tmp_path_factory)
    two = copy_run(one, tmp_path / "two")
    text = (two / "recipe.toml").read_text().replace('name = "tiny"', 'name = "tiny-phase2"')
    (two / "recipe.toml").write_text(text.replace("[checkpoint]\n", f'[checkpoint]\ninit_from = "{one}"\n'))

    page = write_report([one, two], tmp_path / "both")
    assert page == tmp_path / "both" / "report.html"
    loss = data_of(page)["loss"]
    first, second = loss["tiny: loss"], loss["tiny-phase2: loss"]
    assert second["values"] == first["values"]
    # phase 1's latest complete checkpoint is its last step: phase 2 starts where it ended
    assert second["tokens"][0] == first["tokens"][-1] + first["tokens"][0]

    (two / "recipe.toml").write_text(text)  # not started from it: both from zero, overlaid
    loss = data_of(write_report([one, two], tmp_path / "overlaid"))["loss"]
    assert loss["tiny: loss"]["tokens"] == loss["tiny-phase2: loss"]["tokens"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser, found before the reference run is made for it (a session fixture listed first)."""
    return require("chromium", "the report's browser test opens it (Debian package `chromium`; .ci/run installs it)",
                   program=True, alternatives=("chromium-browser",))


@pytest.mark.slow
def test_a_browser_loads_every_image_and_a_screenshot_is_taken(chromium, reference, tmp_path_factory, tmp_path):
    """Headless Chromium opens the page; a copy with one added script records each image's
    natural width once the page has loaded, and --dump-dom prints it."""
    report = reference_run(tmp_path_factory) / "report"
    probe = report / "probe.html"
    probe.write_text(report.joinpath("report.html").read_text().replace("</body>", (
        "<script>window.addEventListener('load', () => document.body.setAttribute('data-widths', "
        "JSON.stringify([...document.images].map(i => [i.getAttribute('src'), i.naturalWidth]))));</script>"
        "</body>")))
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000"]
    dom = subprocess.run([*browser, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    probe.unlink()
    widths = json.loads(re.search(r'data-widths="([^"]*)"', dom.stdout).group(1).replace("&quot;", '"'))
    assert len(widths) >= 5 and all(width > 0 for _, width in widths), widths

    shot = tmp_path / "report.png"
    subprocess.run([*browser, "--window-size=1100,2400", f"--screenshot={shot}",
                    (report / "report.html").as_uri()], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000


# ---- robustness, on run dirs written by the project's writers -----------------------------


def test_a_cut_last_line_is_dropped_and_a_bad_line_elsewhere_is_named(tmp_path):
    run = fake_run(tmp_path, step_rows(range(1, 6)))
    metrics = run / METRICS_FILE
    metrics.write_text(metrics.read_text() + '{"step": 6, "loss_metrics/glo')  # killed mid-line
    loss = data_of(write_report([run]))["loss"]["loss"]
    assert loss["steps"] == [1, 2, 3, 4, 5]

    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:2], '{"step": 3, "lo', *lines[3:]]) + "\n")
    with pytest.raises(ReportError, match=re.escape(f"{metrics}: line 3: not a JSON object")):
        write_report([run])


def test_one_step_without_evals_and_a_resume_on_another_world_size(tmp_path):
    # n_tokens_seen as torchtitan logs it after a resume on half the ranks (its per-rank count
    # is restored as saved): the token axis must not follow it.
    rows = step_rows([1]) + [{**r, "n_tokens_seen": r["n_tokens_seen"] // 2} for r in step_rows([2])]
    run = fake_run(tmp_path, rows[:1])
    page = write_report([run])
    data = data_of(page)
    assert data["loss"]["loss"] == {"steps": [1], "tokens": [2048], "values": [8.9]}
    assert "no validation in evals/step-N.json" in page.read_text()
    assert "validation" not in data and "core" not in data

    run = fake_run(tmp_path / "resumed", rows)
    assert data_of(write_report([run]))["loss"]["loss"]["tokens"] == [2048, 4096]


def test_skips_and_hook_logged_restarts_are_marked(tmp_path):
    rows = step_rows(range(1, 7))
    rows[2]["skipped_steps"], rows[4]["skipped_steps"] = 0, 2
    rows[0]["launch"], rows[3]["launch"] = 1, 2  # train.callbacks.report at each process's first step
    run = fake_run(tmp_path, rows)
    data = data_of(write_report([run]))
    assert data["grad_norm"]["skipped"] == [{"run": "tiny", "step": 5, "tokens": 5 * 2048, "skipped": 2}]
    assert data["throughput"]["restarts"] == [{"run": "tiny", "step": 3, "tokens": 3 * 2048, "cause": "restart"}]


def test_eval_panels_hold_the_evals_files_numbers(tmp_path):
    """CORE (the average and a panel per task), lm-eval tasks and HumanEval+/MBPP+, from
    evals/step-N.json as the eval hook writes them, with metric names from eval's own results."""
    from eval.core import CoreResult, TaskScore
    from eval.evalplus import EvalPlusResult, Sample, Verdict
    from eval.lm_harness import flat_metrics

    run = fake_run(tmp_path, step_rows([5, 10]))
    written = {}
    for step, acc in ((5, 0.25), (10, 0.5)):
        core = CoreResult({label: TaskScore(label, acc, 10, {"v1": acc - 0.1, "v2": acc - 0.2})
                           for label in ("arc_easy", "piqa")}, missing={})
        lm = flat_metrics({"toy_task": {"acc,none": acc, "acc_stderr,none": 0.1}})
        verdict = Verdict("pass", "pass" if acc > 0.3 else "fail", [], [] if acc > 0.3 else [[1]])
        code = EvalPlusResult("humaneval", False, {"HumanEval/0": [Sample("", "", verdict)]}).metrics()
        written[step] = {**core.metrics(), **lm, **code}
        (run / "evals").mkdir(exist_ok=True)
        (run / "evals" / f"step-{step}.json").write_text(json.dumps({"step": step, "metrics": written[step],
                                                                      "errors": []}))
    data = data_of(write_report([run]))
    for figure, keys in (("core", ["core/partial_CORE_v2", "core/arc_easy/acc", "core/piqa/acc"]),
                         ("lm_eval", ["lm_eval/toy_task/acc"]), ("code", ["humaneval/pass@1", "humaneval+/pass@1"])):
        for key in keys:
            assert data[figure][key] == {"steps": [5, 10], "tokens": [5 * 2048, 10 * 2048],
                                         "values": [written[5][key], written[10][key]]}, key
    assert "lm_eval/toy_task/acc_stderr" not in data["lm_eval"] and "mbpp/pass@1" not in data["code"]


def test_an_unreadable_run_dir_is_named(tmp_path):
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'recipe.toml'}: not found")):
        write_report([tmp_path])
    run = fake_run(tmp_path, step_rows([1]))
    (run / "evals").mkdir()
    (run / "evals" / "step-1.json").write_text('{"step": 1, "metr')
    with pytest.raises(ReportError, match=re.escape(f"{run / 'evals' / 'step-1.json'}: not valid JSON")):
        write_report([run])
    result = subprocess.run([sys.executable, "-m", "report", str(run)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert f"error: {run / 'evals' / 'step-1.json'}: not valid JSON" in result.stderr


def test_the_memory_plan_is_drawn_as_a_stacked_bar_and_against_the_run(tmp_path):
    from plan import GPUS, Shape, memory_plan
    from train.recipe import model_config
    from report.memory import PARTS, plot_memory, record_plan

    run = fake_run(tmp_path, step_rows([1, 2]))
    recipe = R.load(str(run / "recipe.toml"))
    memory = memory_plan(model_config(recipe), Shape.of(recipe, 1), GPUS["h100"])
    figure = plot_memory(memory, tmp_path / "plan.png")
    heights = [p.get_height() for p in figure.axes[0].patches]
    assert heights == pytest.approx([sum(memory.parts.get(k, 0) for k in kinds) / 1024**3
                                     for kinds in PARTS.values()])
    assert sum(heights) == pytest.approx(memory.peak / 1024**3)  # the parts make up the peak
    assert (tmp_path / "plan.png").stat().st_size > 0

    plan = record_plan(run, "h100", 1)
    drawn = data_of(write_report([run]))["memory"]["plan"]
    assert drawn == {"peak_gib": memory.peak / 1024**3, "gpu": plan["gpu"], "gpus": 1}


def test_the_header_shows_what_decontamination_dropped_per_source(tmp_path):
    """The header's row reads each source's manifest (data.decontaminate's entry); tiny.toml's sources have none."""
    from data.shards import FORMAT
    from report.runs import header, read_run

    run = read_run(fake_run(tmp_path, step_rows(range(1, 3))))
    assert dict(header(run))["decontamination"] == "none of the 2 sources"
    code = tmp_path / "code"
    code.mkdir()
    (code / "manifest.json").write_text(json.dumps({"format": FORMAT, "decontamination": {
        "n_grams": 12, "dropped": {"humaneval": 3, "mbpp": 1200}}}))
    run.recipe["data"]["sources"][0]["path"] = str(code)
    run.recipe["data"]["sources"][1]["path"] = str(tmp_path / "elsewhere")
    assert dict(header(run))["decontamination"] == (f"{run.recipe['data']['sources'][0]['name']}: humaneval 3, "
                                                   f"mbpp 1,200 documents dropped (12-grams); "
                                                   f"{run.recipe['data']['sources'][1]['name']}: no manifest here")


# ---- a long-context phase after its base run -----------------------------------------------------


def write_evals(run: Path, evals: dict[int, dict]) -> None:
    """``evals/step-N.json`` as the eval callback writes them."""
    (run / "evals").mkdir(exist_ok=True)
    for step, metrics in evals.items():
        (run / "evals" / f"step-{step}.json").write_text(json.dumps({"step": step, "metrics": metrics, "errors": []}))


def long_phase(tmp_path: Path, base: Path, *sets: str) -> Path:
    """tiny.toml at 4x its length (512), validated at 128 and 512, started from ``base``'s step-5 checkpoint."""
    return fake_run(tmp_path, step_rows(range(1, 9)), steps=8, sets=(
        "run.name=tiny-long", "training.seq_len=512", "model.max_seq_len=512", "eval.val_seq_lens=[128, 512]",
        "eval.position_buckets=4", f"checkpoint.init_from={base / 'checkpoints' / 'step-5'}", *sets))


def by_position(length: int, losses: list[float]) -> dict[str, float]:
    from eval.position_loss import bucket_edges, position_metric

    edges = bucket_edges(length, len(losses))
    return {position_metric(a, b): v for a, b, v in zip(edges, edges[1:], losses)}


def test_loss_by_position_of_a_base_run_and_its_long_phase_on_one_figure(tmp_path):
    """Each run's latest eval that has the loss by position, from its evals files; the long phase has no
    bucket past 256 in its last eval (no token reached it), so none is drawn there."""
    base = fake_run(tmp_path / "base", step_rows(range(1, 11)), sets=("eval.position_buckets=4",))
    write_evals(base, {5: by_position(128, [6.0, 5.0, 4.5, 4.4]), 10: by_position(128, [5.5, 4.6, 4.2, 4.1]),
                       11: {"eval/val_loss": 4.0}})  # a later eval without it: the one before is drawn
    long = long_phase(tmp_path / "long", base)
    positions = by_position(512, [5.0, 4.0, 3.5, 3.4])
    write_evals(long, {4: by_position(512, [9.0, 9.0, 9.0, 9.0]), 8: {k: v for k, v in positions.items()
                                                                      if not k.endswith("-512")}})
    data = data_of(write_report([base, long], tmp_path / "report"))["position_loss"]
    assert data == {"tiny: step 10": {"step": 10, "start": [0, 32, 64, 96], "end": [32, 64, 96, 128],
                                      "values": [5.5, 4.6, 4.2, 4.1], "seq_len": 128},
                    "tiny-long: step 8": {"step": 8, "start": [0, 128, 256], "end": [128, 256, 384],
                                          "values": [5.0, 4.0, 3.5], "seq_len": 512}}
    assert "no loss by position" in write_report([fake_run(tmp_path / "none", step_rows([1]))]).read_text()


def test_the_phase_comparison_shows_the_short_context_before_and_after_the_phase(tmp_path):
    """The base's last eval by the step the phase started from (step 4 of evals at 4 and 8: it started from
    step 5) against the phase's last eval, at the base's length: the phase's ``@128`` loss, per set and
    over all sets, and CORE; a phase that adds a held-out set drops the over-all row; one that did not
    validate at 128 is told how. The loss at each length is drawn too."""
    from train.metric_names import VAL_LOSS, at_length, per_set

    def losses(key: str, prose: float, code: float) -> dict[str, float]:
        return {key: (prose + code) / 2, per_set(key, "prose"): prose, per_set(key, "code"): code}

    base = fake_run(tmp_path / "base", step_rows(range(1, 11)))
    write_evals(base, {4: {**losses(VAL_LOSS, 4.0, 3.0), "core/CORE_v1": 0.20},
                       8: {**losses(VAL_LOSS, 3.0, 2.0), "core/CORE_v1": 0.30}})
    long = long_phase(tmp_path / "long", base)
    short = at_length(VAL_LOSS, 128, 512)
    assert short == "eval/val_loss@128"
    write_evals(long, {4: losses(short, 9.0, 9.0), 8: {**losses(short, 3.9, 3.1), **losses(VAL_LOSS, 3.0, 2.5),
                                                       "core/CORE_v1": 0.25}})
    page = write_report([base, long], tmp_path / "report")
    (comparison,) = data_of(page)["phase_comparison"]
    assert {k: comparison[k] for k in ("run", "parent", "length", "before_step", "after_step", "note")} == {
        "run": "tiny-long", "parent": "tiny", "length": 128, "before_step": 4, "after_step": 8, "note": ""}
    assert comparison["rows"] == [
        {"metric": "held-out loss at 128", "before": 3.5, "after": 3.5, "recovered": True},
        {"metric": "held-out loss at 128: code", "before": 3.0, "after": 3.1, "recovered": False},
        {"metric": "held-out loss at 128: prose", "before": 4.0, "after": 3.9, "recovered": True},
        {"metric": "core/CORE_v1", "before": 0.20, "after": 0.25, "recovered": True}]
    assert "<h3>tiny-long after tiny (short context: 128)</h3>" in page.read_text()
    lengths = data_of(page)["validation_lengths"]  # each run's loss at each length it validated at
    assert {k: v["values"] for k, v in lengths.items()} == {"tiny: at 128": [3.5, 2.5], "tiny-long: at 128": [9.0, 3.5],
                                                            "tiny-long: at 512": [2.75]}

    write_evals(long, {8: {**losses(short, 3.9, 3.1), per_set(short, "passkey"): 0.5}})
    (comparison,) = data_of(write_report([base, long], tmp_path / "report"))["phase_comparison"]
    assert [r["metric"] for r in comparison["rows"]] == ["held-out loss at 128: code", "held-out loss at 128: prose"]

    unvalidated = long_phase(tmp_path / "unvalidated", base, "eval.val_seq_lens=[]")
    write_evals(unvalidated, {8: losses(VAL_LOSS, 3.0, 2.5)})
    (comparison,) = data_of(write_report([base, unvalidated], tmp_path / "report"))["phase_comparison"]
    assert comparison["note"] == ("tiny-long's last eval has no held-out loss at 128, the length tiny trained at: "
                                  "add 128 to its [eval] val_seq_lens")
    assert [r["after"] for r in comparison["rows"]] == [None, None, None]
    assert "phase_comparison" not in data_of(write_report([base], tmp_path / "alone"))
