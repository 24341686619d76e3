"""What silencing FSDP2's "returned a view tensor" warning assumes (models/laneformer/parallelize.py).

A lane block returns its residual stream as a view (``exchange.from_lanes``). FSDP2 warns that an
in-place op on such a view would drop its pre-backward hook: the next block's parameters would not
be gathered for backward and the gradients would be wrong. Here the tiny model runs forward and
backward under FSDP2 (torchtitan's units, through ``apply_fsdp``) and unwrapped, from the same
weights and batch: every gradient must agree, and the one warning silenced is the only one hidden.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from models.laneformer import model_registry
from models.laneformer.parallelize import apply_fsdp


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_gradients_equal_the_unwrapped_model_and_only_the_view_warning_is_silenced():
    config = model_registry("tiny", attn_backend="dense").model
    torch.manual_seed(0)
    plain = config.build()
    plain.init_states()
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fsdp(sharded, mesh, MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
                   "default", shard_degree=1)
        for module in sharded.modules():  # gloo has no PREMUL_SUM (as train/cpu.py sets for training)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
        tokens = torch.randint(3, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        for model in (plain, sharded):
            model(tokens).float().logsumexp(-1).mean().backward()
    views = [w for w in caught if "returned a view tensor" in str(w.message)]
    assert not views, views[0].message
    for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # The filter is exact: the same warning for another module still shows.
    with warnings.catch_warnings(record=True) as other:
        warnings.warn("FSDP2-wrapped module (FSDPLinear) returned a view tensor. ...", UserWarning)
    assert other
