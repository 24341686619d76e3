"""Passkey retrieval: greedy answers to held-out passkey documents (data.make_passkey), scored exactly.

    python -m eval.passkey CHECKPOINT [--data assets/passkey/held_out] [--set max_seq_len=512] [--limit N]
    python -m eval.passkey CHECKPOINT --length 2048 --set max_seq_len=2048 [--limit N]

Each document of the tokenized folder is split by ``data.make_passkey.split_prompt`` into the
prompt (BOS to the question's ``▁``) and the key's digits; the model decodes as many tokens
greedily (``models.laneformer.generate``: the KV-cache decoder, every lane in this process),
and a document counts as answered when all of them equal the key. Chance is 1 in 10 (a key of
one digit, uniform: data.make_passkey.KEY_DIGITS). Prints the accuracy, the share of digits right (the
accuracy itself for one-digit keys), the accuracy by the key's position in the document (in 128-token
buckets) and the documents' length; ``--json`` writes it. Bad input (a folder of other documents or
another tokenizer's, a missing checkpoint) is refused with exit 2 before the weights load.
``CHECKPOINT`` is a run dir, a DCP step dir or an HF export (``open_checkpoint``); ``--set``
overrides its model config, e.g. ``max_seq_len=512`` for a model trained shorter (its RoPE tables
are sized by it; nothing else changes). ``--length N`` scores ``--limit`` (default 64) documents of N
tokens drawn afresh by ``data.make_passkey.probe_documents`` in place of a folder: where retrieval
breaks past the lengths a bundle holds (the tiny tokenizer's documents, so the checkpoint's must be it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from data.make_passkey import HELD_OUT_DOCUMENTS, probe_documents, split_prompt
from data.shards import open_source
from data.tokenizer import TINY_TOKENIZER, fingerprint
from models.laneformer.checkpoint import open_checkpoint, parse_overrides
from models.laneformer.generate import LaneDecoder, greedy
from rundir import REPO

DEFAULT_DATA = REPO / "assets" / "passkey" / "held_out"
BUCKET = 128  # tokens: the accuracy by where the key is


class Document(NamedTuple):
    """A passkey document as ``split_prompt`` reads it, and its length in tokens."""

    prompt: list[int]
    answer: list[int]
    length: int


def documents(folder: str | Path, tokenizer, vocab_size: int) -> list[Document]:
    """Every document of a tokenized folder (its ``held_out/`` if it has one, as eval.run's --held-out
    reads a split source), in shard order, each read by ``split_prompt``. Raises ValueError naming
    --data and the document: a folder tokenized with another tokenizer, or one that is not a passkey
    document."""
    folder = Path(folder)
    if (folder / "held_out" / "manifest.json").is_file():
        folder = folder / "held_out"
    try:
        source = open_source(folder, getattr(tokenizer, "fingerprint", None), vocab_size)
    except ValueError as e:
        raise ValueError(f"--data {folder}: {e}") from None
    docs = []
    for i, ids in enumerate(shard.document(j) for shard in source.shards for j in range(shard.num_documents)):
        try:
            docs.append(Document(*split_prompt(ids, tokenizer), len(ids)))
        except ValueError as e:
            raise ValueError(f"--data {folder}: document {i}: {e}") from None
    return docs


def key_position(prompt: list[int], tokenizer) -> int:
    """Where the needle's key starts: the prompt's first digit (the filler has none); -1 if none."""
    digits = {tokenizer.encode(f"0{d}")[-1] for d in range(10)}
    return next((i for i, t in enumerate(prompt) if t in digits), -1)


def evaluate(decoder: LaneDecoder, tokenizer, docs: list[Document]) -> dict:
    """Accuracy (every digit of the key) and digit accuracy of greedy answers, with each document's result."""
    results = []
    for prompt, answer, length in docs:
        got = greedy(decoder, prompt, len(answer)).ids  # no EOS stop: an early EOS is a wrong digit
        results.append({"key": tokenizer.decode(answer), "answer": got, "expected": answer,
                        "correct": got == answer, "digits": sum(a == b for a, b in zip(got, answer)),
                        "key_position": key_position(prompt, tokenizer), "length": length})
    n = len(results)
    by_position: dict[str, list[int]] = {}
    for r in results:
        lo = r["key_position"] // BUCKET * BUCKET
        by_position.setdefault(f"{lo}-{lo + BUCKET}", []).append(r["correct"])
    return {"documents": n, "accuracy": sum(r["correct"] for r in results) / n,
            "digit_accuracy": sum(r["digits"] for r in results) / sum(len(r["expected"]) for r in results),
            "by_key_position": {k: {"documents": len(v), "accuracy": sum(v) / len(v)}
                                for k, v in sorted(by_position.items(), key=lambda kv: int(kv[0].split("-")[0]))},
            "lengths": sorted({r["length"] for r in results}), "results": results}


def run(args: argparse.Namespace) -> dict:
    """The checkpoint's config and own tokenizer, the documents read and checked, then the weights and
    the answers: bad input is said before the weights load."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit: must be >= 1 (got {args.limit})")
    checkpoint = open_checkpoint(args.checkpoint)
    config = checkpoint.model_config(overrides=parse_overrides(args.set))
    tokenizer, notes = checkpoint.open_tokenizer(None, config.vocab_size)
    for note in notes:
        print(note, file=sys.stderr)
    if args.length is not None:
        flag = f"--length {args.length}"
        if getattr(tokenizer, "fingerprint", None) != fingerprint(TINY_TOKENIZER):
            raise ValueError(f"{flag}: the documents are made with the bundled tiny tokenizer ({TINY_TOKENIZER}) and "
                             f"{args.checkpoint} uses another: pass --data with passkey documents of its own tokenizer")
        try:
            made = probe_documents(tokenizer, args.length, args.limit or HELD_OUT_DOCUMENTS)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        docs = [Document(*split_prompt(ids, tokenizer), len(ids)) for ids in made]
    else:
        docs = documents(args.data, tokenizer, config.vocab_size)[: args.limit]
        flag = f"--data {args.data}"
    if not docs:
        raise ValueError(f"{flag}: no documents")
    longest = max(d.length for d in docs)
    if longest > config.max_seq_len:
        raise ValueError(f"{flag}: documents of {longest} tokens exceed model.max_seq_len="
                         f"{config.max_seq_len}; pass --set max_seq_len={longest}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decoder = LaneDecoder(config, checkpoint.load_weights(config), range(config.n_lanes), device)
    return evaluate(decoder, tokenizer, docs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.passkey", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run dir, a DCP step dir or an HF export")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", type=Path, default=DEFAULT_DATA, help="tokenized passkey documents (a folder with "
                        "a held_out/ split: that)")
    source.add_argument("--length", type=int, default=None, metavar="N", help="in place of --data: --limit (default "
                        f"{HELD_OUT_DOCUMENTS}) documents of N tokens made afresh (data.make_passkey.probe_documents)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="model config override")
    p.add_argument("--limit", type=int, default=None, help="the first N documents only")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    a = p.parse_args(argv)
    try:
        out = run(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"passkey: {e}", file=sys.stderr)
        return 2
    on = f"{out['documents']} documents made for --length {a.length}" if a.length is not None else a.data
    print(f"passkey {a.checkpoint} on {on}: accuracy {out['accuracy']:.3f} "
          f"({sum(r['correct'] for r in out['results'])}/{out['documents']}), digits {out['digit_accuracy']:.3f}, "
          f"length {','.join(map(str, out['lengths']))}")
    for bucket, v in out["by_key_position"].items():
        print(f"  key at {bucket}: {v['accuracy']:.3f} of {v['documents']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
