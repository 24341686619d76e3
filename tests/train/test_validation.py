"""Every check before anything is written (train.build.preflight): each problem is
reported as ``file: [table] key: why``; train.py then exits 2 with no run dir, and
``--dry-run`` gives the same verdict. Then validation at several lengths (``[eval]
val_seq_lens``): each length scores the same held-out tokens, against torch's own loss."""

import os
import subprocess
import sys

import pytest

from rundir import REPO
from tests.conftest import env
from train import recipe as R
from train.build import preflight


def tiny(tmp_path, *sets):
    return R.load("tiny.toml", [f"run.output_dir={tmp_path / 'run'}", *sets])


def problems(recipe):
    return preflight(recipe, world_size=1).problems


def test_the_tiny_recipe_passes_every_check(tmp_path):
    checked = preflight(tiny(tmp_path), world_size=1)
    assert checked.problems == []
    assert checked.config.vocab_size == 4096 and checked.mixture is not None
    assert not (tmp_path / "run").exists()


def complete_step(run, step):
    folder = run / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing", "[checkpoint] init_from: {init} does not exist"),
    ("incomplete", "[checkpoint] init_from: {init} holds no complete checkpoint"),
])
def test_init_from_must_hold_a_complete_checkpoint(tmp_path, case, message):
    init = tmp_path / "p1"
    if case == "incomplete":
        (init / "checkpoints" / "step-40").mkdir(parents=True)  # no .metadata: half-written
    (found,) = problems(tiny(tmp_path, f"checkpoint.init_from={init}"))
    assert found.startswith(f"{REPO / 'recipes' / 'tiny.toml'}: " + message.format(init=init))


def test_init_from_resolves_to_the_latest_complete_step(tmp_path):
    from train.build import initial_load

    init = tmp_path / "p1"
    complete_step(init, 20)
    complete_step(init, 40)
    (init / "checkpoints" / "step-60").mkdir()  # incomplete: skipped
    assert initial_load(tiny(tmp_path, f"checkpoint.init_from={init}")) == (str(init / "checkpoints" / "step-40"), False)
    assert problems(tiny(tmp_path, f"checkpoint.init_from={init}")) == []


@pytest.mark.parametrize("override, message", [
    ('model.max_seq_len="256"', "[model] max_seq_len: expected int, got '256'"),
    ("model.early_mode=1", "[model] early_mode: must be one of ['present', 'scaled'], got 1"),
    ("model.window_layers=[0.5]", "[model] window_layers[0]: expected int, got 0.5"),
    ("model.rope_theta=true", "[model] rope_theta: expected float, got True"),
    ("model.inner_attention=1", "[model] has unknown key 'inner_attention'"),
])
def test_model_overrides_are_type_checked_against_the_model_config(tmp_path, override, message):
    (found,) = problems(tiny(tmp_path, override))
    # the key came from the command line, so the error names the --set (over the file)
    assert found.startswith(f"--set {override} (over {REPO / 'recipes' / 'tiny.toml'}): {message}")


