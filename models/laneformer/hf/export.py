"""Write a Hugging Face model folder from native Laneformer weights.

The folder loads with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` and nothing else: config.json (every architecture
field, ``auto_map`` to the two remote-code files copied beside it),
safetensors in the released layout (spec section 4: TorchTitan names under
``model.``, lane weights kept ``[L, out, in]``), generation_config.json,
tokenizer files and a model card. It is written under a temporary name and
renamed when complete, so a folder with the final name is never partial.

config.json also carries the keys Kog's older ``laneformer_tp`` code reads
(``use_early_comm``, ``pre_norm_lane_agg``, ``sliding_window_n_layers``,
``unclamped_layers``, ...) when that code computes the same function from
them; when it cannot (e.g. ``early_send_forward=false``: that code always
sends the early layers forward), those keys are left out, and
``laneformer_tp_compatible`` in config.json and the model card say why.
"""

import dataclasses
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig

from data.chat import TEMPLATE_FILE, add_to_hf_folder
from rundir.progress import progress

from ..model import Laneformer
from ..state_dict_adapter import native_to_hf_name
from . import REMOTE_CODE_DIR, REMOTE_CODE_FILES, atomic_folder
from .checkpoint_io import check_shapes, expected_shapes
from .config_map import config_json, hf_config
from .kog_releases import laneformer_tp_keys
from .safetensors_io import write_weights

# TEMPLATE_FILE (chat_template.jinja): where transformers saves a release's chat template; an import keeps it,
# an export folds it into tokenizer_config.json.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   TEMPLATE_FILE)
log = logging.getLogger(__name__)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
BOS_ID, EOS_ID = 1, 2


@dataclasses.dataclass
class ModelCard:
    """What the README says about where the weights come from."""

    recipe: str | None = None
    step: int | None = None
    tokens_seen: int | None = None
    evals: dict[str, float] | None = None


