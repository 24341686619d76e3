"""A checkpoint as ``(model_fn, tokenizer, max_seq_len)``, whatever its format.

- A torchtitan DCP checkpoint (a step dir, or a run dir: its latest complete
  step): the config comes from ``--flavor``/``--set`` or the
  ``laneformer_config.json`` beside it, exactly as ``convert to-hf`` reads it;
  the native ``Laneformer`` is rebuilt and loaded, with the attention kernel
  of the device it runs on (``attention.backend_for``).
- An exported Hugging Face folder (``config.json``): loaded with
  ``AutoModelForCausalLM`` (remote code) and ``AutoTokenizer``, as a Hub user
  would, and wrapped to the same interface.

Which of the two a path is, and its config and tokenizer, are
``models.laneformer.checkpoint``'s answers. The tokenizer is the checkpoint's
own, never a default (``Checkpoint.open_tokenizer``, shared with the decoder's CLI; opened
by ``data.tokenizer.open_tokenizer``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from models.laneformer.checkpoint import Checkpoint, open_checkpoint


@dataclasses.dataclass
class Loaded:
    model_fn: Callable[[torch.Tensor], torch.Tensor]
    tokenizer: object  # encode(text, bos=, eos=), decode(ids), bos_id, eos_id
    max_seq_len: int
    device: torch.device
    source: str
    notes: list[str] = dataclasses.field(default_factory=list)  # where the tokenizer came from


def load_hf(checkpoint: Checkpoint, device: torch.device, tokenizer_path: str | Path | None = None) -> Loaded:
    from transformers import AutoModelForCausalLM

    folder = checkpoint.path
    model = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float32)
    model.to(device).eval()
    tokenizer, notes = checkpoint.open_tokenizer(tokenizer_path, model.config.vocab_size)

    def model_fn(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    return Loaded(model_fn, tokenizer, model.config.max_position_embeddings, device, f"hf:{folder}", notes)


def load_dcp_model(checkpoint: Checkpoint, device: torch.device, flavor: str | None, overrides: dict,
                   tokenizer_path: str | Path | None) -> Loaded:
    from models.laneformer.attention import attention_config, backend_for
    from models.laneformer.model import Laneformer

    config = checkpoint.model_config(flavor, overrides)
    tokenizer, notes = checkpoint.open_tokenizer(tokenizer_path, config.vocab_size)  # before the weights
    state_dict = checkpoint.load_weights(config)
    config = dataclasses.replace(config, inner_attention=attention_config(backend_for(device)))
    with torch.device(device):
        model = Laneformer(config)
    model.load_state_dict(state_dict)
    model.eval()
    return Loaded(model, tokenizer, config.max_seq_len, device, f"dcp:{checkpoint.step_dir}", notes)


def load_checkpoint(path: str | Path, *, flavor: str | None = None, overrides: dict | None = None,
                    tokenizer_path: str | Path | None = None, device: str | torch.device | None = None) -> Loaded:
    """A DCP step/run dir or an HF folder, on ``device`` (default: CUDA when present)."""
    checkpoint = open_checkpoint(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if checkpoint.kind == "hf":
        return load_hf(checkpoint, device, tokenizer_path)
    return load_dcp_model(checkpoint, device, flavor, overrides or {}, tokenizer_path)
