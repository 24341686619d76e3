"""data.verify: every shard byte checked against the manifest's checksums; a changed,
truncated or unrecorded file is named, with exit status 2; the bundled sample data carry checksums."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from data.shards import load_manifest, write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, Tokenizer
from data.verify import main as verify


@pytest.fixture
def source(tmp_path):
    tok = Tokenizer()
    rng = np.random.default_rng(0)
    directory = tmp_path / "src"
    directory.mkdir()
    for n in range(2):
        docs = [[tok.bos_id, *rng.integers(3, tok.vocab_size, 50).tolist(), tok.eos_id] for _ in range(5)]
        write_shard(directory / f"{n:05d}_unshuffled.ds", docs)
    write_manifest(directory, {"path": str(TINY_TOKENIZER), "fingerprint": tok.fingerprint,
                               "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
                   {"kind": "test"})
    return directory


def test_the_manifest_records_blake2b_of_each_shard_and_index(source):
    for entry in load_manifest(source)["shards"]:
        for key, suffix in (("blake2b", ""), ("index_blake2b", ".index")):
            data = (source / f"{entry['file']}{suffix}").read_bytes()
            assert entry[key] == hashlib.blake2b(data, digest_size=16).hexdigest()


def test_intact_sources_pass(source, capsys):
    assert verify([str(source)]) == 0
    assert f"ok {source}: 2 shards, 520 tokens" in capsys.readouterr().out


def test_a_changed_token_is_named(source, capsys):
    path = source / "00001_unshuffled.ds"
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01  # same size, framing intact: only the checksum can tell
    path.write_bytes(bytes(data))
    assert verify([str(source)]) == 2
    assert f"checksum mismatch {path}: blake2b" in capsys.readouterr().err


def test_a_changed_index_is_named(source, capsys):
    path = source / "00001_unshuffled.ds.index"
    data = bytearray(path.read_bytes())
    data[8] ^= 0x01  # the first document now ends one token later
    path.write_bytes(bytes(data))
    assert verify([str(source)]) == 2
    assert str(source / "00001_unshuffled.ds") in capsys.readouterr().err


def test_a_truncated_shard_is_named(source, capsys):
    path = source / "00000_unshuffled.ds"
    path.write_bytes(path.read_bytes()[:-2])
    assert verify([str(source)]) == 2
    assert f"truncated shard {path}" in capsys.readouterr().err


def test_a_manifest_without_checksums_cannot_be_verified(source, capsys):
    manifest = load_manifest(source)
    for entry in manifest["shards"]:
        del entry["blake2b"]
    (source / "manifest.json").write_text(json.dumps(manifest))
    assert verify([str(source)]) == 2
    assert "no checksum for 00000_unshuffled.ds" in capsys.readouterr().err
