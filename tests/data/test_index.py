"""data.index: the mixture's per-source index is built once, memory-mapped, checked against the
manifest, and gives the same samples as a fresh build."""

from __future__ import annotations

import numpy as np

from data.index import CACHE_ENV, SourceIndex, index_dir
from data.mixture import Mixture, SourceSpec
from data.shards import open_source
from tests.data.test_mixture import FP, make_source


def mixture(specs):
    return Mixture(specs, seq_len=32, seed=7, expected_fingerprint=FP, expected_vocab_size=4096)


def batches(mix, n=40):
    return [mix.batch(np.arange(i, i + 8)) for i in range(0, 8 * n, 8)]


def test_the_index_is_written_once_beside_the_shards_and_mapped(tmp_path):
    docs = make_source(tmp_path / "a", (40, 25), 30, seed=1)
    spec = SourceSpec("a", tmp_path / "a", weight=1.0, max_epochs=1000)
    first = mixture([spec])
    out = batches(first)  # reads several epochs of a 65-document source
    stream = first.streams[0]
    folder = stream.index.folder
    assert folder.parent == tmp_path / "a" / ".index"
    assert isinstance(stream.lens, np.memmap) and isinstance(stream.epoch(1)[0], np.memmap)
    assert stream.lens.tolist() == [len(d) for d in docs]  # lengths against the documents themselves
    perm, starts = stream.epoch(2)
    assert sorted(perm.tolist()) == list(range(len(docs)))
    assert starts[-1] == sum(len(d) for d in docs)
    files = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.npy")}
    assert "lens.npy" in files and sum(n.startswith("perm-") for n in files) >= 4
    second = mixture([spec])  # another rank or restart: maps, does not rebuild
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(out, batches(second)) for k in x)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.npy")} == files


def test_a_read_only_source_uses_the_node_cache_and_gives_the_same_samples(tmp_path, monkeypatch):
    make_source(tmp_path / "a", (64,), 20, seed=2)  # a multiple of the index's checkpoint stride
    spec = SourceSpec("a", tmp_path / "a", weight=1.0, max_epochs=1000)
    reference = batches(mixture([spec]), 20)
    beside = tmp_path / "a" / ".index"
    for p in sorted(beside.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    beside.rmdir()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    beside.write_text("")  # the shards' folder cannot take an index (read-only storage; as root, a file is in the way)
    mix = mixture([spec])
    assert mix.streams[0].index.folder.parent == tmp_path / "cache"
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(reference, batches(mix, 20)) for k in x)


def test_a_stale_or_torn_index_file_is_never_read(tmp_path):
    make_source(tmp_path / "a", (30,), 20, seed=3)
    source = open_source(tmp_path / "a")
    index = SourceIndex(source)
    lens = index.folder / "lens.npy"
    good = np.load(lens).tolist()
    lens.write_bytes(lens.read_bytes()[:-8])  # torn: one entry short
    assert SourceIndex(source).lens.tolist() == good  # rebuilt, not read
    # shards re-tokenized: the manifest changes, so does the key, and the old folder is not used
    (tmp_path / "a" / "manifest.json").write_text((tmp_path / "a" / "manifest.json").read_text() + " ")
    assert index_dir(open_source(tmp_path / "a")) != index.folder
