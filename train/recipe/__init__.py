"""The recipe: one TOML file per run, typed, checked and resolved once, before anything starts.

A recipe has the tables of ``schema.Recipe``. Every key is checked against its declared type;
unknown keys, wrong types and impossible values raise ``RecipeError`` naming the file, the table and
the key (and the closest valid key on a typo). ``--set table.key=value`` overrides
(``rundir.parse_set``'s grammar) go through the same checks.

Sizes may be given in steps or in tokens (``total_tokens`` / ``steps``, ``global_batch`` /
``global_batch_tokens``, ``warmup_steps`` / ``warmup_tokens``): exactly one of each pair.
``[[data.sources]]`` parse straight into ``data.mixture.SourceSpec``. ``[data] chat_template`` is
resolved to the one template the run uses (see data.chat for the order) and checked to exist, so
the resolved recipe says which.

By job:

- ``schema``: the tables, each checking its own values in ``__post_init__``, as torchtitan's configs do;
- ``loading``: the file, the overrides, the key and type checks (``load``), and the TOML written back;
- ``checks``: what holds across tables, paths made absolute (``resolve``, once per load), and what is
  asked of a resolved recipe later (``check_world``, ``check_needs``);
- ``model``: the ``[model]`` table built into the flavor's ``ModelSpec`` and ``Laneformer.Config``
  (``model_spec``, ``model_config``), the one place a recipe becomes a model config. It imports torch, so
  it is imported on first use: loading a recipe stays torch-free.
"""

import importlib
from typing import TYPE_CHECKING

from train.recipe.checks import check_needs, check_world, dp_degrees, in_data_root, validation_sets
from train.recipe.loading import DATA_ROOT_ENV, RECIPES, check_keys, check_value, find, key_parts, load, to_toml
from train.recipe.schema import (REDUCE_GRADS, REPO, Checkpoint, Data, Eval, Launch, Logging, Model, Optimizer,
                                 Parallel, Preference, Recipe, RecipeError, Run, Schedule, TableError, Training,
                                 absolute)

if TYPE_CHECKING:  # exported through __getattr__
    from train.recipe.model import model_config, model_spec

__all__ = ["DATA_ROOT_ENV", "RECIPES", "REDUCE_GRADS", "REPO", "Checkpoint", "Data", "Eval", "Launch", "Logging",
           "Model", "Optimizer", "Parallel", "Preference", "Recipe", "RecipeError", "Run", "Schedule", "TableError",
           "Training", "absolute", "check_keys", "check_needs", "check_value", "check_world", "dp_degrees", "find",
           "in_data_root", "key_parts", "load", "model_config", "model_spec", "to_toml", "validation_sets"]

_LAZY = {"model_config": "model", "model_spec": "model"}  # torch's: imported on first use


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
