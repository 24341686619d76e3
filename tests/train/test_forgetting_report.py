"""python -m report.forgetting: the Pareto front on points made by hand (the expectation worked out below,
point by point), the replay share and the general/phase-2 split from the mixes, the figure's embedded data
for a replay sweep written without training (recipes/sweeps/tiny-replay.toml's variants, resolved and
recorded by launch.sweep's own code), and merges at weight 0 and 1 landing on their ends: two random tiny
models as phase 1 and phase 2, their runs' evals scored as the training loop scores them, the merges
written by models.laneformer.merge and scored by eval.run."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import rundir
from launch.sweep.runs import runs_of, write_record
from launch.sweep.spec import read_sweep, variants
from rundir import REPO
from train import recipe as R
from train.metric_names import VAL_LOSS, per_set
from report.forgetting import main, pareto_front, replay_share, split_sets
from report.page import embedded_data

REPLAY = REPO / "recipes" / "sweeps" / "tiny-replay.toml"
LAST = 100  # tiny-phase2's steps
PHASE1_STEP = 300  # tiny's


def test_the_front_holds_the_points_no_other_point_dominates():
    # (general, code), both lower is better. By hand:
    points = {
        "a": (1.0, 5.0),  # on: nothing has x <= 1 except h (0.5), whose y 6 is worse
        "b": (2.0, 3.0),  # on: only f ties it; no point is <= on both and < on one
        "c": (3.0, 3.0),  # off: b has the same y and a smaller x
        "d": (4.0, 1.0),  # on: the best y
        "e": (2.0, 4.0),  # off: b has the same x and a smaller y
        "f": (2.0, 3.0),  # on: b's twin; equal points do not dominate each other
        "g": (5.0, 5.0),  # off: dominated by every one of a, b, d
        "h": (0.5, 6.0),  # on: the best x
    }
    expected = {"a": True, "b": True, "c": False, "d": True, "e": False, "f": True, "g": False, "h": True}
    got = pareto_front(list(points.values()), (False, False))
    assert dict(zip(points, got)) == expected
    # CORE (higher is better) against code loss: (0.30, 2.0) beats (0.25, 2.0); (0.20, 1.5) has the best loss.
    assert pareto_front([(0.30, 2.0), (0.25, 2.0), (0.20, 1.5), (0.10, 1.6)], (True, False)) == [True, False, True,
                                                                                                 False]
    assert pareto_front([(1.0, 1.0)], (False, False)) == [True]


def test_the_replay_share_and_the_split_come_from_the_mixes():
    phase1, phase2 = {"prose": 0.5, "code": 0.5}, {"code": 0.8, "prose": 0.2}
    assert replay_share({"code": 0.65, "prose": 0.35}, phase2, phase1) == pytest.approx(0.5)
    assert replay_share(phase2, phase2, phase1) == 0.0 and replay_share(phase1, phase2, phase1) == pytest.approx(1)
    assert replay_share({"code": 0.6, "prose": 0.2, "math": 0.2}, phase2, phase1) is None  # not on the line
    assert replay_share(phase1, phase1, phase1) is None  # the two ends are one mix
    assert split_sets(["prose", "code", "books"], phase1, phase2) == (["prose", "books"], ["code"])
    assert split_sets(["web", "sft-code"], {"web": 1.0}, {"web": 0.5, "sft-code": 0.5}) == (["web"], ["sft-code"])


# ---- a replay sweep written without training ----------------------------------------------------

# Each variant's held-out losses at step 100, by its replay share, and phase 1's at its last step. By hand,
# (prose, code), lower is better: phase 1 (3.30, 2.60) has the best prose; r=0 (3.60, 2.00) the best code;
# r=0.5 (3.45, 2.15) and r=1 (3.35, 2.40) trade between them; r=0.25 (3.55, 2.35) is beaten on both by
# r=0.5: off the front. CORE (higher is better) with code loss: phase 1 0.20, r=0 0.10, r=0.25 0.12, r=0.5
# 0.15, r=1 0.18: every point beats r=0.25's 0.12 at 2.35 except r=0 (lower CORE), so r=0.25 is off again.
LOSSES = {0.0: (3.60, 2.00), 0.25: (3.55, 2.35), 0.5: (3.45, 2.15), 1.0: (3.35, 2.40)}
CORE = {0.0: 0.10, 0.25: 0.12, 0.5: 0.15, 1.0: 0.18}
PHASE1 = (3.30, 2.60)
PHASE1_CORE = 0.20
FRONT = ["phase 1 (tiny step 300)", "replay 0", "replay 0.5", "replay 1"]


def write_evals(run: Path, step: int, metrics: dict[str, float]) -> None:
    """What the eval callback leaves for a step: metrics.jsonl's row and evals/step-N.json."""
    with open(run / rundir.METRICS_FILE, "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    out = rundir.eval_file(run, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"step": step, "metrics": metrics, "errors": []}))


def losses(prose: float, code: float, core: float | None = None) -> dict[str, float]:
    out = {VAL_LOSS: (prose + code) / 2, per_set(VAL_LOSS, "prose"): prose, per_set(VAL_LOSS, "code"): code}
    return {**out, **({"core/CORE_v1": core, "core/CORE_v2": core + 0.01} if core is not None else {})}


def fake_phase1(run: Path, metrics: dict[str, float], model=None) -> Path:
    """tiny.toml's run as training leaves it, as far as the report reads: its resolved recipe, an eval at its
    last step and that step's checkpoint (``model``'s weights in DCP, else an empty complete one)."""
    from models.laneformer import write_native_config

    run.mkdir(parents=True)
    (run / rundir.RECIPE_FILE).write_text(R.to_toml(R.load("tiny.toml", [f'run.output_dir="{run}"'])))
    write_evals(run, PHASE1_STEP, metrics)
    checkpoint(run, PHASE1_STEP, model)
    if model is not None:
        write_native_config(model.config, run)
    return run


def checkpoint(run: Path, step: int, model) -> None:
    from models.laneformer.hf.checkpoint_io import save_dcp

    step_dir = rundir.step_dir(run, step)
    if model is None:
        step_dir.mkdir(parents=True)
        (step_dir / ".metadata").write_text("")  # complete, as far as the run's layout says
    else:
        save_dcp({k: v.detach().clone() for k, v in model.state_dict().items()}, step_dir)


def fake_replay_sweep(root: Path, phase1: Path, metrics_of, model_of=lambda share: None,
                      sweep_file: Path = REPLAY) -> Path:
    """tiny-replay.toml's sweep dir without training: the variants resolved (init_from ``phase1``) and
    sweep.json written by launch.sweep's own code, each run's recipe.toml its variant's resolved recipe,
    ``metrics_of(share)`` logged at steps 50 (0.5 worse) and 100 (seed k: 0.02 x (k - 1) worse), and a
    checkpoint at step 100."""
    sweep = read_sweep(sweep_file, [f'checkpoint.init_from="{phase1}"'])
    found, _ = variants(sweep, 1, root)  # checked as launch.sweep checks them; a fake phase 1 may not pass
    runs = runs_of(found, sweep, root)
    write_record(root, sweep, found, runs, {r.dir: "done" for r in runs}, "local")
    for r in runs:
        code = next(s.weight for s in r.variant.recipe.data.sources if s.name == "code")
        share = round((0.8 - code) / 0.3 * 4) / 4  # code 0.8 - 0.3 r (the sweep file's comment)
        r.dir.mkdir()
        (r.dir / rundir.RECIPE_FILE).write_text(R.to_toml(r.variant.recipe))
        seed = 0.02 * (r.seed - 1)
        write_evals(r.dir, 50, {k: v + 0.5 + seed for k, v in metrics_of(share).items()})
        write_evals(r.dir, LAST, {k: v + seed for k, v in metrics_of(share).items()})
        checkpoint(r.dir, LAST, model_of(share))
        if (model := model_of(share)) is not None:
            from models.laneformer import write_native_config

            write_native_config(model.config, r.dir)
    return root


def test_the_figure_holds_every_variant_phase_1_and_the_front(tmp_path, capsys):
    phase1 = fake_phase1(tmp_path / "tiny", losses(*PHASE1, PHASE1_CORE))
    root = fake_replay_sweep(tmp_path / "tiny-replay", phase1, lambda r: losses(*LOSSES[r], CORE[r]))
    assert main([str(root), "--no-merges"]) == 0
    printed = capsys.readouterr().out
    page = root / "forgetting" / rundir.REPORT_PAGE
    assert printed.rstrip().endswith(str(page))
    data = embedded_data(page.read_text())["forgetting"]
    assert data["general_sets"] == ["prose"] and data["code_sets"] == ["code"]  # phase 2 up-weights code
    assert data["tokens"] == LAST * 16 * 128 and data["phase1"] == "tiny step 300"
    points = {p["label"]: p for p in data["points"]}
    assert list(points) == ["phase 1 (tiny step 300)", "replay 0", "replay 0.25", "replay 0.5", "replay 1"]
    assert (points["phase 1 (tiny step 300)"]["general"], points["phase 1 (tiny step 300)"]["code"]) == PHASE1
    for r, (prose, code) in LOSSES.items():
        p = points[f"replay {r:g}"]
        assert (p["general"], p["code"], p["core"], p["kind"]) == (prose, code, CORE[r], "variant")
        assert p["replay"] == pytest.approx(r, abs=1e-12)  # from the recipes' weights
    assert data["front"] == FRONT
    assert [p["on_front"] for p in data["points"]] == [True, True, False, True, True]
    assert data["core_key"] == "core/CORE_v1"  # both versions are there: the first, as the sweep report picks
    assert data["core_front"] == FRONT
    assert (root / "forgetting" / "forgetting.png").stat().st_size > 0
    rows = {r["label"]: r for r in csv.DictReader(open(root / "forgetting" / "forgetting.csv"))}
    assert rows["replay 0.25"]["on_front"] == "False" and rows["replay 0"]["code"] == "2.0"
    line = next(line for line in printed.splitlines() if line.startswith("replay 0 "))
    assert "+0.3000" in line and "-0.6000" in line  # phase 2 costs 0.3 of general loss and gains 0.6 on code


def test_a_variant_of_several_seeds_is_their_mean_and_its_seeds_are_no_candidates(tmp_path):
    sweep_file = tmp_path / "tiny-replay.toml"
    sweep_file.write_text(REPLAY.read_text().replace("seeds = [1]", "seeds = [1, 2]"))
    phase1 = fake_phase1(tmp_path / "tiny", losses(*PHASE1))
    root = fake_replay_sweep(tmp_path / "tiny-replay", phase1, lambda r: losses(*LOSSES[r]), sweep_file=sweep_file)
    assert main([str(root), "--no-merges"]) == 0
    data = embedded_data((root / "forgetting" / rundir.REPORT_PAGE).read_text())["forgetting"]
    points = {p["label"]: p for p in data["points"]}
    assert points["replay 0.5"]["general"] == pytest.approx(LOSSES[0.5][0] + 0.01)  # seeds 1 and 2: +0 and +0.02
    assert points["replay 0.5 seed 2"]["code"] == pytest.approx(LOSSES[0.5][1] + 0.02)
    assert points["replay 0.5 seed 1"]["kind"] == "seed" and points["replay 0.5"]["source"] == \
        "data.sources.code.weight=0.65,data.sources.prose.weight=0.35"
    assert data["front"] == FRONT  # seed 1 of replay 0 alone would beat its mean: seeds are not candidates
    assert not any(p["on_front"] for p in data["points"] if p["kind"] == "seed")


def test_named_sets_and_bad_input(tmp_path, capsys):
    phase1 = fake_phase1(tmp_path / "tiny", losses(*PHASE1))
    root = fake_replay_sweep(tmp_path / "tiny-replay", phase1, lambda r: losses(*LOSSES[r]))
    assert main([str(root), "--no-merges", "--general", "code", "--code", "prose"]) == 0  # swapped on purpose
    data = embedded_data((root / "forgetting" / rundir.REPORT_PAGE).read_text())["forgetting"]
    assert data["points"][1]["general"] == LOSSES[0.0][1] and data["core_key"] is None
    capsys.readouterr()
    assert main([str(root), "--no-merges", "--general", "books"]) == 2
    assert "--general/--code: books: not a held-out set every point was scored on (code, prose)" in \
        capsys.readouterr().err
    assert main([str(tmp_path), "--no-merges"]) == 2
    assert "not a sweep record launch.sweep wrote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(root), "--merge-weights", "0,1.5"])


# ---- merges at weight 0 and 1 land on their ends ------------------------------------------------


def loop_validation(model, recipe: R.Recipe) -> dict[str, float]:
    """The eval callback's held-out losses of ``model`` (train.callbacks.eval), as a run of ``recipe`` scores them."""
    import torch

    from data.tokenizer import Tokenizer
    from eval.spec import EvalSpec
    from train.callbacks.eval import Eval

    t = recipe.training
    hook = Eval(Eval.Config(spec=EvalSpec(val_samples=recipe.eval.val_samples),
                            val_sets=R.validation_sets(recipe)), trainer=None)
    trainer = SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(seq_len=t.seq_len,
                                                                              local_batch_size=t.micro_batch)),
                              tokenizer=SimpleNamespace(tokenizer=Tokenizer(recipe.data.tokenizer)),
                              model_parts=[model], device="cpu")
    with torch.no_grad():
        return {k: v for k, v in hook.validation(trainer).items() if k.startswith(VAL_LOSS + "/") or k == VAL_LOSS}


