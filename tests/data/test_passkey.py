"""The bundled long-context data (data.make_passkey): the passkey rule, the held-out split by length, the
answer-only loss mask as the mixture reads it, and that assets/passkey and assets/long are what the script makes."""

from __future__ import annotations

import filecmp
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data import make_passkey as P
from data.held_out import document_key, threshold
from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
from data.shards import load_manifest, open_source
from data.tokenizer import Tokenizer
from rundir import REPO

ASSETS = REPO / "assets"
DIGITS = set("0123456789")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


@pytest.fixture(scope="module")
def docs(tok) -> list[dict]:
    return P.passkey_documents(tok, ASSETS / "sample_data" / "prose", train=40, held_out=4, seed=1)


@pytest.fixture(scope="module")
def question(tok) -> list[int]:
    """The question's ids up to its ``▁``: the answer's digit follows them."""
    return tok.encode(f"{P.QUESTION} 0")[:-1]


def _documents(folder: Path) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in s.document(i)) for s in open_source(folder).shards for i in range(s.num_documents)]


def test_every_document_hides_its_key_and_asks_for_it_at_the_end(tok, docs):
    vocab = set(P.vocabulary(tok, ASSETS / "sample_data" / "prose")[0])
    for d in docs:
        key, text = d["key"], d["text"]
        needle, asked = P.NEEDLE.format(key=key), f"{P.QUESTION} {key}."
        assert len(key) == P.KEY_DIGITS == 1 and key in DIGITS
        assert needle in text and text.endswith(asked)
        assert {c for c in text if c.isdigit()} == {key}  # the filler has no digits
        assert text.count(key) == 3  # twice in the needle, once as the answer
        assert set(text.replace(needle, " ").removesuffix(asked).split()) <= vocab  # filler: the vocabulary's words
        ids = tok.encode_document(text)
        assert len(ids) == d["length"] and P.MIN_LEN <= d["length"] <= P.SEQ_LEN
        prompt, answer = P.split_prompt(ids, tok)
        assert tok.decode(answer) == key and prompt + answer == ids[:len(prompt) + len(answer)]
        assert tok.decode(prompt).endswith(P.QUESTION + " ")  # the prompt asks, to its "▁"; the answer is the key
        found = [i for i in range(len(prompt)) if prompt[i:i + len(answer)] == answer]
        assert len(found) == 2 and found[1] - found[0] < 16  # the needle, once, before the question
        room = d["length"] - 2 - len(tok.encode(needle)) - len(tok.encode(asked))
        assert 0 <= 6 + d["depth"] * room - found[0] < P.MAX_WORD_TOKENS  # BOS, depth of the filler, "... is ▁"
    depths = sorted(d["depth"] for d in docs)
    assert depths[0] < 0.15 and depths[-1] > 0.85  # from the start to the end of the filler


def test_documents_are_made_on_their_side_of_the_held_out_rule(tok, docs):
    """Training documents of MIN_LEN..SEQ_LEN tokens that the hash keeps in, then held-out ones of SEQ_LEN
    that it holds out: the split at tokenization holds out exactly the documents made for it."""
    below = threshold(P.PASSKEY_HELD_OUT, [])
    assert [d["held_out"] for d in docs] == [False] * 40 + [True] * 4
    for d in docs:
        assert (document_key(tok.encode_document(d["text"])) < below) == d["held_out"]
    assert {d["length"] for d in docs if d["held_out"]} == {P.SEQ_LEN}
    lengths = [d["length"] for d in docs if not d["held_out"]]
    assert len(set(lengths)) > 30 and min(lengths) < 128 and max(lengths) > 448


def test_split_prompt_refuses_what_is_not_a_passkey_document(tok, docs):
    ids = tok.encode_document(docs[0]["text"])
    for bad in (tok.encode_document("What is the pass key? The pass key is unknown."),
                ids[:-1], ids[:-3] + ids[-2:], tok.encode_document(docs[0]["text"][:-2] + "x.")):
        with pytest.raises(ValueError, match="not a passkey document"):
            P.split_prompt(bad, tok)


