"""Recipe validation: every bad input names the file, table and key."""

import json
import re

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


def test_each_table_checks_itself_and_the_loader_names_the_file(tmp_path):
    """A table's own values are checked when it is made (``__post_init__``, as torchtitan's configs), so the
    tables of a recipe object are valid whoever makes them; the loader adds the file and the table."""
    with pytest.raises(R.TableError, match=r"^steps: must be > 0 \(got 0\)$"):
        R.Training(seq_len=64, global_batch=8, steps=0)
    assert (R.Training(seq_len=64, global_batch_tokens=1024, total_tokens=5000).steps, R.Preference().gamma) == (
        5, pytest.approx(0.03))
    path = write(tmp_path, GOOD)
    with pytest.raises(R.RecipeError) as e:
        R.load(path, ["training.steps=0", "optimizer.lr=-1.0"])
    assert str(e.value).splitlines() == [  # every table's problem at once, in the recipe's order of tables
        f"{path}: [optimizer] lr: must be > 0 (got -1.0)", f"{path}: [training] steps: must be > 0 (got 0)"]


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


def test_set_reaches_a_source_by_name_or_index_and_errors_name_the_set():
    """A mixture ablation is a --set on one source (a sweep axis too); a bad one names the --set, never a
    traceback ('list' object has no attribute 'setdefault' before)."""
    r = R.load("tiny", ["data.sources.code.weight=0.3", "data.sources[0].max_epochs=10"])
    assert [(s.name, s.weight, s.max_epochs) for s in r.data.sources] == [("prose", 0.5, 10), ("code", 0.3, 4)]
    with pytest.raises(R.RecipeError, match=r"^--set data.sources.code.wieght=1 \(over .*tiny.toml\): "
                                            r"\[data.sources\[1\]\] has unknown key 'wieght'; did you mean 'weight'"):
        R.load("tiny", ["data.sources.code.wieght=1"])
    with pytest.raises(R.RecipeError, match=r"^--set data.sources\[1\].weight=abc \(over .*\): \[data.sources\[1\]\] "
                                            r"weight: expected float"):
        R.load("tiny", ["data.sources[1].weight=abc"])
    names = r"\(names: \[0\] 'prose', \[1\] 'code'\)"
    for item, why in [("data.sources.cod.weight=1", "data.sources has no table named 'cod' " + names),
                      ("data.sources[2].weight=1", r"data.sources has 2 tables, so no \[2\] " + names),
                      ("data.sources.weight=1", r"data.sources is an array of tables; name one: "
                                                r"data.sources.<name>.weight or data.sources\[<index>\].weight"),
                      ("optimizer.lr.x=1", r"optimizer.lr is 0.003, not a table"),
                      ("optimizer[0].lr=1", r"optimizer is not an array of tables, so it has no \[0\]")]:
        with pytest.raises(R.RecipeError, match=rf"^--set '{re.escape(item)}': {why}"):
            R.load("tiny", [item])


def test_batch_must_divide_over_data_parallel_ranks(tmp_path):
    r = R.load(write(tmp_path, GOOD))
    assert R.check_world(r, 2) == 2
    with pytest.raises(R.RecipeError, match=r"global_batch \(8\) is not divisible by micro_batch \(2\) x data-parallel size \(3\)"):
        R.check_world(r, 3)


def test_the_data_parallel_layout_must_divide_the_world_and_names_its_key(tmp_path):
    path = write(tmp_path, GOOD)
    assert R.dp_degrees(R.load(path, ["parallel.shard=8", "parallel.replicate=-1"]), 192) == (24, 8)
    assert R.dp_degrees(R.load(path, ["parallel.replicate=2"]), 4) == (2, 2)
    hsdp = R.load(path, ["parallel.replicate=3"])
    with pytest.raises(R.RecipeError, match=r"r\.toml: \[parallel\] replicate: 3 does not divide the 4 ranks$"):
        R.check_world(hsdp, 4)
    with pytest.raises(R.RecipeError, match=r"\[parallel\] shard: 8 does not divide the 12 ranks$"):
        R.check_world(R.load(path, ["parallel.shard=8", "parallel.replicate=-1"]), 12)
    with pytest.raises(R.RecipeError, match=r"\[parallel\] shard, replicate: 2 x 3 is not the 12 ranks$"):
        R.check_world(R.load(path, ["parallel.shard=2", "parallel.replicate=3"]), 12)
    for sets, message in ((["parallel.shard=0"], r"\[parallel\] shard: must be >= 1, or -1"),
                          (["parallel.shard=-1", "parallel.replicate=-1"], r"\[parallel\] shard, replicate: at most one"),
                          (['parallel.reduce_grads="sometimes"'], r"\[parallel\] reduce_grads: must be one of"),
                          (['parallel.reshard_after_forward="later"'], r"\[parallel\] reshard_after_forward: must be")):
        with pytest.raises(R.RecipeError, match=message):
            R.load(path, sets)


