"""CORE (eval.core): decisions checked by hand on toy tasks, and the real bundle (on two
ranks: tests/e2e/test_eval_two_ranks.py).

The toy model is a bigram table over a word-level tokenizer, so every
continuation's mean cross-entropy is a sum of -ln p written in the test.
"""

from __future__ import annotations

import math
import random

import pytest

from eval.core import centered, evaluate_core, score_task
from eval.core_data import CORE_LABELS, CoreTask, load_items, read_manifest
from eval.core_prompts import build, crop_left, fewshot_examples, render
from tests.eval.conftest import (
    BUNDLE, LM_ITEMS, MC_ITEMS, PROBS, SCHEMA_ITEMS, TOY, WORDS, Bigram, WordTokenizer, needs_bundle,
    write_toy_core_bundle,
)


def toy_task(task_type: str, shots: int = 0, delimiter: str = " ") -> CoreTask:
    return CoreTask(label=f"toy_{task_type}", type=task_type, shots=shots, delimiter=delimiter,
                    file="toy.jsonl", baselines={"v1": 0.25, "v2": 0.5})


@pytest.fixture
def toy():
    tok = WordTokenizer(WORDS)
    return tok, Bigram(tok, PROBS)


@pytest.mark.parametrize("task_type", list(TOY))
def test_toy_task_accuracy_by_hand(toy, task_type):
    tok, model = toy
    acc = score_task(model, tok, toy_task(task_type), TOY[task_type], max_seq_len=None)
    assert acc == pytest.approx(2 / 3)
    assert model.calls == 3  # one forward per item, all options batched


@pytest.mark.parametrize("task_type", list(TOY))
def test_few_shot_prefix_keeps_bigram_decisions(toy, task_type):
    """Few-shot examples only add a prefix: a bigram model decides the same way."""
    tok, model = toy
    acc = score_task(model, tok, toy_task(task_type, shots=2), TOY[task_type], max_seq_len=None)
    assert acc == pytest.approx(2 / 3)


def test_scored_spans(toy):
    tok, _ = toy
    rows, starts, ends = build(toy_task("multiple_choice"), MC_ITEMS, 1, tok, None)
    assert [tok.decode(r[s:e]) for r, s, e in zip(rows, starts, ends)] == ["red", "dark red"]
    rows, starts, ends = build(toy_task("schema"), SCHEMA_ITEMS, 0, tok, None)
    assert [tok.decode(r[s:e]) for r, s, e in zip(rows, starts, ends)] == ["barks loudly"] * 2
    rows, starts, ends = build(toy_task("language_modeling"), LM_ITEMS, 0, tok, None)
    assert len(rows) == 1 and tok.decode(rows[0][starts[0]:ends[0]]) == "three four"


def test_prompt_text_with_few_shot():
    mc = render("multiple_choice", {"query": "Q2", "choices": ["x", "y"], "gold": 0}, "\nAnswer: ",
                [{"query": "Q1", "choices": ["a", "b"], "gold": 1}])
    assert mc == ["Q1\nAnswer: b\n\nQ2\nAnswer: x", "Q1\nAnswer: b\n\nQ2\nAnswer: y"]
    schema = render("schema", {"context_options": ["A1", "A2"], "continuation": "c2", "gold": 0}, " ",
                    [{"context_options": ["B1", "B2"], "continuation": "c1", "gold": 1}])
    assert schema == ["B2 c1\n\nA1 c2", "B2 c1\n\nA2 c2"]
    lm = render("language_modeling", {"context": " ctx2 ", "continuation": "cont2"}, "\nAnswer: ",
                [{"context": "ctx1 ", "continuation": "cont1"}])
    assert lm == ["ctx1\nAnswer: cont1\n\nctx2\nAnswer:", "ctx1\nAnswer: cont1\n\nctx2\nAnswer: cont2"]


def test_few_shot_sampling_seed():
    """Item idx takes random.Random(1234 + idx).sample of the other indices."""
    items = [{"context": f"w{i}", "continuation": "c"} for i in range(6)]
    want = random.Random(1234 + 2).sample([0, 1, 3, 4, 5], 3)
    examples = fewshot_examples(items, 2, 3)
    assert examples == [items[i] for i in want]
    assert render("language_modeling", items[2], " ", examples)[1] == "".join(f"w{i} c\n\n" for i in want) + "w2 c"


def test_crop_left_shifts_spans():
    rows, starts, ends = crop_left([[1, 5, 6, 7, 8, 9]], [4], [6], max_len=4)
    assert (rows, starts, ends) == ([[6, 7, 8, 9]], [2], [4])
    rows, starts, ends = crop_left([[1, 5, 6, 7]], [1], [4], max_len=2)  # span longer than the window
    assert (rows, starts, ends) == ([[6, 7]], [1], [2])


