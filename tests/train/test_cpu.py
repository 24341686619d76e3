"""train.cpu and train.titan.use_cpu_if_no_gpu: the CPU-only adjustments that let torchtitan's Trainer run here.

The trainer itself runs on CPU in tests/train/test_train.py; the CPU attention
kernel is tested in tests/models/test_attention.py.
"""

import sys

import pytest

from models.laneformer.attention import DenseMaskFlexAttention
from train.cpu import adapt_config, has_gpu
from train.titan import use_cpu_if_no_gpu

cpu_only = pytest.mark.skipif(has_gpu(), reason="tests the CPU-only path")


@cpu_only
def test_use_cpu_patches_already_imported_modules():
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    import torchtitan.trainer  # noqa: F401

    assert use_cpu_if_no_gpu() is True
    assert use_cpu_if_no_gpu() is True  # idempotent
    for module in (tt_utils, metrics, dist_utils):
        assert module.device_type == "cpu"
        assert module.device_module is tt_utils.device_module
    leftover = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("torchtitan")
        and module is not None
        and vars(module).get("device_type") == "cuda"
    ]
    assert leftover == []


@cpu_only
def test_tiny_recipe_gets_cpu_settings():
    from train import recipe as R
    from train.build import trainer_config

    config = trainer_config(R.load("tiny.toml"), 1)
    assert type(config.model_spec.model.inner_attention) is DenseMaskFlexAttention.Config
    assert config.training.mixed_precision_param == "float32"
    assert config.training.disable_cuda_graphs
    assert config.comm.train_timeout_seconds >= 600
    fn = config.model_spec.parallelize_fn
    assert adapt_config(config).model_spec.parallelize_fn is fn  # idempotent
