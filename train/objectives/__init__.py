"""The objectives: one file each, one per run, chosen by the recipe (``Recipe.objective``, the one rule in
train.recipe.objective). Each is torchtitan's loss slot for its run and owns its batch inputs, its loss and
its normalisation, its metrics and what it does before step 1 (train.objectives.base says how).

A new objective is its file here and its line below (its table in the recipe names it: train.recipe.objective).
"""

from train.objectives.base import Objective, TrainerParts
from train.objectives.cross_entropy import CrossEntropy
from train.objectives.preference import Preference
from train.objectives.rl import Rl
from train.objectives.weighted_cross_entropy import WeightedCrossEntropy

OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (
    CrossEntropy,
    WeightedCrossEntropy,
    Preference,
    Rl,
)}

__all__ = ["OBJECTIVES", "Objective", "TrainerParts"]
