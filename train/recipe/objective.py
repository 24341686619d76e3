"""Which objective a recipe trains: the one answer to "what kind of run is this?".

A run trains one objective (train.objectives): ``preference`` when ``[preference] loss`` is set,
``rl`` when ``[rl] tasks`` is set (reinforcement learning on code, issue 59), ``weighted_cross_entropy`` when a source weighs its tokens (``[[data.sources]] loss_weight`` other than 1),
else ``cross_entropy``. The recipe checks, the build, the planner, the report and the callbacks ask
``Recipe.objective`` (or ``objective_of`` on a run's ``recipe.toml``), never the tables behind it;
tests/train/test_one_pass.py holds every other spelling out. Torch-free: the sweep launcher reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CROSS_ENTROPY = "cross_entropy"
WEIGHTED_CROSS_ENTROPY = "weighted_cross_entropy"
PREFERENCE = "preference"
RL = "rl"
OBJECTIVE_NAMES = (CROSS_ENTROPY, WEIGHTED_CROSS_ENTROPY, PREFERENCE, RL)


def objective_of(recipe: Mapping[str, Any]) -> str:
    """The objective of a resolved recipe in its TOML form (a run's ``recipe.toml``; ``Recipe.objective``
    hands its own tables here)."""
    if (recipe.get("preference") or {}).get("loss"):
        return PREFERENCE
    if (recipe.get("rl") or {}).get("tasks"):
        return RL
    if any(s.get("loss_weight", 1.0) != 1 for s in (recipe.get("data") or {}).get("sources", [])):
        return WEIGHTED_CROSS_ENTROPY
    return CROSS_ENTROPY
