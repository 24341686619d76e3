"""eval.passkey against a greedy loop written out by hand, on a real tiny Laneformer and hand-made documents.

The model is a random tiny Laneformer (8 lanes, window and full layers, 512 positions) whose
``lm_head`` rows of every id but the ten digits are zero, so that its greedy answers are digits
(the other logits are 0; a digit's is the largest in all but a ~1/1024 chance per step): its forward,
its decoder and its checkpoint are the real ones. The hand-made documents are generated held-out
passkey documents whose answer is replaced by the model's own greedy answer in half of them and by
other digits in the rest, the greedy answer computed by hand (the whole sequence through
``Laneformer.forward`` again at every step, no KV cache, the answer cut at the document's tail by its
length): the evaluator must read the prompts, decode, and score exactly as that loop does, from a run
dir on disk through its CLI.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from data import make_passkey as P
from data.shards import write_manifest, write_shard
from data.tokenize import tokenizer_info
from data.tokenizer import TINY_TOKENIZER, Tokenizer
from eval import passkey as E
from models.laneformer import laneformer_configs, write_native_config
from models.laneformer.attention import attention_config
from models.laneformer.generate import random_weights
from models.laneformer.hf.checkpoint_io import save_dcp
from rundir import REPO
from tests.conftest import other_tokenizer
from tests.models.conftest import model_from_weights

K = P.KEY_DIGITS


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tok = Tokenizer(TINY_TOKENIZER)
    config = dataclasses.replace(laneformer_configs["tiny"](), max_seq_len=P.SEQ_LEN,
                                 inner_attention=attention_config("dense"))
    weights = random_weights(config, range(config.n_lanes), seed=5)
    digits = [tok.encode(f"0{d}")[-1] for d in range(10)]
    keep = torch.zeros(config.vocab_size, 1)
    keep[digits] = 1
    weights["lm_head.weight"] = weights["lm_head.weight"] * keep
    run = tmp_path_factory.mktemp("passkey") / "run"
    save_dcp(weights, run / "checkpoints" / "step-1")
    write_native_config(config, run)
    (run / "recipe.toml").write_text(f'[data]\ntokenizer = "{TINY_TOKENIZER}"\n')

    model = model_from_weights(config, weights)
    docs, by_hand = [], []
    prose = REPO / "assets" / "sample_data" / "prose"
    for i, d in enumerate(P.passkey_documents(tok, prose, train=0, held_out=6, seed=2)):  # of SEQ_LEN tokens
        ids = tok.encode_document(d["text"])
        prompt, tail = ids[:-(K + 2)], ids[-2:]  # by hand: "<key digits> . </s>" end every document
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(K):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        got = seq[len(prompt):]
        assert all(t in digits for t in got)
        # half answer what the model says, half a key one off in every digit (a chance hit would be 1 in 10)
        key = got if i % 2 == 0 else [digits[(digits.index(t) + 1) % 10] for t in got]
        docs.append(prompt + key + tail)
        by_hand.append(got)
    data = run.parent / "docs"
    data.mkdir()
    write_shard(data / "00000_unshuffled.ds", docs)
    write_manifest(data, tokenizer_info(tok), {"kind": "hand-made passkey documents"})
    return run, data, docs, by_hand


def test_accuracy_equals_a_greedy_loop_by_hand(case, tmp_path, capsys):
    run, data, docs, by_hand = case
    assert E.main([str(run), "--data", str(data), "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    expected = [d[-(K + 2):-2] for d in docs]
    right = [g == e for g, e in zip(by_hand, expected)]
    assert right == [True, False] * 3  # the hand-made case: half answered, half not
    assert [r["answer"] for r in out["results"]] == by_hand
    assert [r["correct"] for r in out["results"]] == right
    assert out["accuracy"] == 0.5 and out["documents"] == 6 and out["lengths"] == [P.SEQ_LEN]
    assert out["digit_accuracy"] == sum(a == b for g, e in zip(by_hand, expected) for a, b in zip(g, e)) / (6 * K)
    tok = Tokenizer(TINY_TOKENIZER)
    buckets: dict[str, list[bool]] = {}  # by the needle's first digit, in 128-token buckets
    for ids, ok in zip(docs, right):
        at = next(i for i, t in enumerate(ids) if tok.decode([t]).strip().isdigit())
        buckets.setdefault(f"{at // 128 * 128}-{at // 128 * 128 + 128}", []).append(ok)
    assert out["by_key_position"] == {k: {"documents": len(v), "accuracy": sum(v) / len(v)}
                                      for k, v in sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0]))}
    assert "accuracy 0.500 (3/6)" in capsys.readouterr().out


def test_documents_longer_than_the_model_are_refused(case, capsys):
    run, data, _, _ = case
    assert E.main([str(run), "--data", str(data), "--set", "max_seq_len=256"]) == 2
    assert f"documents of {P.SEQ_LEN} tokens exceed model.max_seq_len=256" in capsys.readouterr().err


def test_the_bundled_held_out_documents_read_as_passkey_documents():
    tok = Tokenizer(TINY_TOKENIZER)
    docs = E.documents(E.DEFAULT_DATA, tok, tok.vocab_size)
    assert docs == E.documents(E.DEFAULT_DATA.parent, tok, tok.vocab_size)  # a split source: its held_out/
    assert len(docs) == P.HELD_OUT_DOCUMENTS and {d.length for d in docs} == {P.SEQ_LEN}
    assert all(len(d.prompt) + len(d.answer) + 2 == d.length for d in docs)  # then "." and EOS
    positions = [E.key_position(d.prompt, tok) for d in docs]
    assert min(positions) < 128 and max(positions) > 384  # keys at every depth


def test_bad_input_is_refused_naming_the_flag_before_the_weights_load(case, tmp_path, capsys, monkeypatch):
    run, data, docs, _ = case
    other = Tokenizer(other_tokenizer(tmp_path / "other"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    write_shard(foreign / "00000_unshuffled.ds", docs)
    write_manifest(foreign, tokenizer_info(other), {"kind": "the same documents, another tokenizer's manifest"})
    monkeypatch.setattr(E.LaneDecoder, "__init__", lambda *a, **k: pytest.fail("the weights loaded"))
    refused = {
        ("--limit", "0"): "passkey: --limit: must be >= 1 (got 0)",
        ("--data", str(tmp_path / "nope")): f"passkey: --data {tmp_path / 'nope'}: ",
        ("--data", str(REPO / "assets" / "long")): f"passkey: --data {REPO / 'assets' / 'long' / 'held_out'}: "
                                                   "document 0: not a passkey document",
        ("--data", str(foreign)): f"passkey: --data {foreign}: ",
    }
    for flags, message in refused.items():
        assert E.main([str(run), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
    assert E.main([str(run), "--data", str(foreign)]) == 2
    assert "fingerprint" in capsys.readouterr().err
    assert E.main([str(tmp_path / "no-run"), "--data", str(data)]) == 2
    assert "passkey: " in capsys.readouterr().err


def test_length_scores_fresh_documents_of_that_length(case, tmp_path):
    """``--length N``: ``--limit`` documents of exactly N tokens from make_passkey.probe_documents (the same for
    the same seed, keys at every depth, none of the bundle's), each scored against its own key."""
    run, _, _, _ = case
    tok = Tokenizer(TINY_TOKENIZER)
    made = P.probe_documents(tok, 384, 8)
    assert made == P.probe_documents(tok, 384, 8) != P.probe_documents(tok, 384, 8, seed=1)
    assert {len(ids) for ids in made} == {384}
    depths = [E.key_position(P.split_prompt(ids, tok)[0], tok) for ids in made]
    assert max(depths) - min(depths) > 128  # the needle at many depths
    bundled = {tuple(tok.encode_document(d["text"])) for d in P.passkey_documents(tok, train=0, held_out=4)}
    assert not bundled & {tuple(ids) for ids in P.probe_documents(tok, P.SEQ_LEN, 4)}
    assert E.main([str(run), "--length", "384", "--limit", "8", "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["documents"] == 8 and out["lengths"] == [384]
    assert [r["expected"] for r in out["results"]] == [P.split_prompt(ids, tok)[1] for ids in made]


def test_length_is_refused_naming_the_flag_before_the_weights_load(case, tmp_path, capsys, monkeypatch):
    run, data, _, _ = case
    other = tmp_path / "other-run"
    other.mkdir()
    for f in run.iterdir():
        (other / f.name).symlink_to(f)
    (other / "recipe.toml").unlink()
    (other / "recipe.toml").write_text(f'[data]\ntokenizer = "{other_tokenizer(tmp_path / "tok")}"\n')
    monkeypatch.setattr(E.LaneDecoder, "__init__", lambda *a, **k: pytest.fail("the weights loaded"))
    refused = {
        (str(run), "--length", "10"): "passkey: --length 10: a passkey document is at least 64 tokens (got 10)",
        (str(run), "--length", "1024"): "passkey: --length 1024: documents of 1024 tokens exceed model.max_seq_len=512; "
                                        "pass --set max_seq_len=1024",
        (str(other), "--length", "256"): f"passkey: --length 256: the documents are made with the bundled tiny "
                                         f"tokenizer ({TINY_TOKENIZER}) and {other} uses another",
    }
    for argv, message in refused.items():
        assert E.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit) as exit_:
        E.main([str(run), "--length", "256", "--data", str(data)])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
