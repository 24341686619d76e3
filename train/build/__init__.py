"""From a resolved ``Recipe`` to a launch, in two jobs:

- ``checks``: every check a launch makes before anything is written (``preflight``; ``--dry-run``
  runs the same), the model's config (``train.recipe.model_config``'s) and the data opened as training
  will open them;
- ``config``: the checked recipe compiled into torchtitan's ``Trainer.Config`` (``trainer_config``).

The run's objective's part of both (its preflight questions, its loss and data loader) is its own
(train.objectives).
"""

from train.build.checks import (Preflight, check_chat_templates, check_data, initial_load, make_source_command,
                                preflight)
from train.build.config import callbacks, compile_cache, trainer_config, wandb_env, world_size

__all__ = ["Preflight", "callbacks", "check_chat_templates", "check_data", "compile_cache",
           "initial_load", "make_source_command", "preflight", "trainer_config", "wandb_env",
           "world_size"]
