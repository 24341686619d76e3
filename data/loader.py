"""The mixture as torchtitan components: a ``BaseDataLoader`` and a ``BaseTokenizer``.

``MixtureDataLoader`` yields ``({"input", "positions"}, labels)`` per data-parallel
rank, and ``loss_weights`` among the inputs where sources weigh their tokens (the
trainer takes it out before the model's forward). Its state is one number, the
next global sample index, identical on every rank, so a run saved on N ranks
resumes on any other number of ranks with exactly the samples the
uninterrupted run would have seen (torchtitan's own loader refuses a changed
rank count). It reads with the tokenizer the Trainer built (its ``tokenizer``
slot), so every rank loads the model once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from data.mixture import LOSS_WEIGHTS, Mixture, MixtureLoader, SourceSpec
from data.tokenizer import Tokenizer


class SentencePieceTokenizer(BaseTokenizer):
    """torchtitan's tokenizer slot filled with the project's SentencePiece tokenizer."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        path: str = ""  # the .model file; Trainer's hf_assets_path is not used

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        self.tokenizer = Tokenizer(config.path or tokenizer_path)
        self.bos_id, self.eos_id = self.tokenizer.bos_id, self.tokenizer.eos_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, bos=bos, eos=eos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def get_vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def build_mixture(sources: list[SourceSpec], tokenizer: Tokenizer, seq_len: int, seed: int,
                  vocab_size: int, total_samples: int | None) -> Mixture:
    """Open and validate every source (shards, tokenizer fingerprint, vocab, epochs)."""
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"{tokenizer.path}: tokenizer has {tokenizer.vocab_size} ids but the model's "
            f"vocab_size is {vocab_size}"
        )
    return Mixture(
        list(sources), seq_len=seq_len, seed=seed,
        expected_fingerprint=tokenizer.fingerprint, expected_vocab_size=vocab_size,
        total_samples=total_samples,
    )


class BatchLoaderSlot(BaseDataLoader):
    """torchtitan's data loader slot over one of this project's numpy batch loaders (``self.loader``):
    its batches as tensors (``INPUTS``: batch key -> model input name; labels apart; ``OPTIONAL``: inputs
    of the batches that have them), its state and its ``skip_to``."""

    INPUTS = {"input_ids": "input", "positions": "positions"}
    OPTIONAL = (LOSS_WEIGHTS,)
    loader: Any

    def skip_to(self, index: int) -> tuple[int, int]:
        """The loader's ``skip_to``: leave the global samples up to ``index`` unread (a spike rollback)."""
        return self.loader.skip_to(index)

    def __iter__(self):
        for batch in self.loader:
            inputs = {name: torch.from_numpy(batch[key]) for key, name in self.INPUTS.items()}
            inputs |= {key: torch.from_numpy(batch[key]) for key in self.OPTIONAL if key in batch}
            yield inputs, torch.from_numpy(batch["labels"])

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.loader.load_state_dict(state_dict)


class MixtureDataLoader(BatchLoaderSlot):
    """One rank's share of the deterministic mixture (see data.mixture)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        sources: list[SourceSpec] = field(default_factory=list)
        vocab_size: int = 0
        seed: int = 0
        total_samples: int | None = None  # steps x global batch: checks epochs up front

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: SentencePieceTokenizer,
                 seq_len: int, local_batch_size: int, **kwargs: Any):
        mixture = build_mixture(config.sources, tokenizer.tokenizer, seq_len, config.seed,
                                config.vocab_size, config.total_samples)
        self.loader = MixtureLoader(mixture, local_batch_size * dp_world_size, dp_rank, dp_world_size)

    @property
    def mixture(self) -> Mixture:
        return self.loader.mixture
