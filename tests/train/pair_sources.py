"""Pair sources for the preference tests, written with data.shards as data.tokenize --pairs lays them out:
documents 2p (chosen) and 2p + 1 (rejected) adjacent in one shard, the loss mask on the answers only.
The rule a model learns in a few steps, held-out pairs too: the rejected answer is always the same
refusal (as the bundled pairs' are, data.make_sample_pairs), the chosen one copies the prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.chat import resolve_template, template_sha256
from data.pairs import MANIFEST_KEY
from data.shards import write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, Tokenizer


def write_pair_source(directory: Path, pairs: int, seed: int = 0, shards: int = 2) -> Path:
    tok, (name, jinja) = Tokenizer(), resolve_template("llama2")  # the template the manifest records
    rng = np.random.default_rng(seed)
    refusal = np.random.default_rng(99).integers(3, tok.vocab_size, 8).tolist()  # one for every source
    docs, masks = [], []
    for _ in range(pairs):
        n = int(rng.integers(3, 9))
        prompt = rng.integers(3, tok.vocab_size, n).tolist()
        for answer in (prompt, refusal[:n]):
            docs.append([tok.bos_id, *prompt, *answer, tok.eos_id])
            masks.append([0] * (1 + n) + [1] * (n + 1))
    directory.mkdir(parents=True)
    cut = 2 * (pairs // shards)  # whole pairs per shard
    for k, (a, b) in enumerate([(0, cut), (cut, 2 * pairs)] if shards == 2 else [(0, 2 * pairs)]):
        write_shard(directory / f"{k:05d}_unshuffled.ds", docs[a:b], loss=masks[a:b])
    write_manifest(directory, {"path": str(TINY_TOKENIZER), "fingerprint": tok.fingerprint,
                               "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
                   {"kind": "test"}, extra={MANIFEST_KEY: {"pairs": pairs, "template": name,
                                                           "template_sha256": template_sha256(jinja)}})
    return directory