def test_merges_at_weight_0_and_1_land_on_their_ends(tmp_path, capsys):
    """Phase 1 and the baseline variant are two random tiny models, their runs' evals the loop's numbers;
    the other variants log made-up ones. The merges at 0 and 1, written and scored by the commands, land
    on phase 1's and the baseline's points (eval.run on an export against the loop: rel 1e-5); the one at
    0.5 lands on neither."""
    import torch

    from tests.conftest import tiny_random_model

    first, second = tiny_random_model(seed=0), tiny_random_model(seed=1)
    with torch.no_grad():
        second.lm_head.weight.mul_(4)  # the two ends apart on both axes
    recipe = R.load("tiny-phase2.toml", ['checkpoint.init_from=""'])
    ends = {"phase 1": loop_validation(first, recipe), "phase 2": loop_validation(second, recipe)}
    phase1 = fake_phase1(tmp_path / "tiny", ends["phase 1"], model=first)
    root = fake_replay_sweep(tmp_path / "tiny-replay", phase1,
                             lambda r: ends["phase 2"] if r == 0 else losses(*LOSSES[r]),
                             lambda r: second if r == 0 else None)
    assert main([str(root), "--merge-weights", "0,0.5,1", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    data = embedded_data((root / "forgetting" / rundir.REPORT_PAGE).read_text())["forgetting"]
    points = {p["label"]: p for p in data["points"]}
    start, end = points["phase 1 (tiny step 300)"], points["replay 0"]
    assert [(p["kind"], p["weight"]) for p in data["points"][-3:]] == [("merge", 0.0), ("merge", 0.5), ("merge", 1.0)]
    for merge, ref in (("merge w=0", start), ("merge w=1", end)):
        assert points[merge]["sets"] == pytest.approx(ref["sets"], rel=1e-5), merge
        assert (points[merge]["general"], points[merge]["code"]) == pytest.approx((ref["general"], ref["code"]),
                                                                                 rel=1e-5)
    assert min(abs(start["general"] - end["general"]), abs(start["code"] - end["code"])) > 0.05
    middle = points["merge w=0.5"]
    assert all(abs(middle["general"] - p["general"]) > 1e-3 for p in (start, end))
    merges = root / "forgetting" / "merges"
    assert (merges / "w0.5" / "config.json").is_file()  # an HF export: eval.run, generate, init_from take it
    record = json.loads((merges / "w0.5.json").read_text())
    assert record["inputs"]["weights"] == [0.5, 0.5]
    assert record["inputs"]["checkpoints"] == [str(rundir.step_dir(phase1, PHASE1_STEP)),
                                               str(rundir.step_dir(Path(end["source"]), LAST))]
    assert "merges: phase 1 (tiny step 300) with" in printed
    assert main([str(root), "--merge-weights", "0,0.5,1", "--device", "cpu"]) == 0  # again: the scores are reused
    assert capsys.readouterr().out.count("scores reused from") == 3
    assert math.isfinite(middle["code"])
