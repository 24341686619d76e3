"""From a resolved ``Recipe`` to a launch, in two jobs:

- ``checks``: every check a launch makes before anything is written (``preflight``; ``--dry-run``
  runs the same), the model's config and the data opened as training will open them;
- ``config``: the checked recipe compiled into torchtitan's ``Trainer.Config`` (``trainer_config``).

A preference run's part of both is ``train.preference.build``'s.
"""

from train.build.checks import (Preflight, check_chat_templates, check_data, initial_load, make_source_command,
                                model_config, model_spec, preflight)
from train.build.config import callbacks, compile_cache, trainer_config, wandb_env

__all__ = ["Preflight", "callbacks", "check_chat_templates", "check_data", "compile_cache",
           "initial_load", "make_source_command", "model_config", "model_spec", "preflight", "trainer_config",
           "wandb_env"]
