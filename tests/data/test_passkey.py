"""The bundled long-context data (data.make_passkey): the passkey rule, the held-out split, the packing
into whole documents, and that assets/passkey and assets/long are what the script makes."""

from __future__ import annotations

import filecmp
import random
from pathlib import Path

import numpy as np
import pytest

from data import make_passkey as P
from data.mixture import Mixture, SourceSpec
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
    return P.passkey_documents(tok, ASSETS / "sample_data" / "prose", n=40, seed=1)


def _documents(folder: Path) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in s.document(i)) for s in open_source(folder).shards for i in range(s.num_documents)]


def test_every_document_hides_its_key_and_asks_for_it_at_the_end(tok, docs):
    keys = [d["key"] for d in docs]
    assert len(set(keys)) == len(keys)  # unique: a held-out key is in no training document
    for d in docs:
        key, text = d["key"], d["text"]
        assert len(key) == P.KEY_DIGITS and len(set(key)) == P.KEY_DIGITS and key[0] != "0"
        assert P.NEEDLE.format(key=key) in text and text.endswith(f"{P.QUESTION} {key}.")
        assert {c for c in text if c.isdigit()} <= set(key)  # the filler has no digits
        assert text.count(key) == 3  # twice in the needle, once as the answer
        ids = tok.encode_document(text)
        assert len(ids) == P.SEQ_LEN
        prompt, answer = P.split_prompt(ids, tok)
        assert tok.decode(answer) == key and prompt + answer == ids[:len(prompt) + len(answer)]
        assert tok.decode(prompt).endswith(P.QUESTION + " ")  # the prompt asks, to its "▁"; the answer is the key
        found = [i for i in range(len(prompt)) if prompt[i:i + len(answer)] == answer]
        assert len(found) == 2 and found[1] - found[0] < 16  # the needle, once, before the question
        room = P.SEQ_LEN - 2 - len(tok.encode(P.NEEDLE.format(key=key))) - len(tok.encode(f"{P.QUESTION} {key}."))
        assert abs(found[0] - (6 + d["depth"] * room)) <= 12  # BOS, depth of the filler, "The pass key is ▁"
    depths = sorted(d["depth"] for d in docs)
    assert depths[0] < 0.15 and depths[-1] > 0.85  # from the start to the end of the document


def test_split_prompt_refuses_what_is_not_a_passkey_document(tok, docs):
    ids = tok.encode_document(docs[0]["text"])
    for bad in (tok.encode_document("What is the pass key? The pass key is unknown."),
                ids[:-1], ids[:-3] + ids[-2:], tok.encode_document(docs[0]["text"][:-3] + "4x.")):
        with pytest.raises(ValueError, match="not a passkey document"):
            P.split_prompt(bad, tok)


def test_keys_are_drawn_as_the_rule_says():
    keys = P.keys(2000, random.Random(0))
    assert len(set(keys)) == 2000 and all(len(set(k)) == P.KEY_DIGITS and k[0] != "0" for k in keys)
    assert {c for k in keys for c in k} == DIGITS


@pytest.mark.parametrize("source", ["passkey", "long"])
def test_held_out_documents_are_disjoint_from_training(tok, source):
    train, held = _documents(ASSETS / source), _documents(ASSETS / source / "held_out")
    manifest = load_manifest(ASSETS / source)
    assert held and train and not set(train) & set(held)
    assert len(held) == manifest["held_out"]["documents"]
    assert manifest["held_out"]["held_out"] == {"passkey": P.PASSKEY_HELD_OUT, "long": P.LONG_HELD_OUT}[source]
    assert min(map(len, train + held)) >= P.SEQ_LEN  # passkey: exactly; long: min_doc_tokens
    if source == "passkey":
        assert {len(d) for d in train + held} == {P.SEQ_LEN}
        train_keys = {tok.decode(P.split_prompt(d, tok)[1]) for d in train}
        held_keys = {tok.decode(P.split_prompt(d, tok)[1]) for d in held}
        assert len(train_keys) == len(train) and len(held_keys) == len(held) and not train_keys & held_keys


def test_a_packed_sample_at_seq_len_is_one_whole_passkey_document(tok):
    """data.mixture cuts a source's stream into seq_len windows: documents of exactly seq_len tokens
    make every sample one document, from BOS to EOS, so no key is ever cut from its question."""
    mix = Mixture([SourceSpec("passkey", ASSETS / "passkey", weight=1, max_epochs=10)], seq_len=P.SEQ_LEN, seed=3)
    batch = mix.batch(np.arange(300))  # past one epoch (its documents reshuffled)
    assert (batch["positions"] == np.arange(P.SEQ_LEN)).all()
    training = set(_documents(ASSETS / "passkey"))
    for ids in batch["input_ids"]:
        assert tuple(ids.tolist()) in training
        P.split_prompt(ids.tolist(), tok)


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
