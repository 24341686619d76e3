"""Turn a Hugging Face folder in the released layout into a checkpoint a recipe can start from.

Output: a DCP folder of the native model weights only (load it with
torchtitan's ``checkpoint.initial_load_path`` and
``initial_load_model_only``), plus ``laneformer_config.json`` holding the
native ``Laneformer.Config`` fields (``convert to-hf`` reads it back).

Released config keys are read by ``LaneformerConfig`` (the mapping is listed
in ``convert.py``). Fields the config lacks take the native defaults and are
reported, as are keys that have no effect here. Weights are checked before
anything is written: a truncated file, or a config that does not match the
weights, is refused with the file and tensor named.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ..model import Laneformer
from ..state_dict_adapter import hf_to_native_name, native_to_hf_name
from . import atomic_folder
from .checkpoint_io import check_shapes, expected_shapes, save_dcp
from .config_map import native_config, write_native_config
from .safetensors_io import read_weights


@dataclass
class ImportReport:
    config: Laneformer.Config
    missing: list[str]  # "field=default" for fields the HF config lacked
    ignored: list[str]  # HF config keys with no effect on the model

    def lines(self) -> list[str]:
        out = [f"defaults for fields absent from config.json: {', '.join(self.missing) or 'none'}"]
        if self.ignored:
            out.append(f"config.json keys ignored: {', '.join(self.ignored)}")
        return out


def import_hf(hf_dir: str | Path, out_dir: str | Path, overrides: dict | None = None, overwrite: bool = False) -> ImportReport:
    """Check ``hf_dir`` and write its weights as a native DCP checkpoint to ``out_dir``."""
    hf_dir = Path(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    config, missing, ignored = native_config(raw, overrides)
    tensors, sources = read_weights(hf_dir)
    expected = {native_to_hf_name(k): v for k, v in expected_shapes(config).items()}
    where = {k: str(hf_dir / f) for k, f in sources.items()}
    try:
        check_shapes(expected, {k: v.shape for k, v in tensors.items()}, where)
    except ValueError as e:
        raise ValueError(f"{hf_dir / 'config.json'}: {e}") from None

    with atomic_folder(Path(out_dir), overwrite) as tmp:
        save_dcp({hf_to_native_name(k): v for k, v in tensors.items()}, tmp)
        write_native_config(config, tmp)
    return ImportReport(config, missing, ignored)
