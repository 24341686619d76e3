"""Laneformer as a torchtitan model: flavors, the ``model_registry``, the native config.

``model_registry(flavor, attn_backend=...)`` returns the ``ModelSpec``
torchtitan's Trainer builds from (runnable ``Trainer.Config`` functions are in
``train.config_registry``). A model config is stored as ``NATIVE_FIELDS`` in
a run's ``laneformer_config.json`` (file name and JSON: ``rundir``).

Importing it registers ``freeze_at_exit`` (below) for the process.
"""

import atexit
import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path

from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec

import rundir

from .attention import attention_config
from .model import Laneformer
from .parallelize import parallelize_laneformer
from .state_dict_adapter import LaneformerStateDictAdapter


def freeze_at_exit() -> None:
    """At exit, collect what is garbage then (its finalizers run, its files flush) and freeze the rest.

    Python's finalization otherwise runs the cyclic garbage collector over every object that torch,
    Inductor and torchtitan made at import, several times as modules are cleared: ~1 s of each
    process's exit on a 2-core machine, paid by every rank of every start and every command (0.3-0.5 s
    after the freeze; the frozen objects are still freed by reference count). Registered at import,
    before any later handler, so it runs after them (atexit runs handlers last-in, first-out).
    """
    gc.collect()
    gc.freeze()


atexit.register(freeze_at_exit)

__all__ = [
    "NATIVE_FIELDS", "Laneformer", "laneformer_configs", "model_registry", "native_fields",
    "parallelize_laneformer", "read_native_config", "write_native_config",
]


def _2b() -> Laneformer.Config:
    """The published Laneformer 2B: exactly 2,320,069,632 parameters."""
    return Laneformer.Config(
        dim=3072, n_layers=15, n_heads=32, n_kv_heads=16, head_dim=96,
        ffn_hidden_dim=12288, vocab_size=32000, max_seq_len=4096, n_lanes=8, delay=2,
        window_size=2048, window_layers=list(range(10)),
    )


def _100m() -> Laneformer.Config:
    """~96M parameters with the 2B's lane and window structure, for GPU smoke runs."""
    return Laneformer.Config(
        dim=512, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=32,
        ffn_hidden_dim=2048, vocab_size=32000, max_seq_len=4096, n_lanes=8, delay=2,
        window_size=1024, window_layers=list(range(11)),
    )


def _tiny(n_lanes: int) -> Callable[[], Laneformer.Config]:
    def tiny() -> Laneformer.Config:
        """~2M parameters for CPU tests; window layers shorter than test sequences."""
        return Laneformer.Config(
            dim=128, n_layers=4, n_heads=8, n_kv_heads=n_lanes, head_dim=16,
            ffn_hidden_dim=512, vocab_size=4096, max_seq_len=1024, n_lanes=n_lanes, delay=2,
            window_size=32, window_layers=[0, 1],
        )

    return tiny


laneformer_configs: dict[str, Callable[[], Laneformer.Config]] = {
    "2B": _2b,
    "100M": _100m,
    "tiny": _tiny(8),
    "tiny-4lane": _tiny(4),
}


def model_registry(flavor: str, attn_backend: str = "auto", **overrides) -> ModelSpec:
    """The ModelSpec of a flavor with its attention kernel (``attention.BACKENDS``;
    "auto": flex with CUDA, dense-mask SDPA without) and ``Laneformer.Config``
    field overrides."""
    if flavor not in laneformer_configs:
        raise ValueError(f"unknown Laneformer flavor {flavor!r}; known: {sorted(laneformer_configs)}")
    config = dataclasses.replace(
        laneformer_configs[flavor](), inner_attention=attention_config(attn_backend), **overrides
    )
    return ModelSpec(
        name="laneformer",
        flavor=flavor,
        model=config,
        parallelize_fn=parallelize_laneformer,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=LaneformerStateDictAdapter,
    )


# The fields that define a model (what a recipe's [model] may override and
# laneformer_config.json holds): not torchtitan's generic ones, not the kernel.
NATIVE_FIELDS = tuple(
    f.name for f in dataclasses.fields(Laneformer.Config)
    if f.name not in {b.name for b in dataclasses.fields(BaseModel.Config)} | {"inner_attention"}
)


def native_fields(config: Laneformer.Config) -> dict:
    """The JSON-serialisable fields of a native config (what ``laneformer_config.json`` holds)."""
    return {n: getattr(config, n) for n in NATIVE_FIELDS}


def write_native_config(config: Laneformer.Config, folder: Path) -> None:
    rundir.write_model_config(folder, native_fields(config))


def read_native_config(path: Path, overrides: dict | None = None) -> Laneformer.Config:
    """The config in ``laneformer_config.json`` (the file, or a folder holding it), with field overrides."""
    return Laneformer.Config(**{**rundir.read_model_config(path), **(overrides or {})})
