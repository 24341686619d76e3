"""Every test runs offline: no Hugging Face Hub, no wandb server."""

import os

import pytest

from tests.helpers import reference_losses

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of one uninterrupted, deterministic 2-rank tiny run (tests.helpers.SHORT), made
    once per session: the launcher, SLURM and kill-and-resume tests all compare against it."""
    return reference_losses(tmp_path_factory)
