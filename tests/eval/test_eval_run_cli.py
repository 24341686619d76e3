"""eval.run's command line: bad input exits 2 with the reason, before any model is loaded; the
tokenizer is the checkpoint's own (never the tiny default); --evalplus takes both datasets at once."""

import gzip
import json

import pytest

from data.tokenizer import TINY_TOKENIZER, Tokenizer
from eval.run import evalplus_datasets, evalplus_files, main
from tests.conftest import other_tokenizer, write_tiny_run
from tests.eval.conftest import write_toy_core_bundle


def exit_2(capsys, argv) -> str:
    """stderr of ``eval.run argv``, which must exit 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("sets, message", [
    (["no_such_field=1"], "'no_such_field' is not a Laneformer.Config field"),
    (["delay"], "--set 'delay': expected key=value"),
])
def test_a_bad_set_exits_2_naming_it(tmp_path, capsys, sets, message):
    assert message in exit_2(capsys, ["--checkpoint", str(tmp_path), "--core", str(tmp_path),
                                      *(f"--set={s}" for s in sets)])


def test_a_folder_that_holds_no_checkpoint_exits_2(tmp_path, capsys):
    bundle = write_toy_core_bundle(tmp_path / "core")
    assert f"{tmp_path}: neither a DCP checkpoint" in exit_2(capsys, ["--checkpoint", str(tmp_path),
                                                                     "--core", str(bundle)])


def test_a_missing_core_bundle_exits_2_naming_it_before_the_checkpoint_is_opened(tmp_path, capsys):
    """The checkpoint does not exist either: had eval.run opened it first, it would say so instead."""
    err = exit_2(capsys, ["--checkpoint", str(tmp_path / "no-such-run"), "--core", str(tmp_path / "no-bundle")])
    assert err == (f"error: CORE bundle {tmp_path / 'no-bundle'}: no tasks.csv (no such folder); "
                   "get the bundle with python -m eval.core_data fetch DIR\n")


def test_no_task_exits_2_before_loading_anything(tmp_path, capsys):
    """The checkpoint does not exist: had eval.run tried to load it, it would say so instead."""
    err = exit_2(capsys, ["--checkpoint", str(tmp_path / "no-such-run")])
    assert "nothing to evaluate: pass --core/--lm-eval/--humaneval/--evalplus" in err
    assert "no-such-run" not in err


@pytest.mark.parametrize("task", [["--humaneval"], ["--evalplus", "humaneval"]])
def test_several_samples_at_temperature_0_exit_2_naming_the_flags(tmp_path, capsys, task):
    """HumanEval and EvalPlus alike: N greedy answers would be one answer N times. Said before the
    checkpoint (which does not exist) is opened; the rule is in --help."""
    err = exit_2(capsys, ["--checkpoint", str(tmp_path / "no-such-run"), *task, "--samples", "3"])
    assert err == ("error: --samples: 3 answers a task at --temperature 0 would all be the greedy one: "
                   "set --temperature > 0 (or --samples 1)\n")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "answers per problem; above 1 needs --temperature above 0" in " ".join(capsys.readouterr().out.split())


# --- the tokenizer ---


TEXT = "an ace can dance"


def test_a_run_is_scored_with_the_tokenizer_its_recipe_names(tmp_path, capsys):
    """Not the tiny default: another tokenizer of the same size, which encodes TEXT differently."""
    other = other_tokenizer(tmp_path / "tok")
    assert Tokenizer(other).encode(TEXT) != Tokenizer(TINY_TOKENIZER).encode(TEXT)
    step = write_tiny_run(tmp_path / "run", other)
    from eval.load import load_checkpoint

    loaded = load_checkpoint(tmp_path / "run", device="cpu")
    assert loaded.tokenizer.path == other
    assert loaded.tokenizer.encode(TEXT) == Tokenizer(other).encode(TEXT)

    out = main(["--checkpoint", str(tmp_path / "run"), "--core", str(write_toy_core_bundle(tmp_path / "bundle")),
                "--core-tasks", "copa", "--max-per-task", "2", "--device", "cpu"])
    assert out["checkpoint"] == f"dcp:{step}" and "core/copa/acc" in out["metrics"]
    assert f"tokenizer {other} (from {tmp_path / 'run' / 'recipe.toml'}" in capsys.readouterr().out

    # --tokenizer still wins
    assert load_checkpoint(step, tokenizer_path=TINY_TOKENIZER, device="cpu").tokenizer.path == TINY_TOKENIZER


def test_an_import_is_scored_with_the_tokenizer_files_beside_its_weights(tmp_path):
    """``convert from-hf`` of a release that ships tokenizer.json but no tokenizer.model (as Llama-3-style
    ones do): eval.run on the import itself, no recipe, scores as on the release."""
    from models.laneformer.hf.export import export_hf
    from models.laneformer.hf.import_hf import import_hf
    from tests.conftest import tiny_random_model

    model = tiny_random_model(seed=4)
    release = export_hf({k: v.detach().clone() for k, v in model.state_dict().items()}, model.config,
                        tmp_path / "release", tokenizer_dir=TINY_TOKENIZER.parent)
    (release / "tokenizer.model").unlink()
    import_hf(release, tmp_path / "imported")
    bundle = ["--core", str(write_toy_core_bundle(tmp_path / "bundle")), "--core-tasks", "copa,winograd",
              "--max-per-task", "3", "--device", "cpu"]
    imported = main(["--checkpoint", str(tmp_path / "imported"), *bundle])
    assert imported["checkpoint"] == f"dcp:{tmp_path / 'imported'}"
    assert imported["metrics"] == pytest.approx(main(["--checkpoint", str(release), *bundle])["metrics"])
    from eval.load import load_checkpoint

    tokenizer = load_checkpoint(tmp_path / "imported", device="cpu").tokenizer
    assert tokenizer.hf.name_or_path == str(tmp_path / "imported")
    assert tokenizer.encode(TEXT, bos=True) == Tokenizer(TINY_TOKENIZER).encode(TEXT, bos=True)


def test_a_checkpoint_without_a_findable_tokenizer_exits_2(tmp_path, capsys):
    step = write_tiny_run(tmp_path / "run", None)
    err = exit_2(capsys, ["--checkpoint", str(tmp_path / "run"), "--core", str(write_toy_core_bundle(tmp_path / "core"))])
    assert f"{tmp_path / 'run'}: cannot tell which tokenizer this checkpoint was trained with" in err
    assert f"{step}: no tokenizer files" in err
    assert "pass --tokenizer" in err


def test_a_tokenizer_that_cannot_be_the_models_exits_2(tmp_path, capsys):
    """The tiny model has 4096 ids: the tiny tokenizer cut to 1000 pieces leaves 3096 unused (no
    padding is that large); with 100 pieces added, 100 ids have no embedding."""
    from sentencepiece import sentencepiece_model_pb2

    for n in (1000, 4196):
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(TINY_TOKENIZER.read_bytes())
        del proto.pieces[n:]
        for i in range(len(proto.pieces), n):
            proto.pieces.add(piece=f"<extra_{i}>", score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
        (tmp_path / f"v{n}.model").write_bytes(proto.SerializeToString())
        assert Tokenizer(tmp_path / f"v{n}.model").vocab_size == n
    step = write_tiny_run(tmp_path / "run", TINY_TOKENIZER)
    for n, why in ((1000, "3096 ids it would never use"), (4196, "ids the model has no embedding for")):
        err = exit_2(capsys, ["--checkpoint", str(step), "--core", str(write_toy_core_bundle(tmp_path / "core")),
                              "--tokenizer", str(tmp_path / f"v{n}.model")])
        assert f"{step}: the model has 4096 ids, tokenizer {tmp_path / f'v{n}.model'} {n}: {why}" in err
        assert "not this model's tokenizer" in err


# --- EvalPlus: both datasets in one command ---


def release_task(dataset: str) -> dict:
    task_id = "HumanEval/0" if dataset == "humaneval" else "Mbpp/3"
    return {"task_id": task_id, "prompt": 'def f(a):\n    """Return a."""\n', "entry_point": "f",
            "canonical_solution": "    return a\n", "base_input": [[1]], "plus_input": [[2]], "atol": 0}


def test_evalplus_takes_a_comma_list(tmp_path, capsys):
    assert evalplus_datasets("humaneval,mbpp") == ["humaneval", "mbpp"]
    assert evalplus_datasets("mbpp") == ["mbpp"]
    for bad in ("humaneval,apps", "mbpp,mbpp"):
        assert f"{bad!r}: expected a comma list" in exit_2(capsys, ["--checkpoint", str(tmp_path),
                                                                    "--evalplus", bad])

    # a folder holding both releases under their own names, .gz or not
    with gzip.open(tmp_path / "HumanEvalPlus.jsonl.gz", "wt") as f:
        f.write(json.dumps(release_task("humaneval")) + "\n")
    (tmp_path / "MbppPlus.jsonl").write_text(json.dumps(release_task("mbpp")) + "\n")
    both = ["humaneval", "mbpp"]
    assert evalplus_files(both, str(tmp_path)) == [tmp_path / "HumanEvalPlus.jsonl.gz", tmp_path / "MbppPlus.jsonl"]
    files = f"{tmp_path / 'HumanEvalPlus.jsonl.gz'},{tmp_path / 'MbppPlus.jsonl'}"
    assert evalplus_files(both, files) == [tmp_path / "HumanEvalPlus.jsonl.gz", tmp_path / "MbppPlus.jsonl"]
    assert evalplus_files(both, None) == [None, None]
    with pytest.raises(ValueError, match="1 file\\(s\\) for 2 datasets \\(humaneval,mbpp\\): give one per dataset"):
        evalplus_files(both, str(tmp_path / "MbppPlus.jsonl"))

    # through the CLI: both files are read before the model (here: no model), a missing one is named
    for data in (str(tmp_path), files):
        err = exit_2(capsys, ["--checkpoint", str(tmp_path / "no-model"), "--evalplus", "humaneval,mbpp",
                              "--evalplus-data", data])
        assert f"{tmp_path / 'no-model'}: neither a DCP checkpoint" in err
    (tmp_path / "MbppPlus.jsonl").unlink()
    err = exit_2(capsys, ["--checkpoint", str(tmp_path / "no-model"), "--evalplus", "humaneval,mbpp",
                          "--evalplus-data", str(tmp_path)])
    assert f"{tmp_path}: --evalplus-data: no MbppPlus.jsonl.gz or MbppPlus.jsonl for --evalplus mbpp" in err


def test_evalplus_scores_each_dataset(tmp_path):
    """One run_evals call, two datasets: metrics for each, and report_json's merged tables."""
    import argparse

    import torch

    from eval.run import report_json
    from eval.spec import EvalSpec
    from eval.suite import run_evals

    tok = Tokenizer(TINY_TOKENIZER)

    def ends_at_once(ids):  # every next token is EOS: no answer, so every test fails
        logits = torch.zeros(*ids.shape, tok.vocab_size)
        logits[..., tok.eos_id] = 1.0
        return logits

    tasks = [[release_task("humaneval")], [release_task("mbpp")]]
    spec = EvalSpec(evalplus="humaneval,mbpp", evalplus_max_new_tokens=4)
    report = run_evals(ends_at_once, tok, spec, max_seq_len=256, evalplus_tasks=tasks)
    assert report.metrics() == {"humaneval/pass@1": 0.0, "humaneval+/pass@1": 0.0,
                                "mbpp/pass@1": 0.0, "mbpp+/pass@1": 0.0}
    out = report_json(report, "x", argparse.Namespace(chat=False))
    assert out["evalplus"]["datasets"] == ["humaneval", "mbpp"] and out["evalplus"]["chat"] is False
    assert out["evalplus"]["passed"] == {"HumanEval/0": [{"base": False, "plus": False}],
                                         "Mbpp/3": [{"base": False, "plus": False}]}
    assert set(out["evalplus"]["solutions"]) == {"HumanEval/0", "Mbpp/3"}
