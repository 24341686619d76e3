"""Context parallelism, then activation checkpointing, then torch.compile per block, then FSDP2 (or HSDP)
per block.

Reuses torchtitan's CP, AC and compile unchanged. Laneformer needs no tensor or
pipeline parallelism (its lanes are the tensor axis, kept inside one replica
for training), so it runs on torchtitan's ``partial_dtensor`` backend, which
shards with plain FSDP2 and needs no per-parameter sharding declarations.

With ``parallelism.data_parallel_replicate_degree`` > 1 the mesh is torchtitan's
2-D ``(dp_replicate, fsdp)``: FSDP2 shards inside each ``fsdp`` group (a node, for
HSDP) and all-reduces gradients across replicas; ``fsdp_reshard_after_forward``
is torchtitan's policy. When gradients are reduced during accumulation is the
trainer's switch (``LaneformerTrainer._reduce_grads_now``).

With ``parallelism.context_parallel_degree`` > 1 (CP) each rank of a ``cp`` group holds a slice of
every sequence, in torchtitan's head-tail order. CP is torchtitan's ``partial_dtensor`` path for
FlexAttention (``apply_cp_to_forward``, as its llama3): each attention gathers the whole sequence's
keys and values and runs on its own queries, under a BlockMask that torch rebuilt for them from the
model's ``mask_mod`` (``_create_cp_block_mask``), so window and document masks hold across the
slices. The CPU kernel (``DenseMaskFlexAttention``) is a FlexAttention and reads the same rebuilt
``mask_mod``. The masks are built from the whole sequence before the batch is sliced
(``Laneformer.attention_masks``, passed as ``attention_masks``). FSDP shards over ``dp_shard x cp``
(torchtitan's ``fsdp`` mesh), so gradients are summed over the slices too.

FSDP follows torchtitan's ``apply_fsdp_to_decoder`` for a dense decoder
(embeddings, blocks, norm + head together, then the root; gradient division
left to the loss) with one difference it has no hook for: a lane weight
``[L, out, in]`` has only ``L`` (8) rows on dim 0, so on more than ``L`` ranks
FSDP's default ``Shard(0)`` leaves most ranks holding padding (on 192 GPUs:
24x padded all-gather and reduce-scatter buffers and traffic). Lane weights
are then sharded on dim 1, as torchtitan shards MoE expert weights once the
FSDP degree exceeds the number of experts.
"""

import warnings

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp_to_forward
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy

from .model import Laneformer


def parallelize_laneformer(
    model: Laneformer,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
) -> Laneformer:
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            "Laneformer runs with parallelism.spmd_backend='partial_dtensor' "
            f"(got {parallelism.spmd_backend!r})"
        )
    if parallel_dims.cp_enabled:
        apply_cp_to_forward([block.attention.inner_attention for block in model.layers.values()],
                            parallel_dims.get_mesh("cp"))
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp(
        model,
        parallel_dims.get_mesh(names),
        MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        ),
        parallelism.fsdp_reshard_after_forward,
        shard_degree=parallel_dims.get_mesh("fsdp").size(),
        cpu_offload=training.enable_cpu_offload,
    )
    return model


def lane_placement(n_lanes: int, shard_degree: int):
    """FSDP's ``shard_placement_fn``: ``Shard(1)`` for lane weights once the degree exceeds the lanes."""
    if shard_degree <= n_lanes:
        return None
    return lambda param: Shard(1) if param.ndim == 3 else None


def fsdp_units(model: Laneformer, reshard_policy: str) -> list[tuple[str, list[nn.Module], bool]]:
    """The groups of modules FSDP2 shards as one unit (one all-gather, one reduce-scatter), in forward
    order, with whether each is resharded after forward (and gathered again for backward). The
    communication plan (plan/comm.py) counts its collectives from the same list."""
    after = get_fsdp_reshard_after_forward_policy(reshard_policy, pp_enabled=False)
    return [
        ("tok_embeddings", [model.tok_embeddings], after),
        *((f"layers.{name}", [block], after) for name, block in model.layers.items()),
        # The head is needed right after the last block: resharded after forward only under "always" (as torchtitan).
        ("norm+lm_head", [model.norm, model.lm_head], reshard_policy == "always"),
    ]


def apply_fsdp(model: Laneformer, mesh, mp_policy: MixedPrecisionPolicy, reshard_policy: str,
               *, shard_degree: int, cpu_offload: bool = False) -> None:
    config = {"mesh": mesh, "mp_policy": mp_policy}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    placement = lane_placement(model.config.n_lanes, shard_degree)  # None for parameters that are not lane weights
    # FSDP2 warns, for every block at every step, that a block returned a view: the residual stream is
    # stored lanes first and returned as its [B, S, L, D] view (exchange.from_lanes; a copy would be one
    # more pass over a lane-wide tensor per layer). The danger it names is an in-place op on that view;
    # the model only adds out of place, and tests/models/test_fsdp_view_output.py checks every
    # gradient under FSDP2 against the unwrapped model. Only this warning, for this module, is silenced.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPLaneBlock\) returned a view tensor",
                            category=UserWarning)
    for _, modules, reshard_after_forward in fsdp_units(model, reshard_policy):
        fully_shard(modules if len(modules) > 1 else modules[0], **config,
                    reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)
