"""Build the bundled long-context data for recipes/tiny-long.toml: assets/passkey/ and assets/long/.

    python -m data.make_passkey [--out assets]

``passkey/``: a synthetic retrieval task, the shape of Mohtashami & Jaggi's passkey (arXiv
2305.16300): filler, the needle ``The pass key is 7. Remember it. 7 is the pass key.`` at a
uniform random depth, more filler, then the question ``What is the pass key? The pass key is 7.``.
The rule is shaped for a model as small as the tiny one to learn in a few CPU minutes (the README's
"Long context" tells the probes behind it):

- the answer is introduced by the same words as the key (``The pass key is``), so an induction
  circuit (a previous-token head in a window layer, a matching head in a full layer) answers it;
- the key is one digit, uniform over 0-9 (chance: 1 in 10; keys repeat across documents): the tiny
  tokenizer splits digits, so the answer is one token, and the filler has none, so a digit after
  ``▁`` occurs only at the key;
- the filler is words drawn at random from the bundled prose (digits removed), not a repeated
  passage: nothing in it can be predicted from far back, so no far-back copy competes with the key;
- training documents are ``MIN_LEN`` to ``SEQ_LEN`` (64-512) tokens long, uniformly: data.mixture
  packs several into a 512-token sample with document masking (positions restart at each), so
  retrieval is learned at short distances too, and carries to 512; the held-out documents are
  exactly ``SEQ_LEN`` tokens, 4x the tiny base's 128, what eval.passkey scores;
- the loss is on the answer alone: every shard carries a loss mask (``.ds.loss``, as chat sources
  do; the manifest's ``loss_mask``) that is 1 only on the final answer's digit, so the few answer
  tokens are not drowned by the filler's loss.

``held_out/`` is the usual hashed choice (data.held_out) at ``PASSKEY_HELD_OUT``
(recipes/tiny-long.toml gives the source that ``held_out``): the documents are generated on the side
of that rule they are meant for (a ``SEQ_LEN`` document until its hash holds it out, a training
document until its hash keeps it in), so exactly ``HELD_OUT_DOCUMENTS`` are held out. ``split_prompt``
is the rule the evaluator (eval/passkey.py) reads a document with: prompt up to the question's
``▁``, answer the key's digit.

``long/``: long documents the base never saw: CPython standard-library modules past the
ones in assets/sample_data/code, modules and packages of at most ``MAX_REPO_BYTES``, one
document per module or package (``concat_by = "repo"``, its files in path order, as
ProLong concatenates code repositories), at least ``SEQ_LEN`` tokens (``min_doc_tokens``),
``LONG_HELD_OUT`` of them held out: the held-out long documents that loss by position is
measured on.

Both are tokenized with the tiny tokenizer through data.tokenize (as assets/sample_data; the
passkey masks written beside its shards, then its manifest rebuilt from them and split by
``--manifest-only``'s path), and are byte-identical when regenerated on the same OS image and
Python version (the filler is decoded from the bundled prose shards, the code read from the running
interpreter's standard library). No raw jsonl is kept: it is bigger than the shards.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from data import tokenize
from data.held_out import document_key, threshold
from data.make_sample_data import CODE_BYTES, MAX_FILE_BYTES, tokenize_into_assets, write_jsonl
from data.sample_corpus import code_documents
from data.shards import open_source
from data.tokenizer import TINY_TOKENIZER, Tokenizer

SEQ_LEN = 512  # tokens of a held-out passkey document and of the longest training one, BOS and EOS included:
# recipes/tiny-long.toml's seq_len
MIN_LEN = 64  # tokens of the shortest training document
KEY_DIGITS = 1
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
TRAIN_DOCUMENTS = 2000  # about 580,000 tokens: 3 bytes each on disk (2 of token id, 1 of loss mask)
HELD_OUT_DOCUMENTS = 64  # eval.passkey's documents
MAX_WORD_TOKENS = 3  # the filler's words: of at most this many tokens
PASSKEY_HELD_OUT = 0.2  # data.held_out's fraction: a held-out document is generated 5 times on average
PROSE = Path("assets/sample_data/prose")  # its training shards give the filler text
MAX_REPO_BYTES = 16_000  # a module or package of more text is skipped (keeps the bundle small, documents many)
LONG_BYTES = 450_000  # text of the long source, in all
LONG_HELD_OUT = 0.2
SEED = 44
PROBE_SEED = 4544  # probe_documents': not SEED, so not the bundle's draws


def vocabulary(tok: Tokenizer, prose: Path = PROSE) -> tuple[list[str], list[int]]:
    """The filler's words and their token counts: the distinct words of the prose source's training
    documents, decoded, without digits, of at most ``MAX_WORD_TOKENS`` tokens, sorted; no word that
    could be read as the marker (``pass``, ``key``) or as a tokenizer control string."""
    words = set()
    for shard in open_source(prose).shards:
        for i in range(shard.num_documents):
            for w in tok.decode(shard.document(i)).split():
                w = re.sub(r"[0-9]", "", w)
                if w and not re.search(r"pass|key|<|>", w, re.IGNORECASE):
                    words.add(w)
    vocab = [w for w in sorted(words) if len(tok.encode(w)) <= MAX_WORD_TOKENS]
    return vocab, [len(tok.encode(w)) for w in vocab]  # words join with one space: a text's ids are its words'


def document(tok: Tokenizer, vocab: list[str], counts: list[int], key: str, depth: float, length: int,
             rng: random.Random) -> str:
    """One passkey document of exactly ``length`` tokens framed: words drawn at random from ``vocab``
    (a word that would overrun is drawn again, so the last ones are one-token words and the filler lands
    exactly), the needle after ``depth`` of the filler's tokens, the question last."""
    needle, question = NEEDLE.format(key=key), f"{QUESTION} {key}."
    room = length - 2 - len(tok.encode(needle)) - len(tok.encode(question))
    filler, used = [], 0
    while used < room:
        word = rng.randrange(len(vocab))
        if used + counts[word] <= room:
            filler.append(word)
            used += counts[word]
    cut, seen = 0, 0  # the needle goes after the first `cut` words: `depth` of the filler's tokens before it
    while cut < len(filler) and seen + counts[filler[cut]] <= depth * room:
        seen += counts[filler[cut]]
        cut += 1
    text = " ".join([vocab[j] for j in filler[:cut]] + [needle] + [vocab[j] for j in filler[cut:]] + [question])
    assert len(tok.encode_document(text)) == length, (key, length, len(tok.encode_document(text)))
    return text


