"""Preference pairs: each input format renders to the ids transformers' apply_chat_template gives, the
prompt's ids are a prefix of both sides (or the row is refused), the loss mask is the answer only,
refused rows are counted in the manifest, and the shards hold chosen/rejected adjacent, in order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import LLAMA2, BadConversation
from data.pairs import (EMPTY_ANSWER, IDENTICAL, NOT_A_PAIR, NOT_A_PREFIX, PROMPTS_DIFFER, TOO_LONG, pairs_of,
                        render_pair)
from data.tokenizer import TINY_TOKENIZER
from tests.data.test_chat import hf, sp  # noqa: F401  (module-scoped fixtures: the tokenizer, its HF export)

SYSTEM = {"role": "system", "content": "Answer in one word."}
PROMPT = [SYSTEM, {"role": "user", "content": "Name a pet."}, {"role": "assistant", "content": "Cat."},
          {"role": "user", "content": "Another one?"}]  # a history with an answer that is not trained on
CHOSEN = {"role": "assistant", "content": "Dog."}
REJECTED = {"role": "assistant", "content": "  I would rather not say. "}
ROWS = {  # one example in each input format
    "explicit": {"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [REJECTED]},
    "implicit": {"chosen": PROMPT + [CHOSEN], "rejected": PROMPT + [REJECTED]},
    "tulu": {"id": "x", "prompt": "Another one?", "chosen": PROMPT + [CHOSEN], "rejected": PROMPT + [REJECTED],
             "source": "s"},
}
# A generation prompt the finished conversation does not contain: the prompt's ids are no prefix of it.
NO_PREFIX = LLAMA2 + "{% if add_generation_prompt %}{{ ' Answer:' }}{% endif %}"
BOS_BEFORE_ANSWER = LLAMA2 + "{% if add_generation_prompt %}{{ bos_token }}{% endif %}"


@pytest.mark.parametrize("fmt", ROWS)
def test_each_format_renders_as_apply_chat_template_with_the_answer_masked(fmt, sp, hf):
    got, sides = render_pair(ROWS[fmt], sp)
    assert got == fmt
    head = hf.apply_chat_template(PROMPT, add_generation_prompt=True)["input_ids"]  # TRL's prompt ids
    for (ids, mask), answer in zip(sides, (CHOSEN, REJECTED)):
        ref = hf.apply_chat_template(PROMPT + [answer], return_dict=True, return_assistant_tokens_mask=True)
        assert ids == ref["input_ids"] and ids[: len(head)] == head
        # transformers' assistant mask, without the history's answer: this answer and its </s> only.
        assert mask == [0] * len(head) + ref["assistant_masks"][len(head):]
        assert sum(ref["assistant_masks"][: len(head)]) > 0  # (the history's answer was masked by chat)
        answer_ids = [i for i, m in zip(ids, mask) if m]
        assert answer_ids[-1] == sp.eos_id and sp.decode(answer_ids).strip() == answer["content"].strip()


def test_tulu_rows_with_answers_alone_take_the_prompt_string_as_the_user_turn(sp):
    row = {"prompt": "Name a pet.", "chosen": [CHOSEN], "rejected": [REJECTED]}
    expected = render_pair({"prompt": [{"role": "user", "content": "Name a pet."}], "chosen": [CHOSEN],
                            "rejected": [REJECTED]}, sp)[1]
    assert render_pair(row, sp) == ("tulu", expected)


@pytest.mark.parametrize("row, template, reason", [
    (ROWS["explicit"], NO_PREFIX, NOT_A_PREFIX),
    (ROWS["implicit"], BOS_BEFORE_ANSWER, NOT_A_PREFIX),
    ({"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [{"role": "assistant", "content": " \n"}]}, None, EMPTY_ANSWER),
    ({"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [{"role": "assistant", "content": " Dog. "}]}, None, IDENTICAL),
    ({"chosen": PROMPT + [CHOSEN], "rejected": PROMPT[:2] + [REJECTED]}, None, PROMPTS_DIFFER),
    ({"question": "q", "answer": "a"}, None, NOT_A_PAIR),
    ({"prompt": PROMPT, "chosen": [{"role": "robot", "content": "x"}], "rejected": [REJECTED]}, None,
     "answer is not one assistant message"),
])
def test_unfit_pairs_are_refused_with_a_reason(row, template, reason, sp, tmp_path):
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        template = str(tmp_path / "t.jinja")
        render_pair(row, sp)  # the row itself is fine: the template breaks the prefix
    with pytest.raises(BadConversation) as e:
        render_pair(row, sp, template)
    assert e.value.reason == reason


def test_a_pair_longer_than_seq_len_is_refused_at_its_longer_side(sp):
    _, sides = render_pair(ROWS["explicit"], sp)
    longest = max(len(ids) for ids, _ in sides)
    assert len(sides[0][0]) != len(sides[1][0])  # the sides differ: the longer one decides
    assert render_pair(ROWS["explicit"], sp, seq_len=longest)[1] == sides
    with pytest.raises(BadConversation) as e:
        render_pair(ROWS["explicit"], sp, seq_len=longest - 1)
    assert e.value.reason == TOO_LONG


def test_tokenized_pairs_are_adjacent_in_input_order_and_refusals_are_counted(tmp_path, sp):
    """data.tokenize --pairs: documents 2p, 2p+1 are row p's chosen and rejected (as render_pair gives them),
    across formats; every refused row is counted by reason in the manifest, with an example id."""
    from data.tokenize import main

    good = [ROWS["explicit"], ROWS["implicit"],
            {"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "hi"}],
             "rejected": [{"role": "assistant", "content": "no"}]},
            ROWS["tulu"]]
    long = {"prompt": [{"role": "user", "content": "word " * 200}], "chosen": [CHOSEN], "rejected": [REJECTED]}
    bad = [{**ROWS["explicit"], "rejected": [{"role": "assistant", "content": ""}]},
           {**ROWS["explicit"], "rejected": [CHOSEN]}, long, {"text": "not a pair"}]
    rows = [good[0], bad[0], good[1], bad[1], good[2], bad[2], bad[3], good[3]]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--input", str(tmp_path / "raw.jsonl"), "--pairs", "--tokenizer", str(TINY_TOKENIZER),
          "--out", str(tmp_path / "tok"), "--seq-len", "128"])
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    entry = manifest["pairs"]
    assert entry["pairs"] == 4 and entry["format"] == {"explicit": 2, "implicit": 1, "tulu": 1}
    assert entry["rejected"] == {EMPTY_ANSWER: 1, IDENTICAL: 1, TOO_LONG: 1, NOT_A_PAIR: 1}
    assert entry["rejected_examples"][TOO_LONG].startswith("raw.jsonl/5: ")  # the row's id (file/line)
    assert entry["seq_len"] == 128 and entry["template"] == "llama2" and manifest["loss_mask"] is True
    assert manifest["num_documents"] == 8
    stored = list(pairs_of(tmp_path / "tok"))
    assert len(stored) == 4
    for (c, cm, r, rm), row in zip(stored, good):
        (chosen, chosen_mask), (rejected, rejected_mask) = render_pair(row, sp)[1]
        assert (c.tolist(), cm.tolist(), r.tolist(), rm.tolist()) == (chosen, chosen_mask, rejected, rejected_mask)
        for ids, mask, side in ((c, cm, "chosen"), (r, rm, "rejected")):  # independently: the row's own answers
            assert sp.decode(ids[mask == 1]).strip() == row[side][-1]["content"].strip()
        start = int(np.argmax(cm))  # the answer begins where the shared prompt ends
        assert (c[:start] == r[:start]).all() and not rm[:start].any() and rm[start]


def test_a_file_with_the_wrong_keys_exits_2_naming_its_columns(tmp_path, capsys):
    from data.tokenize import main

    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "q", "answer": "a", "id": "1"}) + "\n")
    with pytest.raises(SystemExit) as exit_:
        main(["--input", str(tmp_path / "qa.jsonl"), "--pairs", "--tokenizer", str(TINY_TOKENIZER),
              "--out", str(tmp_path / "tok")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "its rows have the columns ['question', 'answer', 'id']" in err
    assert f"rows refused: {{'{NOT_A_PAIR}': 1}}" in err and not (tmp_path / "tok" / "manifest.json").exists()


def test_pairs_of_refuses_a_source_that_is_not_pairs():
    from data.shards import ShardError

    with pytest.raises(ShardError, match="not a pair source"):
        next(pairs_of("assets/chat/held_out"))


def test_a_recipe_pair_source_is_tokenized_with_its_seq_len_and_template_and_checked_at_preflight(tmp_path):
    """``pairs = true`` in [[data.sources]]: train.data tokenize --recipe --source tokenizes it as pairs with the
    recipe's seq_len and template; the preflight accepts it, and names the source and field when the run's
    template differs, when the source is not pairs, or when pairs are used as a plain source."""
    from train import recipe as R
    from train.build import check_chat_templates
    from train.data import main as data_main

    too_long = {**ROWS["implicit"], "chosen": PROMPT + [{"role": "assistant", "content": "word " * 100}]}
    rows = [ROWS["explicit"], too_long]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mine.jinja").write_text(LLAMA2.replace("'[INST] '", "'Q: '"))
    recipe = f"""