def test_context_parallel_is_refused_in_a_preference_run_and_divides_the_world_before_the_layout():
    """The rest of ``[parallel] context_parallel``'s checks: tests/models/test_context_parallel.py."""
    cp = ["parallel.context_parallel=2", "training.seq_len=256", "eval.every=0", "eval.at_end=false"]
    with pytest.raises(R.RecipeError, match=r"tiny-dpo.toml: \[parallel\] context_parallel: 2 in a preference run"):
        R.load("tiny-dpo.toml", cp)
    recipe = R.load("tiny.toml", [*cp, "parallel.shard=2"])
    assert R.dp_degrees(recipe, 4) == (1, 2) and R.check_world(recipe, 4) == 2
    with pytest.raises(R.RecipeError, match=r"\[parallel\] shard, replicate: 2 x 1 is not the 4 ranks$"):
        R.dp_degrees(recipe, 8)  # 8 ranks over CP 2: 4 data-parallel ranks


def test_the_layout_reaches_torchtitan_and_the_trainer():
    from train.build import trainer_config

    config = trainer_config(R.load("tiny.toml", ["parallel.shard=8", "parallel.replicate=-1",
                                                 'parallel.reshard_after_forward="never"',
                                                 'parallel.reduce_grads="replicas_last_micro_batch"']),
                            16)  # the world: a replicate degree of -1 is resolved on it
    p = config.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.fsdp_reshard_after_forward,
            config.reduce_grads) == (2, 8, "never", "replicas_last_micro_batch")


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


# --- the chat template: one per run, validated at load, inherited from an imported release ---

def other_template() -> str:
    """A template unlike the project's (data.chat.LLAMA2 with other markup), with the same answer spans."""
    from data.chat import LLAMA2

    return LLAMA2.replace("'[INST] '", "'USER: '").replace("' [/INST]'", "'\\nASSISTANT:'")


