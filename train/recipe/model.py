"""The model a recipe names: its ``[model]`` flavor with the overrides, checked and built into the
flavor's ``ModelSpec`` (``model_spec``) and ``Laneformer.Config`` (``model_config``). The one owner of
that step: the build, the planner, the report and the launcher ask it here.

Imports torch (through the model), so the package exports it on first use (``train.recipe.__getattr__``).
"""

from __future__ import annotations

import typing

from torchtitan.protocols.model_spec import ModelSpec

from models.laneformer import NATIVE_FIELDS, Laneformer, laneformer_configs, model_registry
from train.recipe.loading import check_keys, check_value
from train.recipe.schema import Recipe, RecipeError


def model_spec(recipe: Recipe) -> ModelSpec:
    """The flavor's ModelSpec with the recipe's ``[model]`` overrides, each checked against
    ``Laneformer.Config``'s type hints by the recipe's own checker."""
    m, path = recipe.model, recipe.path
    if m.flavor not in laneformer_configs:
        raise RecipeError(f"{path}: [model] flavor: unknown {m.flavor!r}; known: {sorted(laneformer_configs)}")
    check_keys(m.overrides, NATIVE_FIELDS, path, "[model]")
    hints = typing.get_type_hints(Laneformer.Config)
    overrides = {k: check_value(v, hints[k], path, "model", k) for k, v in m.overrides.items()}
    try:
        return model_registry(m.flavor, **overrides)
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{path}: [model] {e}") from e


def model_config(recipe: Recipe) -> Laneformer.Config:
    return model_spec(recipe).model