def export_hf(
    state_dict: dict[str, torch.Tensor],
    model_config: Laneformer.Config,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    card: ModelCard | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    chat_template: str | None = None,
) -> Path:
    """Write the HF folder of native ``state_dict`` (cast to ``dtype`` if given) to ``out_dir``.

    ``tokenizer_dir``: a tokenizer.model (its HF files are generated from it),
    or a folder of tokenizer files (copied; generated when it holds only a
    tokenizer.model). ``chat_template`` (a data.chat spec: the one the weights
    were tuned with) goes into tokenizer_config.json; None: the tokenizer
    files' own template if they bring one, else data.chat's default.
    """
    check_shapes(
        expected_shapes(model_config), {k: v.shape for k, v in state_dict.items()}, dict.fromkeys(state_dict, "state_dict")
    )
    weights = {native_to_hf_name(k): v.detach().to("cpu", dtype or v.dtype)
               for k, v in progress(state_dict.items(), desc="tensors converted", unit="tensor")}
    config = hf_config(model_config)
    config.architectures = ["LaneformerForCausalLM"]
    config.auto_map = {
        "AutoConfig": "configuration_laneformer.LaneformerConfig",
        "AutoModelForCausalLM": "modeling_laneformer.LaneformerForCausalLM",
    }
    config.dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    n_params = sum(v.numel() for v in weights.values())
    tp_keys, tp_why = laneformer_tp_keys(model_config)
    compat = True if not tp_why else "no: " + "; ".join(tp_why)
    if tp_why:
        log.warning("%s: Kog's laneformer_tp code cannot compute this model: %s", out_dir, "; ".join(tp_why))

    with atomic_folder(Path(out_dir), overwrite) as tmp:
        write_weights(weights, tmp, max_shard_bytes)
        fields = {**config_json(config), **tp_keys, "laneformer_tp_compatible": compat}
        (tmp / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(tmp)
        for name in REMOTE_CODE_FILES:
            shutil.copy2(REMOTE_CODE_DIR / name, tmp / name)
        if tokenizer_dir is not None:
            _write_tokenizer(Path(tokenizer_dir), tmp, chat_template)
        (tmp / "README.md").write_text(model_card(model_config, card or ModelCard(), n_params, tp_why))
    return Path(out_dir)


def to_hf(model: torch.nn.Module, out_dir: str | Path, **kwargs) -> Path | None:
    """Export an in-memory (possibly FSDP-sharded) model, e.g. at the end of a run.

    Every rank must call it (sharded tensors are gathered one at a time); rank 0 writes and returns the path.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state_dict = {}
    for k, v in progress(model.state_dict().items(), desc="tensors gathered", unit="tensor", disable=not rank0):
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if rank0:
            state_dict[k] = full.detach().cpu()
    config = cast(Laneformer.Config, model.config)  # a Laneformer's, under FSDP too
    return export_hf(state_dict, config, out_dir, **kwargs) if rank0 else None


def _write_tokenizer(src: Path, dst: Path, chat_template: str | None = None) -> None:
    """tokenizer.model plus HF files generated from it, or a folder's complete set of HF files copied;
    tokenizer_config.json gets the chat template (``</s>`` ends a turn: generation_config's EOS):
    ``chat_template`` if given, else the files' own, else data.chat's default."""
    if src.is_dir() and (src / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
    else:
        model = src / "tokenizer.model" if src.is_dir() else src
        if not model.is_file():
            raise FileNotFoundError(f"{src}: neither a tokenizer.model nor a folder with {TOKENIZER_FILES}")
        from data.hf_tokenizer import save_hf_tokenizer

        shutil.copy2(model, dst / "tokenizer.model")
        save_hf_tokenizer(model, dst)
    add_to_hf_folder(dst, chat_template)


def model_card(config: Laneformer.Config, card: ModelCard, n_params: int, tp_why: Sequence[str] = ()) -> str:
    """A README: what the model is, where its weights come from, its latest evals, how to load it."""
    lines = [
        "---",
        "library_name: transformers",
        "tags: [laneformer, delayed-tensor-parallelism]",
        "---",
        "",
        f"# Laneformer ({n_params / 1e6:,.1f}M parameters)",
        "",
        "A Llama-style decoder whose hidden state has a lane axis; lanes exchange their",
        f"outputs with a delay of {config.delay} layers (Delayed Tensor Parallelism).",
        "",
        "| field | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in _architecture_summary(config).items()]
    lines += ["", "## Kog's code", ""]
    if tp_why:
        lines += ["Kog's older `laneformer_tp` remote code cannot compute this model, so config.json",
                  "leaves out its keys:", "", *[f"- {why}" for why in tp_why]]
    else:
        lines += ["config.json also carries the keys of Kog's older `laneformer_tp` remote code,",
                  "which computes the same logits from them."]
    lines += ["", "## Training", ""]
    lines += [
        f"- recipe: {card.recipe or 'unknown'}",
        f"- step: {card.step if card.step is not None else 'unknown'}",
        f"- tokens seen: {f'{card.tokens_seen:,}' if card.tokens_seen is not None else 'unknown'}",
    ]
    if card.evals:
        lines += ["", "## Latest evaluation", "", "| task | score |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in card.evals.items()]
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this repo>", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("<this repo>")',
        "```",
        "",
    ]
    return "\n".join(lines)


def _architecture_summary(config: Laneformer.Config) -> dict[str, object]:
    return {
        "layers": config.n_layers,
        "hidden size": config.dim,
        "heads (query / KV), head dim": f"{config.n_heads} / {config.n_kv_heads}, {config.head_dim}",
        "MLP (SwiGLU) size": config.ffn_hidden_dim,
        "vocabulary": config.vocab_size,
        "context": config.max_seq_len,
        "lanes": config.n_lanes,
        "exchange": f"delay {config.delay}, early {config.early_mode}, late {config.late_mode}, "
        f"early layers send: {config.early_send_forward}, delayed exchange: {config.delayed_exchange}, "
        f"final {config.final_agg}",
        "sliding window": f"{config.window_size} on layers {config.window_layers}" if config.window_layers else "none",
        "RoPE": _rope_summary(config),
    }


def _rope_summary(config: Laneformer.Config) -> str:
    full = config.rope_theta if config.rope_theta_global is None else config.rope_theta_global
    scaling = "" if config.rope_scaling == "none" else \
        f", {config.rope_scaling} x{config.rope_scaling_factor:g} of {config.rope_original_seq_len}"
    if not config.window_layers:
        return f"theta {full:g}{scaling}"
    return f"theta {config.rope_theta:g} on window layers, {full:g}{scaling} on the others"
