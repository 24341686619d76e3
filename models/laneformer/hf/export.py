"""Write a Hugging Face model folder from native Laneformer weights.

The folder loads with ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` and nothing else: config.json (every architecture
field, ``auto_map`` to the two remote-code files copied beside it),
safetensors in the released layout (spec section 4: TorchTitan names under
``model.``, lane weights kept ``[L, out, in]``), generation_config.json,
tokenizer files and a model card. It is written under a temporary name and
renamed when complete, so a folder with the final name is never partial.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig

from ..model import Laneformer
from ..state_dict_adapter import native_to_hf_name
from . import REMOTE_CODE_DIR, REMOTE_CODE_FILES, atomic_folder
from .checkpoint_io import check_shapes, expected_shapes
from .config_map import config_json, hf_config
from .safetensors_io import write_weights

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
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
) -> Path:
    """Write the HF folder of native ``state_dict`` (cast to ``dtype`` if given) to ``out_dir``."""
    check_shapes(
        expected_shapes(model_config), {k: v.shape for k, v in state_dict.items()}, dict.fromkeys(state_dict, "state_dict")
    )
    weights = {native_to_hf_name(k): v.detach().to("cpu", dtype or v.dtype) for k, v in state_dict.items()}
    config = hf_config(model_config)
    config.architectures = ["LaneformerForCausalLM"]
    config.auto_map = {
        "AutoConfig": "configuration_laneformer.LaneformerConfig",
        "AutoModelForCausalLM": "modeling_laneformer.LaneformerForCausalLM",
    }
    config.dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    n_params = sum(v.numel() for v in weights.values())

    with atomic_folder(Path(out_dir), overwrite) as tmp:
        write_weights(weights, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config_json(config), indent=2, sort_keys=True) + "\n")
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(tmp)
        for name in REMOTE_CODE_FILES:
            shutil.copy2(REMOTE_CODE_DIR / name, tmp / name)
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), tmp)
        (tmp / "README.md").write_text(model_card(model_config, card or ModelCard(), n_params))
    return Path(out_dir)


def to_hf(model: torch.nn.Module, out_dir: str | Path, **kwargs) -> Path | None:
    """Export an in-memory (possibly FSDP-sharded) model, e.g. at the end of a run.

    Every rank must call it (sharded tensors are gathered one at a time); rank 0 writes and returns the path.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state_dict = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if rank0:
            state_dict[k] = full.detach().cpu()
    return export_hf(state_dict, model.config, out_dir, **kwargs) if rank0 else None


def _copy_tokenizer(src: Path, dst: Path) -> None:
    present = [n for n in TOKENIZER_FILES if (src / n).exists()]
    if not present:
        raise FileNotFoundError(f"{src}: none of the tokenizer files {TOKENIZER_FILES}")
    for name in present:
        shutil.copy2(src / name, dst / name)


def model_card(config: Laneformer.Config, card: ModelCard, n_params: int) -> str:
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
        f"early layers send: {config.early_send_forward}, final {config.final_agg}",
        "sliding window": f"{config.window_size} on layers {config.window_layers}" if config.window_layers else "none",
    }