def draw(tok: Tokenizer, vocab: list[str], counts: list[int], length: int, rng: random.Random) -> tuple[str, float, str]:
    """``(key, depth, text)`` of one passkey document of ``length`` tokens: a uniform key and depth, then
    ``document``; the one rule both the bundle and probe_documents draw by."""
    key, depth = "".join(rng.choices("0123456789", k=KEY_DIGITS)), rng.random()
    return key, depth, document(tok, vocab, counts, key, depth, length, rng)


def passkey_documents(tok: Tokenizer, prose: Path = PROSE, train: int = TRAIN_DOCUMENTS,
                      held_out: int = HELD_OUT_DOCUMENTS, seed: int = SEED) -> list[dict]:
    """``{"id", "text", "key", "depth", "length", "held_out"}`` of every passkey document, in a fixed order:
    ``train`` documents of ``MIN_LEN`` to ``SEQ_LEN`` tokens that data.held_out's rule at
    ``PASSKEY_HELD_OUT`` keeps in training, then ``held_out`` documents of ``SEQ_LEN`` tokens that it
    holds out (each drawn again until the rule puts it on its side)."""
    vocab, counts = vocabulary(tok, prose)
    below = threshold(PASSKEY_HELD_OUT, [])
    rng = random.Random(seed)
    out: list[dict] = []
    for held, n in ((False, train), (True, held_out)):
        for _ in range(n):
            while True:
                length = SEQ_LEN if held else rng.randint(MIN_LEN, SEQ_LEN)
                key, depth, text = draw(tok, vocab, counts, length, rng)
                if (document_key(np.asarray(tok.encode_document(text))) < below) == held:
                    break
            out.append({"id": f"passkey/{len(out)}", "text": text, "key": key, "depth": round(depth, 4),
                        "length": length, "held_out": held})
    return out