@pytest.mark.parametrize("value, why", [
    ('"chatml"', r"'chatml' is neither a template name \(llama2\) nor an existing .jinja file"),
    ('"no/such/template.jinja"', r"'no/such/template.jinja' is neither a template name"),
    ("3", r"expected str \| None, got 3"),
])
def test_bad_chat_template_names_the_field(tmp_path, value, why):
    path = write(tmp_path, GOOD.replace("[data]", f"[data]\nchat_template = {value}"))
    with pytest.raises(R.RecipeError, match=r"\[data\] chat_template: " + why) as err:
        R.load(path)
    assert str(err.value).startswith(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.toml"]  # nothing written


@pytest.mark.parametrize("jinja, why", [
    ("{% for m in messages %}{{ m['content'] }", r"TemplateSyntaxError"),  # an unclosed tag
    ("{% for m in messages %}{{ m['content'] + m['no_such_key'] }}{% endfor %}", r"UndefinedError|TypeError"),
])
def test_a_template_that_cannot_render_fails_at_load_not_at_export(tmp_path, jinja, why):
    (tmp_path / "broken.jinja").write_text(jinja)
    path = write(tmp_path, GOOD.replace("[data]", f'[data]\nchat_template = "{tmp_path / "broken.jinja"}"'))
    with pytest.raises(R.RecipeError, match=r"\[data\] chat_template: chat template .*broken.jinja: does not render"
                                            r".*(" + why + ")"):
        R.load(path)


def test_chat_template_resolves_and_is_recorded(tmp_path):
    from data.chat import resolve_template

    assert R.load(write(tmp_path, GOOD)).data.chat_template == "llama2"  # the project default, said explicitly
    (tmp_path / "mine.jinja").write_text(other_template())
    r = R.load(write(tmp_path, GOOD.replace("[data]", f'[data]\nchat_template = "{tmp_path / "mine.jinja"}"')))
    assert resolve_template(r.data.chat_template)[1] == other_template()
    again = R.load(write(tmp_path, R.to_toml(r), "again.toml"))
    assert again.data.chat_template == r.data.chat_template == str(tmp_path / "mine.jinja")


def release_with_template(folder, template: str | None):
    """A release folder as transformers writes one: the weights, and the chat template saved by
    ``save_pretrained`` (transformers 5 writes it to chat_template.jinja)."""
    from transformers import AutoTokenizer

    from data.tokenizer import TINY_TOKENIZER
    from models.laneformer.hf.export import export_hf
    from tests.conftest import tiny_random_model

    model = tiny_random_model()
    export_hf(model.state_dict(), model.config, folder, tokenizer_dir=TINY_TOKENIZER)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    if template is not None:
        tok = AutoTokenizer.from_pretrained(str(folder))
        tok.chat_template = template
        tok.save_pretrained(str(folder))
    return folder


def test_sft_on_an_imported_release_uses_the_release_template(tmp_path, capsys):
    """from-hf keeps the release's chat_template beside the weights; a recipe starting from the import
    with [data] chat_template unset tunes, evaluates and exports with it, and records which."""
    from transformers import AutoTokenizer

    from data.chat import resolve_template
    from models.laneformer.convert import main as convert_main
    from train.build import callbacks
    from train.callbacks.eval import Eval
    from train.callbacks.export import Export

    release = release_with_template(tmp_path / "release", other_template())
    assert (release / "chat_template.jinja").is_file()  # where transformers put it
    convert_main(["from-hf", str(release), str(tmp_path / "imported")])
    assert "chat template: the release's, kept in" in capsys.readouterr().out
    # Reference: what transformers itself loads as the imported checkpoint's template.
    assert AutoTokenizer.from_pretrained(str(tmp_path / "imported")).chat_template == other_template()

    sft = GOOD.replace("[training]", f'[checkpoint]\ninit_from = "{tmp_path / "imported"}"\nexport_hf = true\n'
                                     '[eval]\nevalplus = "humaneval"\nevalplus_chat = true\n[training]')
    r = R.load(write(tmp_path, sft))
    assert resolve_template(r.data.chat_template)[1] == other_template()
    assert f'chat_template = "{r.data.chat_template}"' in R.to_toml(r)  # the run dir's recipe.toml says which
    (export,) = [c for c in callbacks(r) if isinstance(c, Export.Config)]
    assert export.chat_template == r.data.chat_template
    (eval_hook,) = [c for c in callbacks(r) if isinstance(c, Eval.Config)]
    assert eval_hook.chat_template == r.data.chat_template and eval_hook.spec.evalplus_chat
    # The recipe's own choice wins over the checkpoint's.
    assert R.load(write(tmp_path, sft.replace("[data]", '[data]\nchat_template = "llama2"'))).data.chat_template == "llama2"

    # A release without a template: the project default.
    release_with_template(tmp_path / "bare", None)
    convert_main(["from-hf", str(tmp_path / "bare"), str(tmp_path / "bare-imported")])
    assert "the release has none" in capsys.readouterr().out
    assert R.load(write(tmp_path, sft.replace("imported", "bare-imported"))).data.chat_template == "llama2"


def test_preflight_refuses_a_chat_source_tokenized_with_another_template(tmp_path):
    """Training on one template and exporting another is refused before anything starts, naming the
    source's manifest and the recipe field; the matching template passes."""
    from train.build import preflight

    (tmp_path / "mine.jinja").write_text(other_template())
    chat = R.REPO / "assets" / "chat" / "train"  # tokenized with llama2 (its manifest says so)
    sources = f'[[data.sources]]\nname = "chat"\npath = "{chat}"\nchat_key = "messages"\nweight = 1.0\nmax_epochs = 100\n'
    text = GOOD.replace("[optimizer]", sources + "[optimizer]").replace(
        'name = "t"', f'name = "t"\noutput_dir = "{tmp_path / "run"}"')
    mismatch = R.load(write(tmp_path, text.replace("[data]", f'[data]\nchat_template = "{tmp_path / "mine.jinja"}"')))
    problems = preflight(mismatch, 1).problems
    (problem,) = [p for p in problems if "chat_template" in p]
    assert problem.startswith(f"{mismatch.path}: [data] chat_template:")
    assert str(chat / "manifest.json") in problem and "'llama2'" in problem
    assert not preflight(R.load(write(tmp_path, text, "ok.toml")), 1).problems
    assert not (tmp_path / "run").exists()