def test_centered_accuracy():
    assert centered(2 / 3, 0.25) == pytest.approx((2 / 3 - 0.25) / 0.75)
    assert centered(0.25, 0.25) == 0.0 and centered(1.0, 0.62) == 1.0


def test_full_core_on_toy_bundle(toy, tmp_path):
    tok, model = toy
    result = evaluate_core(model, tok, write_toy_core_bundle(tmp_path), max_seq_len=None)
    assert result.complete and result.name() == "CORE" and not result.missing
    assert all(t.accuracy == pytest.approx(2 / 3) and t.n_items == 3 for t in result.tasks.values())
    # copa: baseline 50 in both versions -> (2/3 - 1/2) / (1/2) = 1/3
    assert result.tasks["copa"].centered == pytest.approx({"v1": 1 / 3, "v2": 1 / 3})
    # commonsense_qa: v1 20 -> (2/3 - .2) / .8 = 0.5833; v2 40.3 -> (2/3 - .403) / .597 = 0.4417
    assert result.tasks["commonsense_qa"].centered["v1"] == pytest.approx(0.58333, abs=1e-5)
    assert result.tasks["commonsense_qa"].centered["v2"] == pytest.approx(0.44165, abs=1e-5)
    manifest = read_manifest(tmp_path)
    for v in ("v1", "v2"):
        want = sum(centered(2 / 3, manifest[k].baselines[v]) for k in CORE_LABELS) / 22
        assert result.metrics()[f"core/CORE_{v}"] == pytest.approx(want)
    assert "core/partial_CORE_v1" not in result.metrics()


def test_missing_task_makes_partial_core(toy, tmp_path):
    tok, model = toy
    result = evaluate_core(model, tok, write_toy_core_bundle(tmp_path, skip=("squad",)), max_seq_len=None,
                           labels=[k for k in CORE_LABELS if k != "copa"])
    assert result.missing == {"copa": "not selected", "squad": "no file eval_data/reading_comprehension/squad.jsonl"}
    assert result.name() == "partial CORE (20/22)"
    assert "core/CORE_v1" not in result.metrics() and result.metrics()["core/n_tasks"] == 20


@needs_bundle
def test_subsample_is_nanochat_shuffle():
    copa = read_manifest(BUNDLE)["copa"]
    assert [it["query"] for it in load_items(BUNDLE, copa, 3)] == [
        "Political violence broke out in the nation, therefore",
        "The kidnappers released the hostage, because",
        "The bowling ball knocked over the bowling pins, because",
    ]
    assert copa.delimiter == " " and read_manifest(BUNDLE)["piqa"].delimiter == "\nAnswer: "


@needs_bundle
def test_real_bundle_partial_core():
    import torch

    from data.tokenizer import Tokenizer

    tokenizer = Tokenizer()

    def echo(ids):  # all its mass on the token that really comes next: a loss of exactly 0 on every row
        logits = torch.zeros(*ids.shape, tokenizer.vocab_size)
        logits[:, :-1].scatter_(-1, ids[:, 1:, None], 100.0)
        return logits

    result = evaluate_core(echo, tokenizer, BUNDLE, max_seq_len=128, max_per_task=3)
    # hellaswag.jsonl (two tasks), squad.jsonl and coqa.jsonl are not in the bundle
    assert result.missing == {
        "hellaswag_zeroshot": "no file eval_data/language_understanding/hellaswag.jsonl",
        "hellaswag": "no file eval_data/language_understanding/hellaswag.jsonl",
        "squad": "no file eval_data/reading_comprehension/squad.jsonl",
        "coqa": "no file eval_data/reading_comprehension/coqa.jsonl",
    }
    assert len(result.tasks) == 18 and all(t.n_items == 3 for t in result.tasks.values())
    # Every continuation is reproduced (language modeling: all right); every choice ties at 0, so the
    # first is picked: an item whose gold is choice 0 is right, any other wrong.
    manifest = read_manifest(BUNDLE)
    for name, task in result.tasks.items():
        golds = [0] * 3 if manifest[name].type == "language_modeling" else \
            [it["gold"] for it in load_items(BUNDLE, manifest[name], 3)]
        assert task.accuracy == sum(g == 0 for g in golds) / 3, name
    summary = result.summary()
    assert summary.startswith("partial CORE (18/22): v1 ") and "missing: hellaswag_zeroshot, hellaswag, squad, coqa" in summary
    metrics = result.metrics()
    assert "core/CORE_v1" not in metrics and math.isfinite(metrics["core/partial_CORE_v2"])
