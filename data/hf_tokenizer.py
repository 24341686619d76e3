"""The `tokenizers` (tokenizer.json) twin of a SentencePiece model, and HF files.

datatrove tokenizes with the Rust `tokenizers` library, and Hugging Face users
load tokenizer.json, so both must give SentencePiece's ids exactly. Built with
transformers' ``SpmConverter.build_tokenizer_from_spm_proto(..., legacy=True)``,
which follows the model's own normalizer spec (dummy prefix "▁", whitespace
escaping, no whitespace collapsing) and ranks BPE merges by piece score. Two
pitfalls of a stock Llama-2 tokenizer.json are avoided on purpose:

- no ``added_tokens``: a stock file marks <unk>, <s>, </s> as added special
  tokens, so a literal "</s>" inside a web page became EOS mid-document.
  SentencePiece treats such text as characters; so does this file. The HF
  config also sets ``split_special_tokens`` so transformers keeps it that way.
- the post-processor prepends BOS only (Llama-2 inference convention). The
  document framing ``<s> text </s>`` (data.tokenizer) is applied by
  ``document_post_processor`` where shards are written.
"""

from __future__ import annotations

import json
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.processors import TemplateProcessing

# Texts where a converted tokenizer.json is known to drift from SentencePiece: leading and
# repeated spaces, tabs, CRLF, literal control-token text, byte fallback (CJK, emoji), digits.
PROBE_TEXTS = [
    "", " ", "  ", "\t", "\n", "\r\n", "hello", " hello", "   three leading", "trailing   ", "a  b   c    d",
    "tabs\tin\t\tthe middle", "windows\r\nline\r\nends\r\n", "\n\nleading newlines", "<s>", "</s>", "<unk>",
    "a</s>b", "<s><s></s></s>", "text <s> inside </s> text <unk>", "<0x0A> <0x00>", "▁", "▁▁x", "x▁y", " ⁇ ",
    "12345", "3.14159 2,718 1e-9 0x1F 007", "日本語のテキストです。", "中文文本，标点。", "한국어 텍스트",
    "emoji 🤖👍🏽🇫🇷 family 👨‍👩‍👧", "café naïve résumé Ångström", "e\u0301 combining", "\u00a0nbsp\u2009thin",
    "zero\u200bwidth", "\x00\x01\x7f control", "Ωμέγα и кириллица", "مرحبا بالعالم", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "def f(x):\n    return x ** 2  # square\n", "\tindented with tab\n\t\tdeeper", "if a:\n        pass\n",
]


def _proto(model_path: Path) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    return proto


def bos_post_processor(bos: str = "<s>", bos_id: int = 1) -> TemplateProcessing:
    """Prepend BOS, as Llama-2's tokenizer does at inference."""
    return TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def document_post_processor(bos: str = "<s>", bos_id: int = 1, eos: str = "</s>", eos_id: int = 2) -> TemplateProcessing:
    """The shard framing ``<s> text </s>`` (see data.tokenizer.FRAMING)."""
    return TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=[(bos, bos_id), (eos, eos_id)])


def build_fast_tokenizer(model_path: str | Path) -> FastTokenizer:
    """tokenizers.Tokenizer encoding like SentencePiece; BOS-only post-processor."""
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = _proto(model_path)
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise ValueError(f"{model_path}: only BPE SentencePiece models are supported")
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    # Defensive: the builder adds none today, but a literal "</s>" must never become EOS.
    if tok.get_added_tokens_decoder():
        raise RuntimeError(f"{model_path}: converter added special tokens; literal text would become control ids")
    spec = proto.trainer_spec
    tok.post_processor = bos_post_processor(proto.pieces[spec.bos_id].piece, spec.bos_id)
    return tok


def save_hf_tokenizer(model_path: str | Path, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to out_dir."""
    model_path, out_dir = Path(model_path), Path(out_dir)
    proto = _proto(model_path)
    spec = proto.trainer_spec
    unk, bos, eos = (proto.pieces[i].piece for i in (spec.unk_id, spec.bos_id, spec.eos_id))
    out_dir.mkdir(parents=True, exist_ok=True)
    build_fast_tokenizer(model_path).save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # load tokenizer.json verbatim, no re-conversion
        **special,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,  # literal "<s>" / "</s>" in text stay text
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