def probe_documents(tok: Tokenizer, length: int, n: int, seed: int = PROBE_SEED, prose: Path = PROSE) -> list[list[int]]:
    """``n`` tokenized passkey documents of exactly ``length`` tokens, key and depth drawn as the bundled
    ones are (``eval.passkey --length``): retrieval measured at lengths no bundle holds, e.g. past a
    model's own. A fresh draw of ``seed``, not data.held_out's split: past ``SEQ_LEN`` no training
    document is that long; at or below it, a document of random filler words repeating one of
    training is as likely as a repeated draw of hundreds of words."""
    if length < MIN_LEN:
        raise ValueError(f"a passkey document is at least {MIN_LEN} tokens (got {length})")
    vocab, counts = vocabulary(tok, prose)
    rng = random.Random(seed)
    return [tok.encode_document(draw(tok, vocab, counts, length, rng)[2]) for _ in range(n)]


def split_prompt(ids, tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(prompt, answer) of a tokenized passkey document (BOS ... EOS): the prompt ends with the
    question's ``▁`` before the key, the answer is the key's ``KEY_DIGITS`` digit tokens.
    Raises ValueError for ids that are not a passkey document."""
    ids = [int(i) for i in ids]
    question = tok.encode(f"{QUESTION} 0")[:-1]  # ... "▁is", "▁": a digit follows
    tail = tok.encode("0.")[-1:]  # "."
    end = len(ids) - 1 - len(tail)  # the answer ends before "." and EOS
    start = end - KEY_DIGITS
    if ids[-1] != tok.eos_id or ids[end:-1] != tail or ids[start - len(question):start] != question:
        raise ValueError("not a passkey document: it does not end with the question and a key")
    answer = ids[start:end]
    if not tok.decode(answer).isdigit():
        raise ValueError(f"not a passkey document: the answer {tok.decode(answer)!r} is not {KEY_DIGITS} digit(s)")
    return ids[:start], answer


def answer_mask(ids, tok: Tokenizer) -> np.ndarray:
    """A passkey document's loss mask: 1 on its answer's digits (``split_prompt``), 0 elsewhere."""
    prompt, answer = split_prompt(ids, tok)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt):len(prompt) + len(answer)] = 1
    return mask


def write_answer_masks(folder: Path, tok: Tokenizer) -> None:
    """Every shard's ``.ds.loss`` beside it (datatrove's loss file, one byte per token, as
    data.chat_tokenize writes it): the documents' ``answer_mask``."""
    for shard in open_source(folder).shards:
        masks = [answer_mask(shard.document(i), tok) for i in range(shard.num_documents)]
        np.concatenate(masks).tofile(f"{shard.path}.loss")


def long_documents(max_repo_bytes: int = MAX_REPO_BYTES, budget: int = LONG_BYTES) -> list[dict]:
    """``{"id", "text", "repo", "path"}`` rows: stdlib files past sample_data's, grouped by module or package
    (``repo``), whole repos of at most ``max_repo_bytes`` in sorted order until ``budget`` bytes of text."""
    sample = code_documents(CODE_BYTES, max_file_bytes=MAX_FILE_BYTES)  # sample_data's code source
    rest = code_documents(10 ** 10, max_file_bytes=MAX_FILE_BYTES)[len(sample):]
    repos: dict[str, list[tuple[str, str]]] = {}
    for doc_id, text in rest:
        parts = doc_id.split("/")[1:]  # "stdlib/json/decoder.py" -> json; "stdlib/glob.py" -> glob
        repos.setdefault(parts[0] if len(parts) > 1 else parts[0].removesuffix(".py"), []).append((doc_id, text))
    rows, total = [], 0
    for repo, files in repos.items():
        size = sum(len(t.encode()) for _, t in files)
        if size > max_repo_bytes:
            continue
        if total + size > budget:
            break
        total += size
        rows += [{"id": doc_id, "text": text, "repo": repo, "path": doc_id} for doc_id, text in files]
    return rows


