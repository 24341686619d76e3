"""A checkpoint as ``(model_fn, tokenizer, max_seq_len)``, whatever its format.

- A torchtitan DCP checkpoint (a step dir, or a run dir: its latest complete
  step): the config comes from ``--flavor``/``--set`` or the
  ``laneformer_config.json`` beside it, exactly as ``convert to-hf`` reads it;
  the native ``Laneformer`` is rebuilt and loaded, with the attention kernel
  of the device it runs on (``attention.backend_for``).
- An exported Hugging Face folder (``config.json``): loaded with
  ``AutoModelForCausalLM`` (remote code) and ``AutoTokenizer``, as a Hub user
  would, and wrapped to the same interface.

The tokenizer (``checkpoint_tokenizer``, also models.laneformer.generate's):
``--tokenizer`` if given, else the checkpoint's own: an HF folder's files, or
for a DCP checkpoint what ``convert to-hf`` would ship with it
(``convert.resolve_tokenizer``: the files an import left beside the weights,
else the run's ``recipe.toml`` ``[data] tokenizer``, fingerprint-checked).
Never a default: scoring a model with another tokenizer than its own gives
numbers that look plausible and mean nothing, so a checkpoint whose tokenizer
cannot be found is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from models.laneformer.generate import is_hf_folder

# A model's embedding table may be padded past its tokenizer's ids (to a multiple of 64 or 128 x the TP
# degree: a few hundred ids at most); more unused ids than this means another tokenizer.
MAX_VOCAB_PADDING = 1024


@dataclasses.dataclass
class Loaded:
    model_fn: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: object  # encode(text, bos=, eos=), decode(ids), bos_id, eos_id
    max_seq_len: int
    device: torch.device
    source: str
    notes: list[str] = dataclasses.field(default_factory=list)  # where the tokenizer came from


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


def checkpoint_tokenizer(path: str | Path, tokenizer_path: str | Path | None,
                         vocab_size: int) -> tuple[object, list[str]]:
    """(the tokenizer to use with the checkpoint at ``path``, notes on where it came from).

    ``tokenizer_path`` if given, else an HF folder's own, else a DCP checkpoint's
    (``convert.resolve_tokenizer``). Raises FileNotFoundError when none can be
    found and ValueError when its ids cannot be the model's (``vocab_size``).
    """
    from models.laneformer.convert import resolve_tokenizer
    from models.laneformer.hf.checkpoint_io import step_dir

    path = Path(path)
    if tokenizer_path is not None:
        found, notes = Path(tokenizer_path), [f"tokenizer {tokenizer_path} (from --tokenizer)"]
    elif is_hf_folder(path):
        found, notes = path, []  # an HF export: its own files, as a Hub user loads them
    else:
        step = step_dir(path)
        try:
            found, notes = resolve_tokenizer(step)
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


def load_hf(folder: Path, device: torch.device, tokenizer_path: str | Path | None = None) -> Loaded:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32)
    model.to(device).eval()
    tokenizer, notes = checkpoint_tokenizer(folder, tokenizer_path, model.config.vocab_size)

    def model_fn(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    return Loaded(model_fn, tokenizer, model.config.max_position_embeddings, device, f"hf:{folder}", notes)


def load_dcp_model(path: Path, device: torch.device, flavor: str | None, overrides: dict,
                   tokenizer_path: str | Path | None) -> Loaded:
    from models.laneformer.attention import attention_config, backend_for
    from models.laneformer.convert import resolve_config
    from models.laneformer.hf.checkpoint_io import load_dcp, step_dir
    from models.laneformer.model import Laneformer

    step = step_dir(path)
    config = resolve_config(step, flavor, overrides)
    tokenizer, notes = checkpoint_tokenizer(step, tokenizer_path, config.vocab_size)  # before the weights are read
    state_dict = load_dcp(step, config)
    config = dataclasses.replace(config, inner_attention=attention_config(backend_for(device)))
    with torch.device(device):
        model = Laneformer(config)
    model.load_state_dict(state_dict)
    model.eval()
    return Loaded(model, tokenizer, config.max_seq_len, device, f"dcp:{step}", notes)


def load_checkpoint(path: str | Path, *, flavor: str | None = None, overrides: dict | None = None,
                    tokenizer_path: str | Path | None = None, device: str | torch.device | None = None) -> Loaded:
    """A DCP step/run dir or an HF folder, on ``device`` (default: CUDA when present)."""
    path = Path(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if is_hf_folder(path):
        return load_hf(path, device, tokenizer_path)
    return load_dcp_model(path, device, flavor, overrides or {}, tokenizer_path)
