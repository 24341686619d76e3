"""The project's tokenizer: a Llama-2-style SentencePiece model, and document framing.

Real runs use Llama-2's tokenizer.model (32,000 ids, unk 0, bos 1, eos 2, byte
fallback); tests and tiny recipes use assets/tokenizer/tokenizer.model, trained
the same way (data.train_tiny_tokenizer). SentencePiece is the reference: the
`tokenizers` JSON used for fast batch tokenization (data.hf_tokenizer) must give
the same ids, and tests check that it does.

Document framing (one decision, shared by shards, loader and inference):
every document is stored as ``<s> text </s>`` -- BOS first, EOS last.

- BOS first: Llama-2 inference, lm-eval and transformers all prepend BOS to a
  prompt (tokenizer.json's post-processor does too), so in training every
  document starts with the same context the model later sees. With
  document-masked attention BOS is also the one token every position of a
  document can attend to (a sink), instead of the first word of the text.
- EOS last: the model learns to end a document, which generation (HumanEval,
  MBPP, chat) needs to stop; EOS also marks boundaries for readers that do not
  use the index. This is TorchTitan's own text-dataset convention
  (add_bos=True, add_eos=True) too.
- Cost: two tokens per document.

The ``fingerprint`` (sha256 of the .model bytes) is written into each tokenized
source's manifest.json so the loader can refuse shards made with another tokenizer.

Getting the Llama-2 tokenizer, one command (checked against its sha256 before it
is put in place; the folder is git-ignored):

    python -m data.tokenizer fetch [--repo ID] [--out DIR]

The same ``tokenizer.model`` that Meta ships in the gated ``meta-llama/Llama-2-7b-hf``
(499,723 bytes, sha256 LLAMA2_SHA256) is published in non-gated repositories; the
default is one of them (ALTERNATIVES lists others). Real recipes name the hash in
``[data] tokenizer_sha256`` and the preflight refuses any other file (``check_sha256``).
"""

from __future__ import annotations

import hashlib
import os
from functools import cached_property
from pathlib import Path

import sentencepiece as spm

from rundir import REPO

TINY_TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.model"
LLAMA2_TOKENIZER = REPO / "assets" / "tokenizer" / "llama2" / "tokenizer.model"  # what the real recipes name
LLAMA2_HUB_ID = "meta-llama/Llama-2-7b-hf"  # gated: needs the Llama 2 licence accepted
LLAMA2_SHA256 = "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347"
LLAMA2_BYTES = 499_723
FETCH_REPO = "TinyLlama/TinyLlama_v1.1"  # non-gated, the same file (its LFS pointer: LLAMA2_SHA256)
ALTERNATIVES = ("NousResearch/Llama-2-7b-hf", "hf-internal-testing/llama-tokenizer", LLAMA2_HUB_ID)
FRAMING = "bos_eos"  # recorded in manifests; see the module docstring


def fingerprint(model_path: str | Path) -> str:
    """sha256 hex digest of the SentencePiece model file's bytes."""
    return hashlib.sha256(Path(model_path).read_bytes()).hexdigest()


def resolve_model_path(path: str | Path | None = None) -> Path:
    """A tokenizer.model path from a file, a directory holding one, or None (the tiny one)."""
    path = Path(path) if path is not None else TINY_TOKENIZER
    if path.is_dir():
        path = path / "tokenizer.model"
    if not path.is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {path}{how_to_get(path)}")
    return path


def how_to_get(path: str | Path) -> str:
    """For the Llama-2 tokenizer the recipes name: how to get it (else "")."""
    if Path(path).resolve() != LLAMA2_TOKENIZER.resolve():
        return ""
    return f"; get it with: python -m data.tokenizer fetch (from {FETCH_REPO}, sha256-checked)"


def check_sha256(path: str | Path, expected: str, shown: str | None = None) -> str | None:
    """None when the file's sha256 is ``expected``, else what was found (called ``shown``, default its
    path) against what was expected."""
    path = Path(path)
    found = fingerprint(path)
    if found == expected:
        return None
    llama2 = " (the Llama-2 tokenizer.model, 499,723 bytes)" if expected == LLAMA2_SHA256 else ""
    return (f"{shown or path} has sha256 {found} ({path.stat().st_size:,} bytes), expected {expected}{llama2}; "
            "it is another tokenizer: shards and model ids would not match")