def build(out: Path, prose: Path = PROSE) -> dict:
    tok = Tokenizer(TINY_TOKENIZER)
    docs = passkey_documents(tok, prose)
    long_rows = long_documents()
    manifests = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "passkey"
        write_jsonl(raw, [{"id": d["id"], "text": d["text"]} for d in docs], 1)
        dest = out / "passkey"
        shutil.rmtree(dest, ignore_errors=True)
        desc = {"kind": "passkey", "source": "passkey", "documents": len(docs), "seq_len": SEQ_LEN,
                "contents": f"filler: words drawn at random from {prose} (digits removed); the needle '{NEEDLE}' "
                            f"at a uniform random depth, then '{QUESTION} <key>.'; keys of {KEY_DIGITS} digit(s), "
                            f"uniform; training documents of {MIN_LEN}-{SEQ_LEN} tokens, held-out ones of {SEQ_LEN}; "
                            "loss mask: the answer's digits only",
                "regenerate": "python -m data.make_passkey"}
        tokenize.run(str(raw), dest, TINY_TOKENIZER, description=desc)  # the shards, then their masks beside them
        write_answer_masks(dest, tok)
        manifests["passkey"] = tokenize_into_assets(raw, dest, desc, manifest_only=True, held_out=PASSKEY_HELD_OUT)
        raw = Path(tmp) / "long"
        write_jsonl(raw, long_rows, 2)
        dest = out / "long"
        shutil.rmtree(dest, ignore_errors=True)
        desc = {"kind": "sample_corpus", "source": "long", "documents": len({r["repo"] for r in long_rows}),
                "contents": f"CPython standard library past sample_data's code: modules and packages of at most "
                            f"{MAX_REPO_BYTES:,} bytes, one document each (files in path order)",
                "regenerate": "python -m data.make_passkey"}
        manifests["long"] = tokenize_into_assets(raw, dest, desc, tasks=2, held_out=LONG_HELD_OUT,
                                                 min_doc_tokens=SEQ_LEN, concat_by="repo", concat_order="path")
    # every tokenized passkey document is one of ours, on the side of the split it was made for, of its length,
    # read back by split_prompt, its mask on its answer alone
    for folder, held in ((out / "passkey", False), (out / "passkey" / "held_out", True)):
        expected = {tuple(tok.encode_document(d["text"])) for d in docs if d["held_out"] == held}
        found = set()
        for shard in open_source(folder).shards:
            for i, end in enumerate(shard.doc_ends.astype(np.int64)):
                ids = tuple(int(t) for t in shard.document(i))
                assert ids in expected and (len(ids) == SEQ_LEN or not held), f"{folder}: document {i} is not as made"
                assert shard.loss is not None and (shard.loss[end - len(ids):end] == answer_mask(ids, tok)).all(), \
                    f"{folder}: document {i}: its loss mask is not on its answer alone"
                found.add(ids)
        assert found == expected, f"{folder}: {len(found)} of the {len(expected)} documents made for it"
    return manifests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("assets"))
    a = p.parse_args()
    for name, m in build(a.out).items():
        print(f"{a.out / name}: {m['num_documents']} documents, {m['num_tokens']:,} tokens; held out: "
              f"{m['held_out']['documents']} documents, {m['held_out']['tokens']:,} tokens")


if __name__ == "__main__":
    main()
