"""Conversations -> token shards plus a loss mask (datatrove's optional ``.ds.loss``), for data.tokenize.

``--chat-key messages`` makes the reader put each record's message list, as
JSON text, in the document (``chat_adapter``), and ``ChatTokenizer`` replaces
datatrove's text tokenizer: every conversation is rendered by data.chat
(SentencePiece ids, one mask byte per token: 1 on assistant answers and their
</s>, 0 elsewhere) and written with datatrove's own TokenizedFile, which
writes ``NNNNN_unshuffled.ds.loss`` beside the shard. Conversations data.chat
refuses are not written; each task counts them by reason in
``logs/chat/NNNNN.json``, and the manifest sums them (``chat.rejected``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer, TokenizedFile

from data.chat import BadConversation, render, resolve_template, template_sha256
from data.shards import LOGS_DIR
from data.tokenizer import Tokenizer


def chat_adapter(self, data: dict, path: str, id_in_file: int | str) -> dict:
    """A datatrove reader adapter: the record's messages (``self.text_key``) as JSON text.

    Missing or empty message lists still become documents ("null", "[]") so they are counted, not dropped.
    The record's other scalar columns stay in the metadata, where data.tokenize's ``--exclude`` reads them.
    """
    messages = data.pop(self.text_key, None)
    return {"text": json.dumps(messages), "id": str(data.pop(self.id_key, f"{path}/{id_in_file}")),
            "metadata": {k: v for k, v in data.items() if isinstance(v, (str, int, float, bool))}}


class ChatTokenizer(DocumentTokenizer):
    """DocumentTokenizer for conversations: data.chat's ids and loss mask, bad ones counted.
    Subclasses (data.pairs_tokenize) change ``encode`` and ``kind``, the name of their logs."""

    name = "💬 Chat tokenizer"
    kind = "chat"  # refusals are logged in <out>/logs/<kind>/NNNNN.json

    def __init__(self, out: str, tokenizer_json: str, model_path: str, template: str | None, batch_size: int):
        super().__init__(out, tokenizer_name_or_path=tokenizer_json, batch_size=batch_size, shuffle_documents=False,
                         save_index=True, save_final_metadata=True, save_loss_metadata=True)
        self.out, self.model_path, self.template = out, model_path, template
        resolve_template(template)  # fail before any task starts

    def encode(self, text: str, sp: Tokenizer) -> tuple[str, list[tuple[list[int], list[int]]]]:
        """(what was written, [(ids, mask)] of the documents to write) of one record; BadConversation if unfit."""
        return "conversations", [render(json.loads(text), sp, self.template)]

    def run(self, data, rank: int = 0, world_size: int = 1):
        self._rank = rank
        return super().run(data, rank, world_size)

    def write_unshuffled(self, data, filename: str):
        sp = Tokenizer(self.model_path)
        out = TokenizedFile(self.output_folder, filename, save_index=True, save_loss_metadata=True,
                            upload_block_size=self.upload_block_size, tokenizer_name_or_path=self.tokenizer_name_or_path,
                            save_final_metadata=self.save_final_metadata, token_size=self.token_size)
        written, rejected, examples = Counter(), Counter(), {}
        for document in data:
            with self.track_time():
                try:
                    what, documents = self.encode(document.text, sp)
                except BadConversation as e:
                    rejected[e.reason] += 1
                    examples.setdefault(e.reason, f"{document.id}: {e}")
                    self.stat_update("rejected")
                    continue
                written[what] += 1
                for ids, mask in documents:
                    out.write(ids, np.asarray(mask, dtype=bool))
                    self.stat_update("tokens", value=len(ids))
                    self.stat_update("trained_tokens", value=int(sum(mask)))
        out.close()
        log = Path(self.out) / LOGS_DIR / self.kind / f"{self._rank:05d}.json"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(json.dumps({"written": written, "rejected": rejected, "examples": examples}, indent=1) + "\n")
        return out


def logged(out: Path, kind: str) -> tuple[Counter, Counter, dict]:
    """(written, rejected, an example per reason) summed over the tasks' logs of a ChatTokenizer ``kind``."""
    written, rejected, examples = Counter(), Counter(), {}
    for log in sorted((Path(out) / LOGS_DIR / kind).glob("*.json")):
        part = json.loads(log.read_text())
        written.update(part.get("written", {}))
        rejected.update(part["rejected"])
        for reason, example in part["examples"].items():
            examples.setdefault(reason, example)
    return written, rejected, examples


def chat_summary(out: Path, template: str | None, chat_key: str) -> dict:
    """The manifest's ``chat`` entry: template, and refused conversations summed over tasks."""
    name, jinja = resolve_template(template)
    _, rejected, examples = logged(out, ChatTokenizer.kind)
    return {"key": chat_key, "template": name, "template_sha256": template_sha256(jinja),
            "rejected": dict(sorted(rejected.items())), "rejected_examples": examples}
