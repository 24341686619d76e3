"""A checkpoint as ``(model_fn, tokenizer, max_seq_len)``, whatever its format.

- A torchtitan DCP checkpoint (a step dir, or a run dir: its latest complete
  step): the config comes from ``--flavor``/``--set`` or the
  ``laneformer_config.json`` beside it, exactly as ``convert to-hf`` reads it;
  the native ``Laneformer`` is rebuilt and loaded, with the attention kernel
  of the device it runs on (``attention.backend_for``). The tokenizer is the
  project's SentencePiece model (``--tokenizer``, default the tiny one).
- An exported Hugging Face folder (``config.json``): loaded with
  ``AutoModelForCausalLM`` (remote code) and ``AutoTokenizer``, as a Hub user
  would, and wrapped to the same interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch


@dataclasses.dataclass
class Loaded:
    model_fn: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: object  # encode(text, bos=, eos=), decode(ids), bos_id, eos_id
    max_seq_len: int
    device: torch.device
    source: str


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


def load_hf(folder: Path, device: torch.device) -> Loaded:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32)
    model.to(device).eval()

    def model_fn(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    return Loaded(model_fn, HFTokenizer(AutoTokenizer.from_pretrained(str(folder))),
                  model.config.max_position_embeddings, device, f"hf:{folder}")


def load_dcp_model(path: Path, device: torch.device, flavor: str | None, overrides: dict,
                   tokenizer_path: str | Path | None) -> Loaded:
    from data.tokenizer import Tokenizer
    from models.laneformer.convert import resolve_config
    from models.laneformer.attention import attention_config, backend_for
    from models.laneformer.hf.checkpoint_io import load_dcp, step_dir
    from models.laneformer.model import Laneformer

    step = step_dir(path)
    config = resolve_config(step, flavor, overrides)
    state_dict = load_dcp(step, config)
    config = dataclasses.replace(config, inner_attention=attention_config(backend_for(device)))
    with torch.device(device):
        model = Laneformer(config)
    model.load_state_dict(state_dict)
    model.eval()
    tokenizer = Tokenizer(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids, the model {config.vocab_size}")
    return Loaded(model, tokenizer, config.max_seq_len, device, f"dcp:{step}")


def load_checkpoint(path: str | Path, *, flavor: str | None = None, overrides: dict | None = None,
                    tokenizer_path: str | Path | None = None, device: str | torch.device | None = None) -> Loaded:
    """A DCP step/run dir or an HF folder, on ``device`` (default: CUDA when present)."""
    path = Path(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (path / "config.json").is_file() and not (path / ".metadata").exists():
        return load_hf(path, device)
    return load_dcp_model(path, device, flavor, overrides or {}, tokenizer_path)
