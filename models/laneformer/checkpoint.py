"""What is at a checkpoint path, decided once, and everything read from it.

``convert``, the decoder, ``eval.load`` and ``[checkpoint] init_from`` all take a
path that is one of:

- ``"hf"``: an exported Hugging Face folder (``config.json`` and ``*.safetensors``);
- ``"step"``: a complete DCP step dir (``.metadata``, which DCP writes last): a
  run's ``checkpoints/step-N``, or a ``convert from-hf`` import (its
  ``laneformer_config.json`` and tokenizer files beside the weights, no run);
- ``"run"``: a run dir, standing for its latest complete ``checkpoints/step-N``.

``open_checkpoint`` decides which; the ``Checkpoint`` it returns answers the
rest: its step and run dir, model config, tokenizer, chat template and weights.
Nothing here imports torch itself: the weights are read only by ``load_weights``,
through ``hf/checkpoint_io`` (DCP) or safetensors slicing (HF).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import rundir

if TYPE_CHECKING:
    import torch

    from data.tokenizer import HFTokenizer, Tokenizer

    from .model import Laneformer

# The lane-batched weights, [L, out, in] in the released layout; everything else is replicated.
LANE_WEIGHT = re.compile(r"layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight")


def parse_overrides(pairs: list[str]) -> dict:
    """``["delay=1", "late_mode=flush", "window_layers=[0,1]"]`` (``--set``) -> native field values."""
    from . import NATIVE_FIELDS

    out = {}
    for pair in pairs:
        name, value = rundir.parse_set(pair)
        if name not in NATIVE_FIELDS:
            raise ValueError(f"--set {pair!r}: {name!r} is not a Laneformer.Config field; known: {sorted(NATIVE_FIELDS)}")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    kind: Literal["hf", "step", "run"]
    path: Path  # as given
    step_dir: Path | None  # the DCP step read ("step", "run"); None for an HF folder
    run_dir: Path | None  # the run the step belongs to; None for an HF folder or an import

    @property
    def folder(self) -> Path:
        """Where the weights and any files shipped with them (tokenizer, template) are."""
        return self.path if self.kind == "hf" else self.dcp_dir

    @property
    def dcp_dir(self) -> Path:
        """The DCP step dir, which a "step" or "run" checkpoint has."""
        assert self.step_dir is not None, f"{self.path}: an HF folder has no DCP step"
        return self.step_dir

    def model_config(self, flavor: str | None = None, overrides: dict | None = None) -> Laneformer.Config:
        """An HF folder's ``config.json`` (read as the release it is, ``kog_releases``); for DCP
        ``flavor`` if given, else ``laneformer_config.json`` beside the step or in its run dir;
        ``overrides`` on top. Raises ValueError (bad flavor or field) or FileNotFoundError."""
        from . import laneformer_configs, read_native_config
        from .model import Laneformer

        overrides = overrides or {}
        if self.kind == "hf":
            from .hf.kog_releases import read_release

            config_path = self.path / "config.json"
            try:
                return Laneformer.Config(**{**read_release(json.loads(config_path.read_text())).fields, **overrides})
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}") from None
        if flavor is not None:
            if flavor not in laneformer_configs:
                raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(laneformer_configs)}")
            return dataclasses.replace(laneformer_configs[flavor](), **overrides)
        places = [self.dcp_dir] + ([self.run_dir] if self.run_dir else [])
        for folder in places:
            if (folder / rundir.MODEL_CONFIG_FILE).exists():
                return read_native_config(folder / rundir.MODEL_CONFIG_FILE, overrides)
        raise FileNotFoundError(f"no {rundir.MODEL_CONFIG_FILE} in {' or '.join(map(str, places))}: "
                                "give --flavor (and --set overrides)")

    def tokenizer(self) -> tuple[Path, list[str]]:
        """(the tokenizer this checkpoint was trained with, notes for the user).

        Tokenizer files beside the weights (an export's, an import's), else the run's
        recorded ``[data] tokenizer``, whose fingerprint must match every data manifest
        of the run that can be read. Raises FileNotFoundError or ValueError.
        """
        from data.shards import MANIFEST
        from data.tokenizer import fingerprint, resolve_model_path

        from .hf.export import TOKENIZER_FILES

        if self.kind == "hf" or any((self.dcp_dir / name).is_file() for name in TOKENIZER_FILES):
            return self.folder, []
        run = self.run_dir
        recipe_file = run / rundir.RECIPE_FILE if run else rundir.RECIPE_FILE
        recipe = rundir.recorded_recipe(run) if run else None
        if recipe is None:
            raise FileNotFoundError(f"{self.step_dir}: no tokenizer files and no {recipe_file} naming one; "
                                    "pass --tokenizer DIR")
        named = recipe.get("data", {}).get("tokenizer")
        if not named:
            raise ValueError(f"{recipe_file}: [data] tokenizer: absent; pass --tokenizer DIR")
        try:
            model = resolve_model_path(rundir.in_repo(named))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{recipe_file}: [data] tokenizer: {e}; pass --tokenizer DIR") from None
        expected, notes, checked = fingerprint(model), [], 0
        for source in recipe["data"].get("sources", []):
            manifest = rundir.in_repo(source.get("path", "")) / MANIFEST
            if not manifest.is_file():
                notes.append(f"tokenizer not checked against source {source.get('name')!r}: no {manifest}")
                continue
            found = json.loads(manifest.read_text())["tokenizer"]["fingerprint"]
            if found != expected:
                raise ValueError(f"{recipe_file}: [data] tokenizer: {model} has fingerprint {expected[:16]}…, but "
                                 f"{manifest} says the run's data was tokenized with {found[:16]}…; "
                                 "pass --tokenizer DIR (the one it was)")
            checked += 1
        notes.insert(0, f"tokenizer {model} (from {recipe_file}; fingerprint matches {checked} data manifest(s))")
        return model, notes

    def open_tokenizer(self, override: str | Path | None, vocab_size: int) -> tuple[Tokenizer | HFTokenizer, list[str]]:
        """(the tokenizer to use with this checkpoint, notes on where it came from).

        ``override`` (``--tokenizer``) if given, else the checkpoint's own (``tokenizer``), never a
        default; opened and checked against the model's ``vocab_size`` by ``data.tokenizer.open_tokenizer``.
        Raises FileNotFoundError when none can be found, ValueError when its ids cannot be the model's.
        """
        from data.tokenizer import open_tokenizer

        if override is not None:
            found, notes = Path(override), [f"tokenizer {override} (from --tokenizer)"]
        else:
            try:
                found, notes = self.tokenizer()
            except (FileNotFoundError, ValueError) as e:
                raise type(e)(f"{self.path}: cannot tell which tokenizer this checkpoint was trained with, "
                              f"and will not guess: {e}") from None
        try:
            return open_tokenizer(found, vocab_size), notes
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def chat_template(self) -> str | None:
        """The template it carries (a ``data.chat.resolve_template`` spec), or None: its own
        file, else the run's recorded ``[data] chat_template`` (``data.chat.checkpoint_template``)."""
        from data.chat import checkpoint_template

        return checkpoint_template(self.folder)

    def load_weights(self, config: Laneformer.Config, lanes: range | None = None) -> dict[str, torch.Tensor]:
        """Native-named tensors, checked against ``config``; with ``lanes``, only ``W[lanes]`` of
        each lane-batched weight (an HF folder's are sliced as read; DCP is read whole)."""
        cut = slice(lanes.start, lanes.stop) if lanes is not None else slice(None)
        if self.kind != "hf":
            from .hf.checkpoint_io import load_dcp

            full = load_dcp(self.dcp_dir, config)
            if lanes is None:
                return full
            return {k: v[cut].clone() if LANE_WEIGHT.fullmatch(k) else v for k, v in full.items()}
        return _read_hf(self.path, config, cut)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """What is at ``path``: the one rule. Raises FileNotFoundError when it holds no checkpoint."""
    path = Path(path)
    if rundir.is_complete(path):
        return Checkpoint("step", path, path, rundir.run_of(path))
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return Checkpoint("hf", path, None, None)
    latest = rundir.latest_complete_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"{path}: neither a DCP checkpoint (.metadata) nor a run with complete "
                                "checkpoints/step-<N> nor an HF export (config.json and *.safetensors)")
    return Checkpoint("run", path, latest, path)


def _read_hf(folder: Path, config: Laneformer.Config, cut: slice) -> dict[str, torch.Tensor]:
    import torch
    from safetensors import safe_open

    from .hf.checkpoint_io import check_shapes, expected_shapes
    from .hf.safetensors_io import INDEX_FILE, SINGLE_FILE, check_complete
    from .state_dict_adapter import hf_to_native_name

    index = folder / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [SINGLE_FILE]
    out, shapes, where = {}, {}, {}
    for name in files:
        check_complete(folder / name)
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                native = hf_to_native_name(key)
                part = f.get_slice(key)
                shapes[native], where[native] = torch.Size(part.get_shape()), str(folder / name)
                out[native] = part[cut] if LANE_WEIGHT.fullmatch(native) else f.get_tensor(key)
    if "lm_head.weight" not in out and "tok_embeddings.weight" in out:  # tied in the release
        out["lm_head.weight"], shapes["lm_head.weight"] = out["tok_embeddings.weight"], shapes["tok_embeddings.weight"]
    check_shapes(expected_shapes(config), shapes, where)
    return out
