"""lm-eval through eval.lm_harness, offline; the same on an exported HF folder; eval.run end to end
(on two ranks: tests/e2e/test_eval_two_ranks.py).

The toy bigram model and word tokenizer of tests/eval/conftest.py make every
log-likelihood and greedy continuation computable by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from eval.lm_harness import LaneformerLM, flat_metrics, load_task_file, run_lm_eval
from rundir import REPO
from tests.conftest import tiny_random_model
from tests.eval.conftest import BUNDLE, PROBS, WORDS, Bigram, WordTokenizer, needs_bundle, write_tasks


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture
def toy_lm():
    tok = WordTokenizer(WORDS + ["<x>"])
    return LaneformerLM(Bigram(tok, PROBS), tok, max_seq_len=16, batch_size=2), tok.vocab_size


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_loglikelihood_by_hand(toy_lm):
    lm, v = toy_lm
    out = lm.loglikelihood([
        request("loglikelihood", "the sky is", " blue"),  # ln .5, greedy
        request("loglikelihood", "the sky is", " red"),  # ln .2, not greedy
        request("loglikelihood", "the rose is", " dark red"),  # ln .1 + ln .9
        request("loglikelihood", "", "the sky"),  # empty context: BOS, then two uniform rows
    ])
    want = [(math.log(0.5), True), (math.log(0.2), False), (math.log(0.1) + math.log(0.9), False),
            (-2 * math.log(v), False)]
    for (ll, greedy), (want_ll, want_greedy) in zip(out, want):
        assert ll == pytest.approx(want_ll, abs=1e-5) and greedy == want_greedy


def test_loglikelihood_rolling_over_windows(toy_lm):
    lm, v = toy_lm
    lm.max_length = 3  # 5 tokens with BOS: two windows
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", "one two three four")])
    # BOS->one and one->two are uniform rows; two->three .6; three->four .6
    assert total == pytest.approx(-2 * math.log(v) + 2 * math.log(0.6), abs=1e-5)


def test_generate_until_stops(toy_lm):
    lm, _ = toy_lm
    out = lm.generate_until([
        request("generate_until", "one two", {"until": ["five"], "max_gen_toks": 5}),
        request("generate_until", "the dog", {"until": ["loudly"], "max_gen_toks": 5}),
        request("generate_until", "one two", {"until": [], "max_gen_toks": 1}),
    ])
    # greedy: two->three->four, then a uniform row picks <unk> (decoded as nothing)
    assert out == [" three four", " barks ", " three"]


def test_lm_eval_offline_local_tasks(toy_lm, tmp_path):
    lm, _ = toy_lm
    tasks = load_task_file(write_tasks(tmp_path))
    assert Path(tasks[0]["dataset_kwargs"]["data_files"]["test"]).is_absolute()
    metrics = flat_metrics(run_lm_eval(lm, tasks))
    assert metrics["lm_eval/toy_mc/acc"] == pytest.approx(4 / 5)
    assert metrics["lm_eval/toy_gen/exact_match"] == pytest.approx(3 / 5)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random Laneformer, as a DCP step dir and as an exported HF folder."""
    from models.laneformer.hf.checkpoint_io import save_dcp
    from models.laneformer import write_native_config
    from models.laneformer.hf.export import export_hf

    root = tmp_path_factory.mktemp("ckpt")
    model = tiny_random_model(seed=1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step = root / "run" / "checkpoints" / "step-10"
    save_dcp(state, step)
    write_native_config(model.config, step)
    export_hf(state, model.config, root / "hf", tokenizer_dir=REPO / "assets" / "tokenizer")
    return model, step, root / "hf"


def test_hf_folder_scores_like_the_training_model(exported):
    from data.tokenizer import Tokenizer
    from eval.load import load_checkpoint

    model, _, hf_dir = exported
    loaded = load_checkpoint(hf_dir, device="cpu")
    reqs = [request("loglikelihood", "The capital of France is", " Paris"),
            request("loglikelihood", "def f(x):\n    return", " x + 1")]
    native = LaneformerLM(model, Tokenizer(), max_seq_len=64).loglikelihood(reqs)
    hf = LaneformerLM(loaded.model_fn, loaded.tokenizer, max_seq_len=loaded.max_seq_len).loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(native, hf):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    gen = [request("generate_until", "Once upon a time", {"until": ["\n"], "max_gen_toks": 6})]
    assert LaneformerLM(model, Tokenizer(), max_seq_len=64).generate_until(gen) == \
        LaneformerLM(loaded.model_fn, loaded.tokenizer, max_seq_len=64).generate_until(gen)


@needs_bundle
def test_run_cli_on_dcp_and_hf(exported, tmp_path, capsys):
    from eval.run import main

    _, step, hf_dir = exported
    tasks = write_tasks(tmp_path)
    out = main(["--checkpoint", str(step.parent.parent), "--tokenizer", str(REPO / "assets" / "tokenizer"),
                "--core", str(BUNDLE), "--core-tasks", "copa,winograd",
                "--max-per-task", "2", "--lm-eval", str(tasks), "--limit", "5", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["metrics"] == out["metrics"]
    assert out["checkpoint"] == f"dcp:{step}"
    assert out["core"]["summary"].startswith("partial CORE (2/22)")
    assert {"core/copa/acc", "core/partial_CORE_v1", "lm_eval/toy_mc/acc", "lm_eval/toy_gen/exact_match"} <= set(out["metrics"])
    printed = capsys.readouterr().out
    assert "core/partial_CORE_v2" in printed and "missing: hellaswag_zeroshot" in printed
    hf_out = main(["--checkpoint", str(hf_dir), "--core", str(BUNDLE), "--core-tasks", "copa,winograd",
                   "--max-per-task", "2"])
    assert hf_out["metrics"] == pytest.approx({k: v for k, v in out["metrics"].items() if k.startswith("core/")})


def test_trainer_entry_point(toy_lm, tmp_path):
    """What a trainer hook calls: flat float metrics for CORE and lm-eval together."""
    from tests.eval.conftest import write_toy_core_bundle

    from eval.spec import EvalSpec
    from eval.suite import evaluate

    lm, _ = toy_lm
    (tmp_path / "bundle").mkdir()
    spec = EvalSpec(core_bundle=str(write_toy_core_bundle(tmp_path / "bundle")),
                    lm_eval_tasks=str(write_tasks(tmp_path)), lm_eval_limit=5)
    metrics = evaluate(lm.model_fn, lm.tokenizer, spec, max_seq_len=16)
    assert metrics["core/copa/acc"] == pytest.approx(2 / 3) and "core/CORE_v1" in metrics
    assert metrics["lm_eval/toy_mc/acc"] == pytest.approx(4 / 5)
    assert all(isinstance(v, float | int) for v in metrics.values())
