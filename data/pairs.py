"""Preference pairs: one example -> two token sequences (chosen, rejected) with the run's chat template.

A pair is rendered by data.chat, as a chat source's conversations are: each side is
the conversation ``prompt + [answer]`` through ``data.chat.render`` (ids, mask), and
the prompt alone through ``data.chat.prompt_ids`` (rendered with the generation
prompt, ready for an answer). As TRL's DPOTrainer does (trl/trainer/dpo_trainer.py,
``tokenize_fn``: ``prompt_ids`` from ``apply_chat_template(prompt,
add_generation_prompt=True)``, then "Mismatch between tokenized prompt and the
start of tokenized prompt+chosen"), the prompt's ids must be a prefix of both
sides' ids; TRL only warns, here such a pair is refused (a template that re-renders
the prompt, or a BOS before the answer, trl#1930 / axolotl#1616, would otherwise
train on misaligned log-probs). The loss mask is data.chat's (the answer's content
and its closing </s>) on the tokens after the prompt, 0 on the prompt.

Input rows, each format recognised by its columns (no flag):

- ``explicit`` (TRL's conversational form with explicit prompt): ``prompt``,
  ``chosen``, ``rejected`` message lists; each answer one assistant message.
- ``implicit`` (TRL's implicit prompt): ``chosen`` and ``rejected`` whole
  conversations; their shared leading messages are the prompt and the last
  (assistant) message the answer.
- ``tulu`` (allenai/llama-3.1-tulu-3-8b-preference-mixture; its card's
  ``dataset_info``: ``id`` string, ``prompt`` string, ``chosen``/``rejected``
  lists of {content, role}, ``source`` string): ``chosen``/``rejected`` hold the
  whole conversation, user turn included (open-instruct's
  ``preference_tulu_tokenize_and_truncate_v1``: "the prompt is contained in the
  list of messages"; NeMo-RL's tulu3.py takes ``chosen[:-1]`` as the prompt), so
  it is read as the implicit form; the ``prompt`` string becomes the user turn
  only when the lists hold the answer alone.

Rows not trained on raise ``BadConversation`` with a reason (counted in the
manifest by data.pairs_tokenize): the prefix rule broken, an empty answer,
chosen equal to rejected, a side longer than ``seq_len``, and data.chat's own.

On disk (the contract a preference trainer reads, checked once by ``open_pairs``):
an ordinary tokenized source (data.shards, with ``.ds.loss`` masks) whose manifest
has a ``pairs`` entry; document 2p is pair p's chosen sequence, 2p+1 its rejected
one, adjacent in one shard, in input order; both start with the same prompt ids.
data.pairs_loader reads them as batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from data.chat import BadConversation, check_conversation, prompt_ids, render
from data.shards import MANIFEST, ShardError, TokenizedSource, open_source

KEYS = ("prompt", "chosen", "rejected")  # the columns a pair row is read from
MANIFEST_KEY = "pairs"  # the manifest entry that marks a pair source

NOT_A_PAIR = "no chosen/rejected message lists"
NOT_ONE_ANSWER = "answer is not one assistant message"
PROMPTS_DIFFER = "chosen and rejected prompts differ"
EMPTY_ANSWER = "empty answer"
NOT_A_PREFIX = "prompt ids not a prefix of the answer's"
IDENTICAL = "chosen equals rejected"
TOO_LONG = "longer than seq_len"


def split_pair(row: dict) -> tuple[str, list, dict, dict]:
    """(format, prompt messages, chosen answer message, rejected answer message) of a row."""
    prompt, chosen, rejected = (row.get(k) for k in KEYS)
    if not (isinstance(chosen, list) and isinstance(rejected, list) and chosen and rejected):
        raise BadConversation(NOT_A_PAIR, f"has {[k for k in KEYS if row.get(k) is not None]} of {list(KEYS)}")
    if isinstance(prompt, list):
        for answer in (chosen, rejected):
            if len(answer) != 1 or not isinstance(answer[0], dict) or answer[0].get("role") != "assistant":
                roles = [m.get("role") if isinstance(m, dict) else m for m in answer]
                raise BadConversation(NOT_ONE_ANSWER, f"roles {roles}")
        return "explicit", prompt, chosen[0], rejected[0]
    fmt = "tulu" if isinstance(prompt, str) else "implicit"
    if fmt == "tulu" and len(chosen) == 1 and len(rejected) == 1:  # the lists hold the answers alone
        return fmt, [{"role": "user", "content": prompt}], chosen[0], rejected[0]
    if chosen[:-1] != rejected[:-1]:
        raise BadConversation(PROMPTS_DIFFER, "the messages before the last differ")
    return fmt, chosen[:-1], chosen[-1], rejected[-1]


def render_pair(row: dict, tokenizer, template: str | None = None,
                seq_len: int | None = None) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """(format, [(chosen ids, mask), (rejected ids, mask)]) of a row; BadConversation if unfit.
    The mask is 1 on the answer's tokens only; both sides start with the prompt's ids."""
    fmt, prompt, *answers = split_pair(row)
    for answer in answers:
        if isinstance(answer, dict) and isinstance(answer.get("content"), str) and not answer["content"].strip():
            raise BadConversation(EMPTY_ANSWER)
    sides = [render(prompt + [answer], tokenizer, template) for answer in answers]  # checks the messages
    head = prompt_ids(check_conversation(prompt + [answers[0]])[:-1], tokenizer, template)
    out = []
    for name, (ids, mask) in zip(("chosen", "rejected"), sides):
        if ids[: len(head)] != head:
            at = next((i for i, (a, b) in enumerate(zip(ids, head)) if a != b), len(ids))
            raise BadConversation(NOT_A_PREFIX, f"{name}: the prompt's {len(head)} ids differ from it at position {at}")
        out.append((ids, [0] * len(head) + mask[len(head):]))
    if out[0][0] == out[1][0]:
        raise BadConversation(IDENTICAL)
    if seq_len is not None and (n := max(len(out[0][0]), len(out[1][0]))) > seq_len:
        raise BadConversation(TOO_LONG, f"{n} tokens > {seq_len}")
    return fmt, out


class PairError(ShardError):
    """A pair source that cannot be read as pairs (named with its file)."""


def open_pairs(source: str | Path, fingerprint: str | None = None, vocab_size: int | None = None) -> TokenizedSource:
    """A pair source, opened and checked once for every reader (the pair loader, decontamination's
    reading, tests): a ``pairs`` manifest entry, loss masks, and whole pairs in every shard. PairError
    if it is not one; ShardError (data.shards) if it is not a readable source."""
    source = open_source(source, expected_fingerprint=fingerprint, expected_vocab_size=vocab_size)
    manifest = source.path / MANIFEST
    if MANIFEST_KEY not in source.manifest:
        raise PairError(f"{manifest}: no '{MANIFEST_KEY}' entry: not a pair source (tokenize it with "
                        "`python -m data.tokenize --pairs`)")
    if not source.manifest.get("loss_mask"):
        raise PairError(f"{manifest}: a pair source needs loss masks (the answers' tokens)")
    for shard in source.shards:
        if shard.num_documents % 2:
            raise PairError(f"{shard.path}: {shard.num_documents} documents, an odd count: pairs are "
                            "(chosen, rejected) documents adjacent in one shard")
    return source


def pairs_of(source: str | Path) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(chosen ids, chosen mask, rejected ids, rejected mask) of every pair of a pair source, in order."""
    for shard in open_pairs(source).shards:
        ends = np.concatenate([[0], np.asarray(shard.doc_ends, dtype=np.int64)])
        for d in range(0, shard.num_documents, 2):
            (c0, c1), (r0, r1) = (ends[d], ends[d + 1]), (ends[d + 1], ends[d + 2])
            yield (np.asarray(shard.tokens[c0:c1]), np.asarray(shard.loss[c0:c1]),
                   np.asarray(shard.tokens[r0:r1]), np.asarray(shard.loss[r0:r1]))
