"""data.mixture / data.shards: determinism, world-size independence, resume, shares, packing, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data.mixture import Mixture, MixtureError, MixtureLoader, SourceSpec
from data.shards import ShardError, open_source, write_manifest, write_shard
from data.tokenizer import load_tokenizer
from rundir import REPO

FP = "f" * 64
TOK = {"path": "test", "fingerprint": FP, "vocab_size": 4096, "bos_id": 1, "eos_id": 2}
SAMPLE_DATA = REPO / "assets" / "sample_data"


def make_source(directory: Path, n_docs=(40, 25), mean_len=30, seed=0, vocab=4096) -> list[list[int]]:
    """A tokenized source of framed random documents over len(n_docs) shards; returns all documents."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    docs = []
    for s, n in enumerate(n_docs):
        shard = [[1] + rng.integers(3, vocab, rng.integers(0, 2 * mean_len)).tolist() + [2] for _ in range(n)]
        write_shard(directory / f"{s:05d}_unshuffled.ds", shard)
        docs += shard
    write_manifest(directory, TOK, {"kind": "test"})
    return docs


@pytest.fixture
def sources(tmp_path):
    """Three sources of different sizes and document lengths."""
    make_source(tmp_path / "a", (40, 25), 30, seed=1)
    make_source(tmp_path / "b", (10,), 200, seed=2)
    make_source(tmp_path / "c", (100, 0, 50), 8, seed=3)  # an empty shard, very short documents
    return [SourceSpec("a", tmp_path / "a", weight=0.5, max_epochs=1000),
            SourceSpec("b", tmp_path / "b", weight=0.3, max_epochs=1000),
            SourceSpec("c", tmp_path / "c", weight=0.2, max_epochs=1000)]


def mixture(sources, **kw) -> Mixture:
    return Mixture(sources, **{"seq_len": 32, "seed": 7, "expected_fingerprint": FP, "expected_vocab_size": 4096, **kw})


def global_batches(mix, steps, global_batch, world_size, start=0) -> list[dict]:
    """Each step's global batch, assembled from every rank's local batch."""
    loaders = [MixtureLoader(mix, global_batch, r, world_size, next_index=start) for r in range(world_size)]
    return [{k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
            for parts in zip(*[[next(ld) for _ in range(steps)] for ld in loaders])]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_deterministic(sources):
    a = global_batches(mixture(sources), 5, 8, 1)
    assert_same(a, global_batches(mixture(sources), 5, 8, 1))
    other = global_batches(mixture(sources, seed=8), 5, 8, 1)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, other))


def test_world_size_independent(sources):
    mix = mixture(sources)
    one = global_batches(mix, 6, 8, 1)
    assert_same(one, global_batches(mix, 6, 8, 2))
    assert_same(one, global_batches(mix, 6, 8, 4))
    # each sample is the same whatever batch it is fetched in
    assert_same([mix.batch([13])], [{k: v[13:14] for k, v in mix.batch(np.arange(16)).items()}])


