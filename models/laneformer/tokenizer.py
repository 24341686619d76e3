"""The tokenizer a checkpoint was trained with, never a default.

``checkpoint_tokenizer``: ``--tokenizer`` if given, else the checkpoint's own
(``Checkpoint.tokenizer``: an export's or import's files, else the run's
``recipe.toml`` ``[data] tokenizer``, fingerprint-checked; what ``convert to-hf``
ships). Scoring a model with another tokenizer than its own gives numbers
that look plausible and mean nothing, so a checkpoint whose tokenizer cannot be
found is refused. The decoder's CLI and ``eval.load`` both use it.
"""

from __future__ import annotations

from pathlib import Path

from models.laneformer.checkpoint import Checkpoint

# A model's embedding table may be padded past its tokenizer's ids (to a multiple of 64 or 128 x the TP
# degree: a few hundred ids at most); more unused ids than this means another tokenizer.
MAX_VOCAB_PADDING = 1024


class HFTokenizer:
    """A transformers tokenizer behind the project tokenizer's interface."""

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


def open_tokenizer(path: str | Path):
    """A tokenizer.model (or a folder holding one): the project's SentencePiece reference; else a
    folder of Hugging Face tokenizer files (an import of a release that ships only tokenizer.json)."""
    from data.tokenizer import Tokenizer

    path = Path(path)
    if path.is_dir() and not (path / "tokenizer.model").is_file() and (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    return Tokenizer(path)


def checkpoint_tokenizer(checkpoint: Checkpoint, tokenizer_path: str | Path | None,
                         vocab_size: int) -> tuple[object, list[str]]:
    """(the tokenizer to use with ``checkpoint``, notes on where it came from).

    ``tokenizer_path`` if given, else the checkpoint's own (``Checkpoint.tokenizer``).
    Raises FileNotFoundError when none can be found and ValueError when its ids
    cannot be the model's (``vocab_size``).
    """
    path = checkpoint.path
    if tokenizer_path is not None:
        found, notes = Path(tokenizer_path), [f"tokenizer {tokenizer_path} (from --tokenizer)"]
    else:
        try:
            found, notes = checkpoint.tokenizer()
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{path}: cannot tell which tokenizer this checkpoint was trained with, and will not "
                          f"guess: {e}") from None
    tokenizer = open_tokenizer(found)
    n = tokenizer.vocab_size
    if not vocab_size - MAX_VOCAB_PADDING < n <= vocab_size:
        why = ("ids the model has no embedding for" if n > vocab_size else
               f"{vocab_size - n} ids it would never use, more than a padded vocabulary leaves "
               f"(< {MAX_VOCAB_PADDING})")
        raise ValueError(f"{path}: the model has {vocab_size} ids, tokenizer {found} {n}: {why}; "
                         "so it is not this model's tokenizer (pass the right one with --tokenizer)")
    return tokenizer, notes


def continuation_text(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``.

    Decoded in context, because SentencePiece drops the leading space of a
    piece decoded on its own ("▁return" -> "return").
    """
    head = tokenizer.decode(prompt)
    full = tokenizer.decode(prompt + new)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new)