[run]
name = "t"
output_dir = "{tmp_path / 'run'}"
[model]
flavor = "tiny"
[data]
tokenizer = "{TINY_TOKENIZER}"
[[data.sources]]
name = "prefs"
input = "{tmp_path / 'pairs.jsonl'}"
pairs = true
path = "{tmp_path / 'tok'}"
weight = 1.0
[optimizer]
lr = 1e-3
[training]
seq_len = 128
global_batch = 2
steps = 1
"""
    path = tmp_path / "dpo.toml"
    path.write_text(recipe)
    assert data_main(["tokenize", "--recipe", str(path), "--source", "prefs"]) == 0
    entry = json.loads((tmp_path / "tok" / "manifest.json").read_text())["pairs"]
    assert (entry["pairs"], entry["seq_len"], entry["template"], entry["rejected"]) == (1, 128, "llama2", {TOO_LONG: 1})
    assert check_chat_templates(R.load(str(path))) == []

    other = tmp_path / "other.toml"
    other.write_text(recipe.replace("[data]\n", f'[data]\nchat_template = "{tmp_path / "mine.jinja"}"\n'))
    (problem,) = check_chat_templates(R.load(str(other)))
    assert f"{tmp_path / 'tok' / 'manifest.json'} records pairs.template 'llama2'" in problem
    plain = tmp_path / "plain.toml"
    plain.write_text(recipe.replace("pairs = true\n", ""))
    (problem,) = check_chat_templates(R.load(str(plain)))
    assert "[data.sources[0]] pairs: source 'prefs' is not preference pairs" in problem and "pairs = true" in problem
    chat = tmp_path / "chat.toml"
    chat.write_text(recipe.replace(str(tmp_path / "tok"), str(R.REPO / "assets" / "chat" / "train")))
    (problem,) = check_chat_templates(R.load(str(chat)))
    assert "source 'prefs' is preference pairs, but" in problem and "has no 'pairs' entry" in problem

    from train.build import make_source_command

    own = tmp_path / "own.toml"  # the user's own files: no input, so data.tokenize with --pairs
    own.write_text(recipe.replace(f'input = "{tmp_path / "pairs.jsonl"}"\n', ""))
    own = R.load(str(own))
    assert make_source_command(own, own.data.sources[0]).startswith(
        "python -m data.tokenize --input <your jsonl/parquet files> --pairs --seq-len 128 ")

    both = tmp_path / "both.toml"
    both.write_text(recipe.replace("pairs = true\n", 'pairs = true\nchat_key = "messages"\n'))
    with pytest.raises(R.RecipeError, match="source 'prefs'.*give pairs or chat_key, not both"):
        R.load(str(both))


def test_bundled_pairs_regenerate_byte_identical_and_follow_their_rule(tmp_path):
    """assets/preference is what `python -m data.make_sample_pairs` writes, byte for byte (raw pairs, manifests
    with their checksums, token, index, mask and metadata files); every chosen answer does what its prompt
    asks (the word, or the sum), every rejected one is a refusal; the 3 bad pairs are counted and refused."""
    import re

    from data.make_sample_pairs import REFUSALS, SEQ_LEN, build
    from data.shards import verify_checksums
    from rundir import REPO

    bundled = REPO / "assets" / "preference"
    build(tmp_path)
    files = sorted(p.relative_to(bundled) for p in bundled.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for name in ("train", "held_out"):
        verify_checksums(tmp_path / name)
    stale = [str(f) for f in files if (tmp_path / f).read_bytes() != (bundled / f).read_bytes()]
    assert not stale, f"assets/preference differs from a fresh `python -m data.make_sample_pairs`: {stale}"
    assert sum(f.stat().st_size for f in bundled.rglob("*") if f.is_file()) < 1 << 20

    rows = [json.loads(line) for line in (bundled / "pairs.jsonl").read_text().splitlines()]
    assert all(list(r) == ["prompt", "chosen", "rejected"] for r in rows)
    good = rows[:-3]
    for r in good:
        question, answer = r["prompt"][-1]["content"], r["chosen"][0]["content"]
        if m := re.fullmatch(r"What is (\d+) \+ (\d+)\?", question):
            assert int(answer) == int(m[1]) + int(m[2])
        else:
            assert re.search(rf"\b{answer}\b", question)
        assert r["rejected"][0]["content"] in REFUSALS
    train, held_out = (json.loads((bundled / n / "manifest.json").read_text())["pairs"] for n in ("train", "held_out"))
    assert (train["pairs"], held_out["pairs"]) == (len(good) - len(good[::10]), len(good[::10]))
    assert 1000 <= train["pairs"] <= 2000 and 100 <= held_out["pairs"] <= 200 and train["seq_len"] == SEQ_LEN
    assert train["rejected"] == {IDENTICAL: 1, EMPTY_ANSWER: 1, TOO_LONG: 1} and held_out["rejected"] == {}


@pytest.mark.parametrize("flags, message", [
    (["--pairs", "--chat-key", "messages"], "give --pairs or --chat-key, not both"),
    (["--seq-len", "128"], "--seq-len is for --pairs"),
])
def test_flags_that_do_not_go_together_exit_2(flags, message, tmp_path, capsys):
    from data.tokenize import main

    with pytest.raises(SystemExit) as exit_:
        main(["--input", "assets/preference/pairs.jsonl", "--tokenizer", str(TINY_TOKENIZER),
              "--out", str(tmp_path / "tok"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
