"""Held-out documents (data.held_out): the documents held out are the ones a reference key, computed
here with hashlib and struct alone, puts below the threshold; a split keeps every document exactly
once; a held-out document never reaches a training batch; tokenization splits the same way."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data import held_out as H
from data import tokenize
from data.mixture import Mixture, MixtureLoader, SourceSpec
from data.shards import load_manifest, open_source, verify_checksums, write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, Tokenizer, load_tokenizer
from rundir import REPO

TOK = Tokenizer()
MARK = 4000  # ids >= MARK appear only in planted documents (the others draw from [3, 3000))


def reference_key(doc) -> int:
    """The rule, written out: BLAKE2b, 8 bytes, over the ids as little-endian uint32, little-endian."""
    return int.from_bytes(hashlib.blake2b(struct.pack(f"<{len(doc)}I", *doc), digest_size=8).digest(), "little")


def held_by_fraction(doc, fraction) -> bool:
    return reference_key(doc) < math.floor(fraction * 2**64)


def random_docs(n, seed=0, low=3, high=3000) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [(TOK.bos_id, *rng.integers(low, high, rng.integers(5, 60)).tolist(), TOK.eos_id) for _ in range(n)]


def write_source(directory: Path, shards: list[list[tuple]], loss: bool = False) -> Path:
    directory.mkdir(parents=True)
    for i, docs in enumerate(shards):
        write_shard(directory / f"{i:05d}_unshuffled.ds", docs,
                    loss=[[t % 2 for t in d] for d in docs] if loss else None)
    write_manifest(directory, {"path": str(TINY_TOKENIZER), "fingerprint": TOK.fingerprint,
                               "vocab_size": TOK.vocab_size, "bos_id": TOK.bos_id, "eos_id": TOK.eos_id},
                   {"kind": "test"}, {"chat": {"template": "test"}} if loss else None)
    return directory


def documents(directory: Path) -> Counter:
    source = open_source(directory)
    return Counter(tuple(s.document(i).tolist()) for s in source.shards for i in range(s.num_documents))


def test_a_split_keeps_every_document_once_and_holds_out_what_the_rule_says(tmp_path, capsys):
    docs = random_docs(300)
    docs += [docs[7], docs[200]]  # exact duplicates, in the other shard: a copy goes where its original goes
    before = Counter(docs)
    source = write_source(tmp_path / "src", [docs[:150], docs[150:]])

    assert H.main([str(source), "--held-out", "0.2"]) == 0
    held, kept = documents(source / "held_out"), documents(source)
    assert held + kept == before  # every document exactly once, duplicates included
    assert set(held) == {d for d in before if held_by_fraction(d, 0.2)}
    assert 30 < sum(held.values()) < 90  # ~60 of 302: the keys spread evenly
    assert held[docs[7]] == before[docs[7]] or kept[docs[7]] == before[docs[7]]
    for directory in (source, source / "held_out"):
        verify_checksums(directory)  # the manifests describe the shards as rewritten
    manifest, entry = load_manifest(source), load_manifest(source / "held_out")["held_out"]
    assert manifest["held_out"] == entry and entry["held_out"] == 0.2
    assert (entry["documents"], manifest["num_documents"]) == (sum(held.values()), sum(kept.values()))
    assert entry["tokens"] == sum(len(d) * n for d, n in held.items())
    assert str(source / "held_out") in capsys.readouterr().out

    # the same documents, sharded otherwise and in another order: the same ones held out
    other = write_source(tmp_path / "other", [docs[::-1][:100], docs[::-1][100:200], docs[::-1][200:]])
    H.split(other, 0.2)
    assert documents(other / "held_out") == held


def test_a_count_holds_out_the_documents_of_smallest_key(tmp_path):
    docs = random_docs(120, seed=1)
    source = write_source(tmp_path / "src", [docs[:60], docs[60:]])
    H.split(source, 7)
    assert set(documents(source / "held_out")) == set(sorted(docs, key=reference_key)[:7])
    assert sum(documents(source).values()) == 113


def test_loss_masks_travel_with_their_documents(tmp_path):
    docs = random_docs(80, seed=2)
    source = write_source(tmp_path / "src", [docs[:40], docs[40:]], loss=True)
    H.split(source, 0.3)
    for directory in (source, source / "held_out"):
        opened = open_source(directory)
        assert opened.manifest["chat"] == {"template": "test"}  # the chat entry is carried to both
        for shard in opened.shards:
            assert np.array_equal(np.asarray(shard.loss), np.asarray(shard.tokens) % 2)


def test_a_second_split_changes_nothing_and_another_setting_is_refused(tmp_path, capsys):
    source = write_source(tmp_path / "src", [random_docs(100, seed=3)])
    H.split(source, 0.25)
    before = {p.name: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    H.split(source, 0.25)
    assert {p.name: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    assert H.main([str(source), "--held-out", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"{source}: already split with held_out 0.25" in err and "not 0.5" in err
    with pytest.raises(H.HeldOutError, match="selects none of its 100 documents"):
        H.split(write_source(tmp_path / "small", [random_docs(100, seed=3)]), 1e-9)
    with pytest.raises(H.HeldOutError, match="the source has only 100"):
        H.split(tmp_path / "small", 100)


def test_a_rerun_refuses_a_training_shard_that_holds_a_held_out_document(tmp_path, capsys):
    """A split source whose shard was written again after the split (tokenized again into its dir, as a
    tokenization rerun rewrites its manifest from the shards) holds held-out documents in training again;
    a re-run with the same setting finds their keys there and refuses, naming that shard, instead of
    recording the split as done."""
    docs = random_docs(100, seed=8)
    source = write_source(tmp_path / "src", [docs[:50], docs[50:]])
    H.split(source, 0.25)
    held = documents(source / "held_out")
    leaked = [d for d in docs[50:] if d in held]
    assert leaked and any(d in held for d in docs[:50])  # both shards had held-out documents
    write_shard(source / "00001_unshuffled.ds", docs[50:])  # shard 1 as tokenized, before its split
    write_manifest(source, load_manifest(source)["tokenizer"], {"kind": "test"})
    manifest = (source / "manifest.json").read_text()
    assert H.main([str(source), "--held-out", "0.25"]) == 2
    err = capsys.readouterr().err
    assert f"{source}: held_out: {source / '00001_unshuffled.ds'} holds {len(leaked)} held-out document" in err
    assert "00000_unshuffled" not in err  # the shard the split left alone is not named
    assert (source / "manifest.json").read_text() == manifest  # no held_out entry: the source is not called split


@pytest.mark.parametrize("value, why", [(1.0, "a fraction must be in (0, 1)"), (-1, "a document count must be >= 1"),
                                        (True, "expected a fraction"), ("0.1", "expected a fraction")])
def test_bad_settings_say_why(value, why):
    assert why in H.held_out_problem(value)


def planted(fraction: float, held: bool) -> tuple[int, ...]:
    """A document of ids no other document has, held out by the rule (or not)."""
    for j in range(1000):
        doc = (TOK.bos_id, MARK, MARK + 1 + j % 50, MARK + 51 + j // 50, MARK, TOK.eos_id)
        if held_by_fraction(doc, fraction) == held:
            return doc
    raise AssertionError("no candidate")


def read_every_batch(sources: list[Path], epochs: int, seq_len: int = 16, batch: int = 8) -> np.ndarray:
    """Every training batch of a 2-source mixture until each source has been read ``epochs`` times over
    (its max_epochs: one more sample would raise), ids of inputs and labels side by side."""
    specs = [SourceSpec(f"s{i}", p, weight=float(open_source(p).num_tokens), max_epochs=epochs)  # even epochs
             for i, p in enumerate(sources)]
    mixture = Mixture(specs, seq_len=seq_len, seed=5)
    tokens = [stream.num_tokens for stream in mixture.streams]
    n = 0  # the most whole batches every source can give within its epochs
    while all(((k + 1) * seq_len + 1) <= epochs * t for k, t in
              zip(mixture.samples_per_source(n + batch) - 1, tokens)):
        n += batch
    loader, seen = MixtureLoader(mixture, batch), []
    for _ in range(n // batch):
        b = next(loader)
        seen += [b["input_ids"], b["labels"]]
    read = mixture.samples_per_source(n) * seq_len
    assert all(r > (epochs - 0.1) * t for r, t in zip(read, tokens)), (read, tokens)  # ~3 full epochs of each
    return np.concatenate(seen)


def test_a_planted_held_out_document_is_in_no_training_batch_over_three_epochs(tmp_path):
    hidden, control = planted(0.2, held=True), planted(0.2, held=False)
    a = random_docs(60, seed=4)
    sources = [write_source(tmp_path / "a", [a[:30] + [hidden], a[30:] + [control]]),
               write_source(tmp_path / "b", [random_docs(50, seed=6)])]
    unsplit = [write_source(tmp_path / "a0", [a[:30] + [hidden], a[30:] + [control]]), sources[1]]
    for source in sources:
        assert H.main([str(source), "--held-out", "0.2"]) == 0
    assert hidden in documents(sources[0] / "held_out") and control in documents(sources[0])

    def contains(ids: np.ndarray, doc: tuple) -> bool:  # the document's marked middle, anywhere in a row
        window = np.lib.stride_tricks.sliding_window_view(ids, len(doc) - 2, axis=1)
        return bool((window == np.array(doc[1:-1])).all(-1).any())

    ids = read_every_batch(sources, epochs=3)
    assert not contains(ids, hidden) and not (ids == hidden[2]).any()  # not whole, nor any of its unique ids
    assert contains(ids, control)  # a document the rule keeps is read, so the test reads the right rows
    assert contains(read_every_batch(unsplit, epochs=3), hidden)  # and unsplit, the planted one is read


def test_tokenization_holds_out_by_the_same_rule_and_a_rerun_keeps_the_split(tmp_path, capsys):
    from tests.data.test_tokenize import make_corpus

    texts = [t for f in make_corpus(tmp_path / "in", 90) for t in f]
    args = ["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--tokenizer", str(TINY_TOKENIZER),
            "--tasks", "2", "--held-out", "0.25"]
    tokenize.main(args)
    assert "held_out: " in capsys.readouterr().out
    tok = load_tokenizer()
    everything = Counter(tuple(tok.encode_document(t)) for t in texts)
    held = documents(tmp_path / "out" / "held_out")
    assert held + documents(tmp_path / "out") == everything
    assert set(held) == {d for d in everything if held_by_fraction(d, 0.25)} and held
    manifest = (tmp_path / "out" / "manifest.json").read_text()
    tokenize.main(args)  # finished tasks are skipped, the manifest is rewritten from the shards: the split stays
    assert (tmp_path / "out" / "manifest.json").read_text() == manifest
    assert json.loads(manifest)["held_out"]["held_out"] == 0.25


def test_pair_sources_are_not_split_by_document(tmp_path):
    """A hash of single documents would part a pair's chosen from its rejected: the split refuses a
    pair source, and a recipe source may not set it."""
    from data.pairs import MANIFEST_KEY as PAIRS
    from data.mixture import MixtureError

    pairs = REPO / "assets" / "preference" / "train"
    copy = tmp_path / "pairs"
    shutil.copytree(pairs, copy)
    with pytest.raises(H.HeldOutError, match="preference-pair source"):
        H.split(copy, 0.1)
    assert PAIRS in load_manifest(copy) and not (copy / "held_out").exists()
    with pytest.raises(MixtureError, match="held_out: not for pairs"):
        SourceSpec(name="p", path=str(copy), weight=1.0, pairs=True, held_out=0.1)
