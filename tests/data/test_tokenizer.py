"""The shipped tiny tokenizer: SentencePiece and its tokenizer.json twin give identical ids."""

from __future__ import annotations

import hashlib
import random

import pytest
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer as FastTokenizer

from data.hf_tokenizer import PROBE_TEXTS as TRICKY
from data.hf_tokenizer import build_fast_tokenizer, document_post_processor
from data.sample_corpus import code_documents, prose_documents
from data.tokenizer import FRAMING, TINY_TOKENIZER, load_tokenizer
from tests.requires import require



def corpus(n_random: int = 250) -> list[str]:
    """A few hundred documents: tricky strings, real prose and code, random mixtures of both."""
    rng = random.Random(0)
    docs = list(TRICKY)
    docs += [t[:3000] for _, t in prose_documents()[:40]]
    docs += [t[:3000] for _, t in code_documents(800_000, max_file_bytes=40_000)[:60]]
    pieces = TRICKY + [w for t in docs[-20:] for w in t.split(" ")[:30]]
    for _ in range(n_random):
        docs.append(rng.choice(["", " ", "  "]) + "".join(rng.choice(pieces) + rng.choice([" ", "", "\n", "  "])
                                                          for _ in range(rng.randint(1, 25))))
    return docs


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def fast():
    return FastTokenizer.from_file(str(TINY_TOKENIZER.parent / "tokenizer.json"))


def test_llama2_style_settings(tok):
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(TINY_TOKENIZER.read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    assert spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (0, 1, 2, -1)
    assert spec.byte_fallback and spec.split_digits and spec.allow_whitespace_only_pieces
    assert norm.add_dummy_prefix and not norm.remove_extra_whitespaces and norm.name == "identity"
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.vocab_size) == (1, 2, 0, 4096)
    assert tok.fingerprint == hashlib.sha256(TINY_TOKENIZER.read_bytes()).hexdigest()
    assert FRAMING == "bos_eos"


def test_fast_tokenizer_matches_sentencepiece(tok, fast):
    docs = corpus()
    assert len(docs) >= 300
    expected = [tok.encode(d, bos=True) for d in docs]
    got = [e.ids for e in fast.encode_batch(docs)]
    bad = [(d, e, g) for d, e, g in zip(docs, expected, got) if e != g]
    assert not bad, f"{len(bad)} mismatches, first: {bad[0]}"
    # literal control strings stay text; only the BOS the post-processor adds is id 1
    for d, ids in zip(docs, got):
        assert ids.count(tok.bos_id) == 1 and tok.eos_id not in ids


def test_shipped_json_is_what_the_converter_builds(fast):
    assert build_fast_tokenizer(TINY_TOKENIZER).to_str() == fast.to_str()
    assert not fast.get_added_tokens_decoder()


def test_document_framing(tok, fast):
    framed = FastTokenizer.from_str(fast.to_str())
    framed.post_processor = document_post_processor()
    for d in TRICKY:
        assert framed.encode(d).ids == tok.encode_document(d) == [1] + tok.encode(d) + [2]


def test_decode_round_trip(tok, fast):
    for d in corpus(50):
        ids = tok.encode_document(d)
        assert fast.decode(ids[1:-1]) == tok.decode(ids)
        if "▁" not in d:  # SentencePiece decodes a literal U+2581 as a space, by design
            assert tok.decode(ids) == d


def test_transformers_loads_same_ids(tok):
    transformers = require("transformers", "the HF tokenizer the export ships is compared with")
    hf = transformers.AutoTokenizer.from_pretrained(str(TINY_TOKENIZER.parent))
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
    for d in TRICKY:
        assert hf(d).input_ids == tok.encode(d, bos=True), repr(d)


def test_training_script(tmp_path):
    from data.train_tiny_tokenizer import train

    path = train(tmp_path, vocab_size=600, code_bytes=200_000)
    small = load_tokenizer(tmp_path)
    assert path == small.path and small.vocab_size == 600 and small.bos_id == 1 and small.eos_id == 2
    fast = FastTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for d in TRICKY:
        assert fast.encode(d).ids == small.encode(d, bos=True), repr(d)
    assert {p.name for p in tmp_path.iterdir()} >= {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                                    "special_tokens_map.json"}
