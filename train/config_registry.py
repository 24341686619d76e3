"""Runnable ``Trainer.Config`` functions, torchtitan's ``config_registry`` convention.

    torchrun -m torchtitan.train --module train --config laneformer_tiny

torchtitan imports ``<module>.config_registry``. Each function compiles one of
the repo's recipes, so torchtitan's own entry point and ``train.py`` run
exactly the same job (``train.py`` adds the up-front checks, ``--set`` and the
per-launch snapshot).
"""

from train.titan import use_cpu_if_no_gpu
from train.recipe import load
from train.trainer import LaneformerTrainer


def _from_recipe(name: str) -> LaneformerTrainer.Config:
    use_cpu_if_no_gpu()
    from train.build import trainer_config, world_size

    return trainer_config(load(name), world_size())


def laneformer_tiny() -> LaneformerTrainer.Config:
    return _from_recipe("tiny.toml")


def laneformer_tiny_phase2() -> LaneformerTrainer.Config:
    return _from_recipe("tiny-phase2.toml")


def laneformer_2b_phase1() -> LaneformerTrainer.Config:
    return _from_recipe("phase1.toml")


def laneformer_2b_phase2() -> LaneformerTrainer.Config:
    return _from_recipe("phase2.toml")