@pytest.mark.parametrize("source", ["passkey", "long"])
def test_held_out_documents_are_disjoint_from_training(tok, source):
    train, held = _documents(ASSETS / source), _documents(ASSETS / source / "held_out")
    manifest = load_manifest(ASSETS / source)
    assert held and train and not set(train) & set(held)
    assert len(held) == manifest["held_out"]["documents"]
    assert manifest["held_out"]["held_out"] == {"passkey": P.PASSKEY_HELD_OUT, "long": P.LONG_HELD_OUT}[source]
    if source == "long":
        assert min(map(len, train + held)) >= P.SEQ_LEN  # min_doc_tokens
        return
    assert (len(train), len(held)) == (P.TRAIN_DOCUMENTS, P.HELD_OUT_DOCUMENTS)
    assert {len(d) for d in held} == {P.SEQ_LEN}  # what eval.passkey scores
    lengths = [len(d) for d in train]
    assert P.MIN_LEN <= min(lengths) < P.MIN_LEN + 5 and P.SEQ_LEN - 5 < max(lengths) <= P.SEQ_LEN
    keys = Counter(tok.decode(P.split_prompt(d, tok)[1]) for d in train + held)
    assert set(keys) == DIGITS and min(keys.values()) > 150  # uniform: about 206 each


@pytest.mark.parametrize("folder", ["passkey", "passkey/held_out"])
def test_the_loss_mask_is_on_each_answer_digit_alone(tok, question, folder):
    source = open_source(ASSETS / folder)
    assert source.manifest["loss_mask"] is True
    for shard in source.shards:
        assert shard.loss is not None
        answers = shard.doc_ends.astype(np.int64) - 3  # each document's digit, before "." and EOS
        assert np.array_equal(np.flatnonzero(shard.loss), answers) and set(np.unique(shard.loss)) == {0, 1}
        tokens = np.asarray(shard.tokens)
        for at in answers:
            assert tok.decode([int(tokens[at])]).strip() in DIGITS
            assert tokens[at - len(question):at].tolist() == question  # the question's digit, not the needle's


def test_the_mixture_trains_on_the_answer_digits_alone(tok, question):
    """data.mixture packs several documents into a 512-token sample (positions restart at each) and keeps a
    label only where the mask marks its token: the answer's digit after each question, nothing else."""
    mix = Mixture([SourceSpec("passkey", ASSETS / "passkey", weight=1, max_epochs=10)], seq_len=P.SEQ_LEN, seed=3)
    batch = mix.batch(np.arange(-(-mix.streams[0].num_tokens // P.SEQ_LEN)))  # an epoch: every document
    assert (batch["positions"] == 0).sum(axis=1).mean() > 2  # the sample's start and more than one document start
    digits = {tok.encode(f"0{d}")[-1] for d in range(10)}
    q, trained = len(question), 0
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        asked = {j for j in range(q - 1, P.SEQ_LEN) if ids[j - q + 1:j + 1] == question}
        kept = {j for j, label in enumerate(labels) if label != IGNORE_INDEX}
        assert {j for j in kept if j >= q - 1} == asked and all(labels[j] in digits for j in kept)  # a question
        # cut by the sample's start is not matched here
        assert all(labels[j] == ids[j + 1] for j in kept if j + 1 < P.SEQ_LEN)
        trained += len(kept)
    assert trained > len(batch["labels"])  # more than one answer a sample


def assert_bundled(made: Path) -> None:
    """``made`` (python -m data.make_passkey --out made) holds assets/passkey and assets/long, byte for byte."""
    for source in ("passkey", "long"):
        for sub in ("", "held_out"):
            ours, bundled = made / source / sub, ASSETS / source / sub
            names = sorted(p.name for p in ours.iterdir() if p.is_file())
            assert names == sorted(p.name for p in bundled.iterdir() if p.is_file()), (source, sub)
            _, mismatch, errors = filecmp.cmpfiles(ours, bundled, names, shallow=False)
            assert not mismatch and not errors, (f"{bundled} differs from what python -m data.make_passkey makes: "
                                                 f"{mismatch + errors}")


def test_bundled_assets_are_what_the_script_makes(tmp_path):
    P.build(tmp_path)
    assert_bundled(tmp_path)
