"""Train the tiny Llama-2-style SentencePiece tokenizer shipped in assets/tokenizer.

Real runs use the Llama-2 tokenizer (32,000 pieces), which cannot be downloaded
where tests run. This trains a small model with the same *kind* of settings
(BPE, byte fallback, unk=0 bos=1 eos=2, no pad, split digits, whitespace-only
pieces, identity normalization, dummy prefix, extra whitespace kept), so every
code path (byte fallback, leading spaces, control ids, uint16 shards) is the
one the real tokenizer takes. Training text comes from data.sample_corpus.

    python -m data.train_tiny_tokenizer --out assets/tokenizer

writes tokenizer.model plus the Hugging Face files (data.hf_tokenizer). The
result is byte-identical on the same OS image and Python version; elsewhere it
differs, and its fingerprint with it (shards record the fingerprint).
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import sentencepiece as spm

from data.hf_tokenizer import save_hf_tokenizer
from data.sample_corpus import code_documents, prose_documents
from data.tokenizer import fingerprint

# Llama-2's trainer_spec / normalizer_spec, except size and thread/sampling knobs.
LLAMA2_STYLE = dict(
    model_type="bpe",
    character_coverage=0.99995,
    split_by_unicode_script=True,
    split_by_number=True,
    split_by_whitespace=True,
    split_digits=True,
    treat_whitespace_as_suffix=False,
    allow_whitespace_only_pieces=True,
    byte_fallback=True,
    vocabulary_output_piece_score=True,
    hard_vocab_limit=True,
    max_sentencepiece_length=16,
    max_sentence_length=4192,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    unk_surface=" \u2047 ",
    normalization_rule_name="identity",
    add_dummy_prefix=True,
    remove_extra_whitespaces=False,
)


def training_lines(code_bytes: int) -> list[str]:
    """Non-empty lines of the prose and code corpora (SentencePiece trains on lines)."""
    lines = []
    for _, text in prose_documents() + code_documents(code_bytes):
        lines += [line for line in text.splitlines() if line.strip()]
    return lines


def train(out_dir: Path, vocab_size: int = 4096, code_bytes: int = 6_000_000) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines(code_bytes)),
        model_writer=model,
        vocab_size=vocab_size,
        input_sentence_size=0,  # use every line: no sampling, so reruns are identical
        shuffle_input_sentence=False,
        num_threads=2,
        minloglevel=2,
        **LLAMA2_STYLE,
    )
    model_path = out_dir / "tokenizer.model"
    model_path.write_bytes(model.getvalue())
    save_hf_tokenizer(model_path, out_dir)
    return model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--code-bytes", type=int, default=6_000_000, help="stdlib code to train on")
    args = parser.parse_args()
    path = train(args.out, args.vocab_size, args.code_bytes)
    print(f"wrote {path} (sha256 {fingerprint(path)}) and Hugging Face files in {args.out}")


if __name__ == "__main__":
    main()
