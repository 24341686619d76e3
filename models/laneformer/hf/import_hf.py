"""Turn a Hugging Face folder in the released layout into a checkpoint a recipe can start from.

Output: a DCP folder of the native model weights only (load it with
torchtitan's ``checkpoint.initial_load_path`` and
``initial_load_model_only``), ``laneformer_config.json`` holding the native
``Laneformer.Config`` fields (``convert to-hf`` reads it back), and the
folder's tokenizer files, so that an export of it is self-contained. They keep
the release's chat template where the release has one (tokenizer_config.json
or chat_template.jinja): a recipe starting from this checkpoint tunes with it
and exports it (data.chat.checkpoint_template), unless it names its own.

What the config means depends on the code revision it was written for;
``kog_releases.read_release`` works it out and refuses what it cannot
reproduce exactly. The report says, field by field, where every value came
from. Weights are checked before anything is written: a truncated file, or a
config that does not match the weights, is refused with the file and tensor
named.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import write_native_config
from ..model import Laneformer
from ..state_dict_adapter import hf_to_native_name, native_to_hf_name
from . import atomic_folder
from .checkpoint_io import check_shapes, expected_shapes, save_dcp
from .export import TOKENIZER_FILES
from .kog_releases import ReleaseMapping, read_release
from .safetensors_io import read_weights

LM_HEAD, EMBEDDINGS = "lm_head.weight", "model.tok_embeddings.weight"


@dataclass
class ImportReport:
    config: Laneformer.Config
    mapping: ReleaseMapping
    overrides: dict

    def lines(self) -> list[str]:
        return self.mapping.lines(self.overrides)


def import_hf(hf_dir: str | Path, out_dir: str | Path, overrides: dict | None = None, overwrite: bool = False,
              ignorable: tuple[str, ...] = ()) -> ImportReport:
    """Check ``hf_dir`` and write its weights as a native DCP checkpoint to ``out_dir``.

    ``overrides`` replace inferred native fields on purpose; ``ignorable``
    names config keys the caller knows to have no effect.
    """
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    raw = json.loads(config_path.read_text())
    try:
        mapping = read_release(raw, ignorable)
        config = Laneformer.Config(**{**mapping.fields, **(overrides or {})})
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    tensors, sources = read_weights(hf_dir)
    if mapping.tie_embeddings and EMBEDDINGS in tensors:
        if LM_HEAD in tensors and not torch.equal(tensors[LM_HEAD], tensors[EMBEDDINGS]):
            raise ValueError(f"{config_path}: tie_word_embeddings: true, but {LM_HEAD} in {sources[LM_HEAD]} "
                             f"differs from {EMBEDDINGS}")
        tensors[LM_HEAD] = tensors[EMBEDDINGS].clone()
        sources[LM_HEAD] = sources[EMBEDDINGS]
    expected = {native_to_hf_name(k): v for k, v in expected_shapes(config).items()}
    where = {k: str(hf_dir / f) for k, f in sources.items()}
    try:
        check_shapes(expected, {k: v.shape for k, v in tensors.items()}, where)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None

    with atomic_folder(Path(out_dir), overwrite) as tmp:
        save_dcp({hf_to_native_name(k): v for k, v in tensors.items()}, tmp)
        write_native_config(config, tmp)
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / name)
    return ImportReport(config, mapping, dict(overrides or {}))
