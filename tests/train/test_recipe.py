"""Recipe validation: every bad input names the file, table and key."""

import pytest

from train import recipe as R

GOOD = """
[run]
name = "t"
[model]
flavor = "tiny"
[data]
tokenizer = "assets/tokenizer/tokenizer.model"
[optimizer]
lr = 1e-3
[schedule]
warmup_steps = 2
[training]
seq_len = 64
global_batch = 8
micro_batch = 2
steps = 10
"""


def write(tmp_path, text, name="r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_good_recipe_resolves(tmp_path):
    r = R.load(write(tmp_path, GOOD))
    assert r.training.global_batch_tokens == 8 * 64
    assert r.training.total_tokens == 10 * 8 * 64
    assert r.output_dir == R.REPO / "runs" / "t"


def test_tokens_resolve_to_steps(tmp_path):
    text = GOOD.replace("global_batch = 8", "global_batch_tokens = 1024").replace(
        "steps = 10", "total_tokens = 100_000").replace("warmup_steps = 2", "warmup_tokens = 4096")
    r = R.load(write(tmp_path, text))
    assert (r.training.global_batch, r.training.steps, r.schedule.warmup_steps) == (16, 98, 4)


@pytest.mark.parametrize("edit, message", [
    (("lr = 1e-3", "lrr = 1e-3"), r"\[optimizer\] has unknown key 'lrr'; did you mean 'lr'\?"),
    (("seq_len = 64", 'seq_len = "64"'), r"\[training\] seq_len: expected int, got '64'"),
    (("lr = 1e-3", "lr = -1e-3"), r"\[optimizer\] lr: must be > 0 \(got -0.001\)"),
    (("micro_batch = 2", "micro_batch = 3"), r"\[training\] global_batch: 8 is not divisible by micro_batch 3"),
    (("[schedule]", "[schedul]"), r"recipe has unknown key 'schedul'; did you mean 'schedule'\?"),
    (('flavor = "tiny"', "flavor = 3"), r"\[model\] flavor: expected str"),
    (("steps = 10", "steps = 10\ntotal_tokens = 5"), r"\[training\] give exactly one of 'steps' and 'total_tokens'"),
])
def test_bad_recipe_names_file_table_key(tmp_path, edit, message):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(R.RecipeError, match=message) as err:
        R.load(path)
    assert str(err.value).startswith(path)


def test_missing_recipe_file():
    with pytest.raises(R.RecipeError, match="no-such.toml: recipe file not found"):
        R.load("no-such.toml")


def test_set_overrides_are_validated(tmp_path):
    path = write(tmp_path, GOOD)
    assert R.load(path, ["optimizer.lr=0.5", "run.name=other"]).optimizer.lr == 0.5
    with pytest.raises(R.RecipeError, match=r"\[optimizer\] lr: expected float, got 'abc'"):
        R.load(path, ["optimizer.lr=abc"])
    with pytest.raises(R.RecipeError, match=r"\[training\] has unknown key 'sequence_len'; did you mean 'seq_len'"):
        R.load(path, ["training.sequence_len=5"])


def test_batch_must_divide_over_data_parallel_ranks(tmp_path):
    r = R.load(write(tmp_path, GOOD))
    assert R.check_world(r, 2) == 2
    with pytest.raises(R.RecipeError, match=r"global_batch \(8\) is not divisible by micro_batch \(2\) x data-parallel size \(3\)"):
        R.check_world(r, 3)


def test_resolved_recipe_round_trips_through_toml(tmp_path):
    r = R.load(write(tmp_path, GOOD))
    again = R.load(write(tmp_path, R.to_toml(r), "again.toml"))
    assert R.to_toml(again).splitlines()[1:] == R.to_toml(r).splitlines()[1:]


def test_phase1_is_the_published_recipe():
    r = R.load("phase1.toml")
    assert (r.model.flavor, r.training.seq_len, r.training.global_batch) == ("2B", 4096, 1536)
    assert 635_000 < r.training.steps < 637_000
    assert abs(r.training.total_tokens - 4e12) / 4e12 < 1e-3
    assert abs(sum(s.weight for s in r.data.sources) - 1) < 1e-9
