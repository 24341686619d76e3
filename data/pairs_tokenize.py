"""Preference pairs -> token shards plus loss masks, for ``data.tokenize --pairs``.

The chat path (data.chat_tokenize) with two documents a row: ``pair_adapter``
puts a row's ``prompt``/``chosen``/``rejected`` in the document as JSON, and
``PairTokenizer`` renders it with data.pairs (chosen then rejected, adjacent,
in input order: datatrove's unshuffled write keeps it). Refused rows are
counted by reason in ``logs/pairs/NNNNN.json``; the manifest's ``pairs``
entry sums them, with the formats read and the template.
"""

from __future__ import annotations

import json
from pathlib import Path

from data.chat import resolve_template, template_sha256
from data.chat_tokenize import ChatTokenizer, logged
from data.pairs import KEYS, MANIFEST_KEY, render_pair
from data.tokenizer import Tokenizer

LAYOUT = "document 2p: pair p's chosen sequence, 2p+1: its rejected one (same shard, input order)"


def pair_adapter(self, data: dict, path: str, id_in_file: int | str) -> dict:
    """A datatrove reader adapter: the row's pair columns as JSON text (never empty, so a row without
    them is counted, not dropped); its other scalar columns stay in the metadata (for ``--exclude``)."""
    pair = {k: data.pop(k) for k in KEYS if k in data}
    return {"text": json.dumps(pair), "id": str(data.pop(self.id_key, f"{path}/{id_in_file}")),
            "metadata": {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))}}


class PairTokenizer(ChatTokenizer):
    """ChatTokenizer for preference pairs: two documents a row, rows data.pairs refuses counted."""

    name = "⚖️ Pair tokenizer"
    kind = MANIFEST_KEY

    def __init__(self, out: str, tokenizer_json: str, model_path: str, template: str | None, batch_size: int,
                 seq_len: int | None):
        super().__init__(out, tokenizer_json, model_path, template, batch_size)
        self.seq_len = seq_len

    def encode(self, text: str, sp: Tokenizer):
        return render_pair(json.loads(text), sp, self.template, self.seq_len)


def pair_summary(out: Path, template: str | None, seq_len: int | None) -> dict:
    """The manifest's ``pairs`` entry: pairs written by format, template, seq_len, refused rows."""
    name, jinja = resolve_template(template)
    written, rejected, examples = logged(out, PairTokenizer.kind)
    return {"layout": LAYOUT, "pairs": sum(written.values()), "format": dict(sorted(written.items())),
            "template": name, "template_sha256": template_sha256(jinja), "seq_len": seq_len,
            "rejected": dict(sorted(rejected.items())), "rejected_examples": examples}