def test_every_bad_key_is_reported_at_once_each_naming_who_gave_it(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text((REPO / "recipes" / "tiny.toml").read_text().replace("lr = 3e-3", "lrr = 3e-3\nbetaz = 1"))
    with pytest.raises(R.RecipeError) as e:
        R.load(str(recipe), ["training.stepz=3", "training.steps=abc"])
    lines = str(e.value).splitlines()
    assert lines == [
        f"{recipe}: [optimizer] has unknown key 'lrr'; did you mean 'lr'?",
        f"{recipe}: [optimizer] has unknown key 'betaz'; did you mean 'betas'?",
        f"{recipe}: [optimizer] missing key 'lr'",
        f"--set training.stepz=3 (over {recipe}): [training] has unknown key 'stepz'; did you mean 'steps'?",
        f"--set training.steps=abc (over {recipe}): [training] steps: expected int | None, got 'abc'",
    ]


def test_model_overrides_of_the_right_type_reach_the_model(tmp_path):
    checked = preflight(tiny(tmp_path, "model.rope_theta=500000", "model.window_layers=[1]"), world_size=1)
    assert checked.problems == []
    assert checked.config.rope_theta == 500000.0 and checked.config.window_layers == [1]


def test_a_missing_tokenizer_is_named_and_the_llama2_one_says_how_to_get_it(tmp_path):
    from data.tokenizer import LLAMA2_TOKENIZER

    (found,) = problems(tiny(tmp_path, f"data.tokenizer={tmp_path / 'nope.model'}"))
    assert found == f"{REPO / 'recipes' / 'tiny.toml'}: [data] tokenizer: {tmp_path / 'nope.model'} not found"
    llama2 = [p for p in problems(R.load("phase1.toml")) if "[data] tokenizer" in p]
    if LLAMA2_TOKENIZER.is_file():  # the README's tokenizer step was followed: the right file passes
        assert llama2 == []
    else:
        assert len(llama2) == 1 and "get it with: python -m data.tokenizer fetch" in llama2[0]


def test_a_tokenizer_with_another_sha256_is_refused_naming_both(tmp_path):
    from data.tokenizer import LLAMA2_SHA256, TINY_TOKENIZER, fingerprint

    (found,) = problems(tiny(tmp_path, f'data.tokenizer_sha256="{LLAMA2_SHA256}"'))
    assert found.startswith(f"{REPO / 'recipes' / 'tiny.toml'}: [data] tokenizer_sha256: {TINY_TOKENIZER} has "
                            f"sha256 {fingerprint(TINY_TOKENIZER)} ")
    assert f"expected {LLAMA2_SHA256} (the Llama-2 tokenizer.model, 499,723 bytes)" in found
    assert problems(tiny(tmp_path, f'data.tokenizer_sha256="{fingerprint(TINY_TOKENIZER)}"')) == []
    with pytest.raises(R.RecipeError, match=r"\[data\] tokenizer_sha256: expected 64 lowercase hex digits"):
        tiny(tmp_path, 'data.tokenizer_sha256="abc"')


def test_a_missing_data_source_is_named_with_the_command_that_makes_it(tmp_path):
    """From the Hub when the source names a hub_id (train.data reads the recipe), else from your files."""
    recipe, gone = REPO / "recipes" / "tiny.toml", tmp_path / "gone"
    found = problems(tiny(tmp_path, f"data.sources=[{{name = \"gone\", path = \"{gone}\", weight = 1.0, "
                                    f"hub_id = \"org/corpus\"}}]"))
    assert found == [f"{recipe}: [data.sources[0]] path: {gone} not found "
                     f"(source 'gone'; make it with python -m train.data tokenize --recipe {recipe} --source gone)"]
    found = problems(tiny(tmp_path, f"data.sources=[{{name = \"gone\", path = \"{gone}\", weight = 1.0}}]"))
    assert found == [f"{recipe}: [data.sources[0]] path: {gone} not found (source 'gone'; make it with "
                     f"python -m data.tokenize --input <your jsonl/parquet files> --text-key text "
                     f"--tokenizer {REPO / 'assets' / 'tokenizer' / 'tokenizer.model'} --out {gone})"]


def test_missing_eval_files_are_refused_before_the_run_starts(tmp_path):
    """An in-loop eval that could only fail: said at launch, not at the first eval hours later."""
    found = problems(tiny(tmp_path, f"eval.core_bundle={tmp_path / 'no-bundle'}",
                          f"eval.lm_eval_tasks={tmp_path / 'no-tasks.json'}"))
    tiny_toml = REPO / "recipes" / "tiny.toml"
    assert found == [f"{tiny_toml}: [eval] CORE bundle {tmp_path / 'no-bundle'}: no tasks.csv (no such folder); "
                     "get the bundle with python -m eval.core_data fetch DIR",
                     f"{tiny_toml}: [eval] lm-eval tasks {tmp_path / 'no-tasks.json'}: [Errno 2] No such file or "
                     f"directory: '{tmp_path / 'no-tasks.json'}'"]


def test_an_unwritable_export_dir_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("")  # a dir cannot be made below a file, even by root
    (found,) = problems(tiny(tmp_path, "checkpoint.export_hf=true", f"checkpoint.export_dir={tmp_path / 'a-file' / 'hf'}"))
    assert found == f"{REPO / 'recipes' / 'tiny.toml'}: [checkpoint] export_dir: {tmp_path / 'a-file' / 'hf'} is not writable"


def test_train_py_reports_every_problem_exits_2_and_writes_nothing(tmp_path):
    """A launch and a dry run: the same checks, the same verdict, no run dir."""
    (tmp_path / "a-file").write_text("")
    sets = [f"run.output_dir={tmp_path / 'run'}", 'model.max_seq_len="256"', f"checkpoint.init_from={tmp_path / 'p1'}",
            f"data.tokenizer={tmp_path / 'nope.model'}", "checkpoint.export_hf=true",
            f"checkpoint.export_dir={tmp_path / 'a-file' / 'hf'}", "parallel.replicate=2"]
    tiny_toml = REPO / "recipes" / "tiny.toml"
    expected = [f"{tiny_toml}: [parallel] replicate: 2 does not divide the 1 ranks",
                f'--set model.max_seq_len="256" (over {tiny_toml}): [model] max_seq_len: expected int',
                f"{tiny_toml}: [checkpoint] init_from:", f"{tiny_toml}: [data] tokenizer:",
                f"{tiny_toml}: [checkpoint] export_dir:"]
    for extra in ([], ["--dry-run"]):
        cmd = [sys.executable, str(REPO / "train.py"), "--recipe", "tiny.toml", *extra]
        for s in sets:
            cmd += ["--set", s]
        result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == len(expected), result.stderr[-2000:]
        for line, what in zip(errors, expected):
            assert line.startswith(f"error: {what}")
        assert not (tmp_path / "run").exists()


def test_sources_are_source_specs_checked_once_with_the_recipe_named(tmp_path):
    from data.mixture import SourceSpec

    recipe = tiny(tmp_path)
    assert all(type(s) is SourceSpec and s.path.startswith("/") for s in recipe.data.sources)
    with pytest.raises(R.RecipeError, match=r"tiny\.toml: \[data\.sources\[0\]\] source 'x' .*: weight must be finite and >= 0"):
        tiny(tmp_path, 'data.sources=[{name = "x", path = "p", weight = -1.0}]')


def test_paths_are_absolute_once_resolved(tmp_path):
    r = R.load("tiny.toml", ["eval.val_sources=[\"assets/chat/held_out\"]", "checkpoint.init_from=runs/x"])
    assert r.data.tokenizer == str(REPO / "assets/tokenizer/tokenizer.model")
    assert r.eval.val_sources == [str(REPO / "assets/chat/held_out")]
    assert r.checkpoint.init_from == str(REPO / "runs/x")
    assert r.checkpoint.export_dir == str(r.output_dir / "hf")
    assert r.run.output_dir == str(REPO / "runs" / "tiny")


def test_no_config_builder_sets_environment_variables(tmp_path, monkeypatch):
    from train.build import trainer_config

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    trainer_config(tiny(tmp_path), 1)
    assert "WANDB_PROJECT" not in os.environ


def test_one_set_grammar_for_train_convert_and_eval():
    from models.laneformer.checkpoint import parse_overrides

    sets = ["window_layers=[0, 1]", "late_mode=flush", "rope_theta=5e5", 'early_mode="scaled"']
    recipe = R.load("tiny.toml", [f"model.{s}" for s in sets])
    assert recipe.model.overrides == {"max_seq_len": 256, **parse_overrides(sets)}  # tiny.toml sets max_seq_len
    assert parse_overrides(sets) == {"window_layers": [0, 1], "late_mode": "flush", "rope_theta": 5e5,
                                     "early_mode": "scaled"}


def test_the_local_launcher_refuses_before_it_records_a_launch(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launch.local", "--recipe", "tiny.toml",
                             "--set", f"run.output_dir={tmp_path / 'run'}", "--set", f"checkpoint.init_from={tmp_path / 'p1'}"],
                            cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"[checkpoint] init_from: {tmp_path / 'p1'} does not exist" in result.stderr
    assert not (tmp_path / "run").exists()


def test_srun_without_torchrun_is_refused_before_anything_is_written(tmp_path):
    """Plain ``python train.py`` is one rank; several SLURM tasks so started would each train alone in
    one run dir: refused, with the command to use."""
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--recipe", "tiny.toml",
                             "--set", f"run.output_dir={tmp_path / 'run'}"], cwd=REPO,
                            env={**env(), "SLURM_NTASKS": "4"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "4 SLURM tasks started train.py without torchrun" in result.stderr
    assert "python -m launch.slurm submit" in result.stderr
    assert not (tmp_path / "run").exists()


# ---- [eval] val_seq_lens and position_buckets -------------------------------------------------


@pytest.mark.parametrize("override, message", [
    # a type is checked by the loader, which names the --set; a value by EvalSpec, named with the file
    ("eval.val_seq_lens=[4096, 1.5]", "--set {override} (over {file}): [eval] val_seq_lens[1]: expected int, got 1.5"),
    ('eval.val_seq_lens="4096"', "--set {override} (over {file}): [eval] val_seq_lens: expected list, got '4096'"),
    ("eval.val_seq_lens=[4096, 0]", "{file}: [eval] val_seq_lens: every length must be > 0 (got [4096, 0])"),
    ("eval.position_buckets=-1", "{file}: [eval] position_buckets: must be >= 0 (got -1; 0: none)"),
])
def test_validation_lengths_and_buckets_are_checked_with_the_recipe(tmp_path, override, message):
    with pytest.raises(R.RecipeError) as e:
        tiny(tmp_path, override)
    assert str(e.value) == message.format(override=override, file=REPO / "recipes" / "tiny.toml")


def test_the_run_s_own_length_is_always_validated(tmp_path):
    assert tiny(tmp_path).eval.spec().lengths(128) == [128]
    assert tiny(tmp_path, "eval.val_seq_lens=[512, 64, 128]").eval.spec().lengths(128) == [64, 128, 512]
    assert tiny(tmp_path, "eval.val_seq_lens=[512]").eval.spec().lengths(128) == [128, 512]


def test_each_length_validates_the_same_tokens_with_its_own_context(tmp_path):
    """A run at 64 validating at 32 and 128 too: each set's first 4 x 64 tokens, cut into 8 rows of 32, 4 of
    64 and 2 of 128; each length's loss against torch's cross-entropy of the model's logits on those rows,
    named by train.metric_names.at_length (the run's own length keeps the plain names); the position
    buckets span the longest length."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from data.mixture import IGNORE_INDEX
    from eval.position_loss import bucket_of, position_metric
    from tests.data.test_held_out_split import write_source
    from tests.eval.test_position_loss import SEQ_LEN, callback_validation, documents, mixture, tiny_model
    from train.metric_names import VAL_BPB, VAL_LOSS, at_length, per_set

    sets = {"plain": str(write_source(tmp_path / "plain", [documents(40, 1, 150)])),
            "masked": str(write_source(tmp_path / "masked", [documents(40, 2, 150)], loss=True))}
    model = tiny_model()
    got = callback_validation(model, sets, val_samples=4, val_seq_lens=[128, 32], position_buckets=4)
    assert [k for k in got if bucket_of(k)] == [position_metric(a, a + 32) for a in (0, 32, 64, 96)]
    assert {k: got[k] for k in got if not bucket_of(k)} == pytest.approx(callback_validation(
        model, sets, val_samples=4, val_seq_lens=[128, 32]))  # buckets add names, change no number

    for length, rows in ((32, 8), (SEQ_LEN, 4), (128, 2)):
        nats = tokens = 0.0
        for name, path in sets.items():
            batch = {k: torch.from_numpy(v) for k, v in mixture(name, path, length).batch(np.arange(rows)).items()}
            with torch.no_grad():
                logits = model(batch["input_ids"], positions=batch["positions"])
            labels = batch["labels"]
            own = mixture(name, path, SEQ_LEN).batch(np.arange(4))["labels"]  # the run's length: 4 rows of 64
            assert labels.flatten().tolist() == own.flatten().tolist()
            set_nats = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            set_tokens = (labels != IGNORE_INDEX).sum().item()
            loss = got[per_set(at_length(VAL_LOSS, length, SEQ_LEN), name)]
            assert loss == pytest.approx(set_nats / set_tokens, rel=1e-6)
            assert per_set(at_length(VAL_BPB, length, SEQ_LEN), name) in got
            nats, tokens = nats + set_nats, tokens + set_tokens
        assert got[at_length(VAL_LOSS, length, SEQ_LEN)] == pytest.approx(nats / tokens, rel=1e-6)
    assert at_length(VAL_LOSS, SEQ_LEN, SEQ_LEN) == VAL_LOSS and at_length(VAL_LOSS, 32, SEQ_LEN) == "eval/val_loss@32"
    assert per_set(at_length(VAL_LOSS, 128, SEQ_LEN), "plain") == "eval/val_loss@128/plain"
    assert len({got[at_length(VAL_LOSS, n, SEQ_LEN)] for n in (32, SEQ_LEN, 128)}) == 3  # the context differs


def test_a_validation_length_past_the_models_positions_is_refused_at_load(tmp_path):
    """[eval] val_seq_lens above [model] max_seq_len: refused before anything runs, naming the field,
    not a shape error in the first eval; up to it, accepted."""
    from train.build.checks import preflight

    sets = [f"run.output_dir={tmp_path / 'run'}", "model.max_seq_len=256"]
    recipe = R.load("tiny.toml", [*sets, "eval.val_seq_lens=[256, 512]"])
    assert f"{recipe.path}: [eval] val_seq_lens: [512] exceed the model's max_seq_len 256 " \
           "(validation at a length the model has no positions for)" in preflight(recipe, world_size=1).problems
    ok = R.load("tiny.toml", [*sets, "eval.val_seq_lens=[256]"])
    assert not [q for q in preflight(ok, world_size=1).problems if "val_seq_lens" in q]