def test_resume_on_another_world_size(sources):
    mix = mixture(sources)
    reference = global_batches(mix, 10, 8, 1)
    loaders = [MixtureLoader(mix, 8, r, 2) for r in range(2)]
    for _ in range(4):
        for ld in loaders:
            next(ld)
    state = json.loads(json.dumps(loaders[0].state_dict()))  # survives a checkpoint round trip
    assert state == loaders[1].state_dict() and state["next_index"] == 32
    assert sum(state["consumed_tokens"].values()) == 32 * 32
    resumed = []
    for r in range(4):
        ld = MixtureLoader(mixture(sources), 8, r, 4)
        ld.load_state_dict(state)
        resumed.append([next(ld) for _ in range(6)])
    assert_same(reference[4:], [{k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
                                for parts in zip(*resumed)])
    with pytest.raises(MixtureError, match="seq_len"):
        MixtureLoader(mixture(sources, seq_len=16), 8).load_state_dict(state)


def test_shares_match_weights(sources):
    """Over any prefix of n samples, |realized share - weight| <= 1/period + 1/n per source."""
    mix = mixture(sources, period=1000)
    weights = np.array([0.5, 0.3, 0.2])
    for n in (10, 97, 1000, 12_345, 100_000):
        counts = mix.samples_per_source(n)
        assert counts.sum() == n
        assert np.all(np.abs(counts / n - weights) <= 1 / 1000 + 1 / n), (n, counts)
        src, _ = mix.locate(np.arange(n))
        assert np.array_equal(np.bincount(src, minlength=3), counts)
    # the source column of real batches follows the same schedule; tokens per sample are equal
    batch = mix.batch(np.arange(200))
    assert np.array_equal(np.bincount(batch["source"], minlength=3), mix.samples_per_source(200))
    assert mix.consumed_tokens(200) == {s.name: int(c) * 32 for s, c in zip(sources, mix.samples_per_source(200))}


def test_uneven_weights_need_no_large_period(sources):
    s = [SourceSpec(x.name, x.path, weight=w, max_epochs=1000) for x, w in zip(sources, (0.999, 0.0007, 0.0003))]
    counts = mixture(s).samples_per_source(1 << 20)
    assert np.all(np.abs(counts / (1 << 20) - [0.999, 0.0007, 0.0003]) <= 1 / (1 << 16))


def reference_stream(mix: Mixture, s: int, docs: list[list[int]], epochs: int):
    """The source's token stream rebuilt naively from its documents and epoch permutations."""
    tokens, starts = [], []
    for e in range(epochs):
        for d in mix.streams[s].epoch(e)[0]:
            tokens += docs[d]
            starts += [True] + [False] * (len(docs[d]) - 1)
    return np.array(tokens), np.array(starts)


def test_packing_and_positions_match_documents(tmp_path):
    docs = make_source(tmp_path / "a", (30, 20), 25, seed=4)
    mix = Mixture([SourceSpec("a", tmp_path / "a", weight=1, max_epochs=10)], seq_len=48, seed=3)
    tokens, starts = reference_stream(mix, 0, docs, 4)
    epochs = [sorted(mix.streams[0].epoch(e)[0].tolist()) for e in range(3)]
    assert epochs[0] == list(range(len(docs))) and mix.streams[0].epoch(0)[0].tolist() != epochs[0]
    assert not np.array_equal(mix.streams[0].epoch(0)[0], mix.streams[0].epoch(1)[0])
    n = 3 * len(tokens) // 4 // 48  # about three epochs: windows cross epoch boundaries
    batch = mix.batch(np.arange(n))
    for k in range(n):
        a = k * 48
        np.testing.assert_array_equal(batch["input_ids"][k], tokens[a : a + 48])
        np.testing.assert_array_equal(batch["labels"][k], tokens[a + 1 : a + 49])
        # positions: 0 at each document start and at the sample start, +1 otherwise
        pos = batch["positions"][k]
        new_segment = starts[a : a + 48].copy()
        new_segment[0] = True
        assert np.array_equal(pos == 0, new_segment)
        assert np.all(pos[1:][~new_segment[1:]] == pos[:-1][~new_segment[1:]] + 1)
        assert np.all(batch["input_ids"][k][starts[a : a + 48]] == 1)  # documents start with BOS
    # every token is a label exactly once: consecutive samples continue the stream
    np.testing.assert_array_equal(batch["labels"].reshape(-1), tokens[1 : 1 + n * 48])


def test_budgets_and_epochs(sources):
    a, b, c = (open_source(s.path).num_tokens for s in sources)
    budget = [SourceSpec("a", sources[0].path, tokens=a // 2), SourceSpec("b", sources[1].path, tokens=b // 4)]
    mix = mixture(budget)
    assert mix.total_samples == -(-(a // 2 + b // 4) // 32)
    assert [p.name for p in mix.plan] == ["a", "b"] and all(p.epochs < 1 for p in mix.plan)
    assert abs(mix.plan[0].planned_tokens - a // 2) <= 64
    # a budget next to weighted sources takes its share of the planned total
    mixed = [SourceSpec("a", sources[0].path, tokens=a // 2), SourceSpec("c", sources[2].path, weight=1.0, max_epochs=9)]
    with pytest.raises(MixtureError, match="need total_samples"):
        mixture(mixed)
    plan = mixture(mixed, total_samples=a // 16, period=4096).plan
    assert abs(plan[0].share - (a // 2) / (a // 16 * 32)) < 1 / 4096
    assert plan[1].epochs > 1  # c is small: more than one epoch planned
    with pytest.raises(MixtureError, match=rf"c \({sources[2].path}\): .* epochs > max_epochs=1\.0"):
        mixture([mixed[0], SourceSpec("c", sources[2].path, weight=1.0, max_epochs=1.0)], total_samples=a // 16)
    # without a plan, reading past max_epochs fails when it happens, naming the source
    lone = mixture([SourceSpec("b", sources[1].path, weight=1.0, max_epochs=1.0)])
    lone.batch(np.arange(b // 32 - 1))
    with pytest.raises(MixtureError, match=r"'b' .* exhausted"):
        lone.batch([b // 32 + 1])


@pytest.mark.parametrize("weights, message", [
    ((0.5, -0.1, 0.6), "weight must be finite and >= 0"),
    ((0.0, 0.0, 0.0), "weights sum to zero"),
])
def test_bad_weights(sources, weights, message):
    with pytest.raises(MixtureError, match=message):
        mixture([SourceSpec(s.name, s.path, weight=w) for s, w in zip(sources, weights)])


def corrupt(path: Path, case: str) -> str:
    """Damage a source; returns the file the error must name."""
    ds = path / "00000_unshuffled.ds"
    if case == "missing shard":
        ds.unlink()
    elif case == "truncated shard":
        ds.write_bytes(ds.read_bytes()[:-2])
    elif case == "corrupt index":
        idx = np.fromfile(f"{ds}.index", dtype="<u8")
        idx[[3, 4]] = idx[[4, 3]]
        idx.tofile(f"{ds}.index")
        return f"{ds}.index"
    elif case == "odd index size":
        with open(f"{ds}.index", "ab") as f:
            f.write(b"\0\0\0")
        return f"{ds}.index"
    elif case == "missing manifest":
        (path / "manifest.json").unlink()
        return str(path / "manifest.json")
    elif case == "unframed":
        tokens = np.fromfile(ds, dtype="<u2")
        tokens[0] = 5
        tokens.tofile(ds)
    return str(ds)


@pytest.mark.parametrize("case, message", [
    ("missing shard", "missing shard file"),
    ("truncated shard", "truncated shard"),
    ("corrupt index", "corrupt index"),
    ("odd index size", "corrupt index"),
    ("missing manifest", "manifest not found"),
    ("unframed", "not framed"),
])
def test_damaged_source_names_the_file(sources, case, message):
    named = corrupt(Path(sources[1].path), case)
    with pytest.raises(ShardError) as e:
        mixture(sources)
    assert message in str(e.value) and named in str(e.value)


def test_incompatible_or_empty_source(sources, tmp_path):
    with pytest.raises(ShardError, match=rf"{sources[0].path}/manifest.json: shards were made with tokenizer"):
        mixture(sources, expected_fingerprint="0" * 64)
    with pytest.raises(ShardError, match=rf"{sources[0].path}/manifest.json: vocab_size 4096 != expected 32000"):
        mixture(sources, expected_vocab_size=32000)
    (tmp_path / "empty").mkdir()
    write_shard(tmp_path / "empty" / "00000_unshuffled.ds", [])
    write_manifest(tmp_path / "empty", TOK, {"kind": "test"})
    with pytest.raises(ShardError, match=rf"empty source {tmp_path / 'empty'}"):
        mixture(sources + [SourceSpec("empty", tmp_path / "empty", weight=1)])


def test_bundled_sample_data():
    tok = load_tokenizer()
    specs = [SourceSpec("prose", SAMPLE_DATA / "prose", weight=0.4, max_epochs=100),
             SourceSpec("code", SAMPLE_DATA / "code", weight=0.6, max_epochs=100)]
    mix = Mixture(specs, seq_len=256, seed=0, expected_fingerprint=tok.fingerprint,
                  expected_vocab_size=tok.vocab_size, total_samples=2000)
    assert [round(p.share, 4) for p in mix.plan] == [0.4, 0.6]
    size = sum(p.stat().st_size for p in SAMPLE_DATA.rglob("*") if p.is_file())
    assert size < 3_000_000
    batch = mix.batch(np.arange(64))
    # BOS only ever appears at a document start, so positions restart exactly there
    pos, ids = batch["positions"], batch["input_ids"]
    assert np.array_equal((pos == 0)[:, 1:], (ids == tok.bos_id)[:, 1:])
    assert ids.max() < tok.vocab_size
    text = tok.decode(ids[0])
    assert text.strip()
