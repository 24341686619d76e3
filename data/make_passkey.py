"""Build the bundled long-context data for recipes/tiny-long.toml: assets/passkey/ and assets/long/.

    python -m data.make_passkey [--out assets]

``passkey/``: a synthetic retrieval task, the shape of Mohtashami & Jaggi's passkey (arXiv
2305.16300): every document is exactly ``SEQ_LEN`` (512) tokens with its framing, 4x the tiny
base's 128: filler, the needle ``The pass key is 48213. Remember it. 48213 is the pass key.`` at
a uniform random depth, more filler, then the question ``What is the pass key? The pass key is
48213.``. The rule is meant to be as easy as a copy can be:

- the answer is introduced by the same words as the key (``The pass key is``), so an induction
  circuit (a previous-token head in a window layer, a matching head in a full layer) answers it;
- the filler is a passage of ``PERIOD`` tokens of words of the bundled prose (digits removed),
  different in every document and repeated to fill it, so every filler token after the first
  pass is predicted by the same circuit one period back (further than the window layers' 32
  tokens: only the full layers can);
- the tiny tokenizer splits digits and the filler has none, so a digit after ``▁`` occurs only
  at the key; its 5 digits are all different (chance: 1 in 27,216, the first digit not 0);
- every document is exactly ``SEQ_LEN`` tokens, so each packed sample is one whole document.

Measured: the tiny model does not learn it in a few CPU minutes (README, "Long context": 0 of 64
held-out documents after tiny-long, 0 of 30 after 600 steps of this task alone).

Keys are unique across documents, so a held-out document's key is in no training
document. ``held_out/`` is the usual hashed choice (data.held_out) at ``PASSKEY_HELD_OUT``
(recipes/tiny-long.toml gives the source that ``held_out``); ``split_prompt`` is the rule
the evaluator (eval/passkey.py) reads a document with: prompt up to the question's
``▁``, answer the key's digits.

``long/``: long documents the base never saw: CPython standard-library modules past the
ones in assets/sample_data/code, modules and packages of at most ``MAX_REPO_BYTES``, one
document per module or package (``concat_by = "repo"``, its files in path order, as
ProLong concatenates code repositories), at least ``SEQ_LEN`` tokens (``min_doc_tokens``),
``LONG_HELD_OUT`` of them held out: the held-out long documents that loss by position is
measured on.

Both are tokenized with the tiny tokenizer through data.tokenize (as assets/sample_data),
and are byte-identical when regenerated on the same OS image and Python version (the
filler is decoded from the bundled prose shards, the code read from the running
interpreter's standard library). No raw jsonl is kept: it is bigger than the shards.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import tempfile
from pathlib import Path

from data.make_sample_data import CODE_BYTES, MAX_FILE_BYTES, tokenize_into_assets, write_jsonl
from data.sample_corpus import code_documents
from data.shards import open_source
from data.tokenizer import TINY_TOKENIZER, Tokenizer

SEQ_LEN = 512  # tokens per passkey document, BOS and EOS included: recipes/tiny-long.toml's seq_len
KEY_DIGITS = 5
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
PERIOD = (40, 160)  # tokens of the filler's passage, repeated: longer than the window layers' 32
DOCUMENTS = 300  # passkey documents in all (1 KB each on disk)
MAX_WORD_TOKENS = 3  # the filler's words: of at most this many tokens
PASSKEY_HELD_OUT = 0.2  # of the passkey documents (64 of 300), by data.held_out's hash
PROSE = Path("assets/sample_data/prose")  # its training shards give the filler text
MAX_REPO_BYTES = 16_000  # a module or package of more text is skipped (keeps the bundle small, documents many)
LONG_BYTES = 450_000  # text of the long source, in all
LONG_HELD_OUT = 0.2
SEED = 44


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


def keys(n: int, rng: random.Random) -> list[str]:
    """``n`` distinct keys of ``KEY_DIGITS`` distinct digits, not starting with 0."""
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        k = "".join(rng.sample("0123456789", KEY_DIGITS))
        if k[0] != "0" and k not in seen:
            seen.add(k)
            out.append(k)
    return out


def document(tok: Tokenizer, vocab: list[str], counts: list[int], key: str, depth: float, period: int,
             rng: random.Random) -> str:
    """One passkey document of exactly ``SEQ_LEN`` tokens framed: a passage of about ``period`` tokens
    of words drawn at random from ``vocab``, repeated (the last pass cut short, then one-token words
    drawn at random to land exactly), the needle after ``depth`` of the filler's tokens, the question
    last."""
    needle, question = NEEDLE.format(key=key), f"{QUESTION} {key}."
    room = SEQ_LEN - 2 - len(tok.encode(needle)) - len(tok.encode(question))
    passage, size = [], 0
    while size < period:
        passage.append(rng.randrange(len(vocab)))
        size += counts[passage[-1]]
    filler, used = [], 0
    while used + counts[passage[len(filler) % len(passage)]] <= room:  # the passage over and over
        filler.append(passage[len(filler) % len(passage)])
        used += counts[filler[-1]]
    ones = [j for j, c in enumerate(counts) if c == 1]
    while used < room:  # the rest: one-token words
        filler.append(rng.choice(ones))
        used += 1
    cut, seen = 0, 0  # the needle goes after the first `cut` words: `depth` of the filler's tokens before it
    while cut < len(filler) and seen + counts[filler[cut]] <= depth * room:
        seen += counts[filler[cut]]
        cut += 1
    text = " ".join([vocab[j] for j in filler[:cut]] + [needle] + [vocab[j] for j in filler[cut:]] + [question])
    assert len(tok.encode_document(text)) == SEQ_LEN, (key, len(tok.encode_document(text)))
    return text


def passkey_documents(tok: Tokenizer, prose: Path = PROSE, n: int = DOCUMENTS, seed: int = SEED) -> list[dict]:
    """``{"id", "text", "key", "depth", "period"}`` of every passkey document, in a fixed order."""
    vocab, counts = vocabulary(tok, prose)
    rng = random.Random(seed)
    out = []
    for i, key in enumerate(keys(n, rng)):
        depth, period = rng.random(), rng.randint(*PERIOD)
        out.append({"id": f"passkey/{i}", "text": document(tok, vocab, counts, key, depth, period, rng),
                    "key": key, "depth": round(depth, 4), "period": period})
    return out


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
        raise ValueError(f"not a passkey document: the answer {tok.decode(answer)!r} is not {KEY_DIGITS} digits")
    return ids[:start], answer


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
                "contents": f"filler: a passage of {PERIOD[0]}-{PERIOD[1]} tokens of words drawn at random from {prose} "
                            f"(digits removed), "
                            f"repeated; the needle '{NEEDLE}' at a uniform random depth, then '{QUESTION} <key>.'; "
                            f"keys of {KEY_DIGITS} distinct digits, unique",
                "regenerate": "python -m data.make_passkey"}
        manifests["passkey"] = tokenize_into_assets(raw, dest, desc, held_out=PASSKEY_HELD_OUT)
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
    # every tokenized passkey document is one of ours, exactly SEQ_LEN tokens, and reads back by split_prompt
    expected = {tuple(tok.encode_document(d["text"])) for d in docs}
    for folder in (out / "passkey", out / "passkey" / "held_out"):
        for shard in open_source(folder).shards:
            for i in range(shard.num_documents):
                ids = tuple(int(t) for t in shard.document(i))
                assert ids in expected and len(ids) == SEQ_LEN, f"{folder}: document {i} is not as generated"
                split_prompt(ids, tok)
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