def fetch(repo: str = FETCH_REPO, out: str | Path = LLAMA2_TOKENIZER.parent, revision: str | None = None,
          expected_sha256: str = LLAMA2_SHA256) -> Path:
    """Download ``tokenizer.model`` from ``repo`` into ``out``, put in place only if its sha256 is
    ``expected_sha256`` (a wrong file never replaces a right one). Returns its path."""
    import tempfile

    from huggingface_hub import hf_hub_download

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".fetch-") as tmp:
        got = Path(hf_hub_download(repo, "tokenizer.model", revision=revision, local_dir=tmp))
        if problem := check_sha256(got, expected_sha256, shown="the download"):
            raise ValueError(f"{repo}: tokenizer.model: {problem}; "
                             f"nothing written to {out}")
        target = out / "tokenizer.model"
        os.replace(got, target)
    return target


class Tokenizer:
    """SentencePiece tokenizer with the project's framing; the reference for all ids."""

    def __init__(self, model_path: str | Path | None = None):
        self.path = resolve_model_path(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.unk_id = self.sp.unk_id()
        self.vocab_size = self.sp.get_piece_size()
        if min(self.bos_id, self.eos_id) < 0:
            raise ValueError(f"{self.path}: the model must define both BOS and EOS")

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.path)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of text; literal "<s>" / "</s>" in text are ordinary characters."""
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_document(self, text: str) -> list[int]:
        """A document as stored in shards: ``<s> text </s>`` (see FRAMING)."""
        return self.encode(text, bos=True, eos=True)

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        return self.sp.encode(texts, add_bos=bos, add_eos=eos)

    def decode(self, ids) -> str:
        """Text of ids; BOS/EOS/UNK control ids are dropped."""
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer.model (or a directory with one); None loads the tiny test tokenizer."""
    return Tokenizer(path)


# A model's embedding table may be padded past its tokenizer's ids (to a multiple of 64 or 128 x the TP
# degree: a few hundred ids at most); more unused ids than this means another tokenizer.
MAX_VOCAB_PADDING = 1024


class HFTokenizer:
    """A transformers tokenizer behind ``Tokenizer``'s interface (an import of a release that ships
    only tokenizer.json, or an export opened as a Hub user would)."""

    def __init__(self, tokenizer):
        self.hf = tokenizer
        self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        # split_special_tokens: literal "</s>" stays text, as in SentencePiece (exports with a chat
        # template turn it off so the template can write control tokens; see data.chat)
        ids = self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def open_tokenizer(path: str | Path, vocab_size: int | None = None) -> Tokenizer | HFTokenizer:
    """The tokenizer at ``path`` for a model with ``vocab_size`` ids (None: no check).

    A tokenizer.model (or a folder holding one) opens as the SentencePiece reference; else a folder of
    Hugging Face tokenizer files. Raises ValueError when its ids cannot be the model's: scoring a model
    with another tokenizer gives numbers that look plausible and mean nothing.
    """
    path = Path(path)
    if path.is_dir() and not (path / "tokenizer.model").is_file() and (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    else:
        tokenizer = Tokenizer(path)
    n = tokenizer.vocab_size
    if vocab_size is not None and not vocab_size - MAX_VOCAB_PADDING < n <= vocab_size:
        why = ("ids the model has no embedding for" if n > vocab_size else
               f"{vocab_size - n} ids it would never use, more than a padded vocabulary leaves "
               f"(< {MAX_VOCAB_PADDING})")
        raise ValueError(f"the model has {vocab_size} ids, tokenizer {path} {n}: {why}; "
                         "so it is not this model's tokenizer (pass the right one with --tokenizer)")
    return tokenizer


def continuation_text(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``.

    Decoded in context, because SentencePiece drops the leading space of a
    piece decoded on its own ("▁return" -> "return").
    """
    head = tokenizer.decode(prompt)
    full = tokenizer.decode(prompt + new)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m data.tokenizer", description="Get the Llama-2 tokenizer.model.")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download tokenizer.model and check its sha256")
    f.add_argument("--repo", default=FETCH_REPO, help=f"Hub model repo holding it (default {FETCH_REPO}; "
                   f"the same file: {', '.join(ALTERNATIVES)}; {LLAMA2_HUB_ID} is gated)")
    f.add_argument("--revision", help="a commit, branch or tag of --repo")
    f.add_argument("--out", type=Path, default=LLAMA2_TOKENIZER.parent,
                   help="folder (default: the one the real recipes name)")
    f.add_argument("--sha256", default=LLAMA2_SHA256, help="expected sha256 (default: Llama-2's)")
    a = p.parse_args(argv)
    try:
        path = fetch(a.repo, a.out, a.revision, a.sha256)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path}: sha256 {a.sha256} ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
