"""Activation checkpointing, then torch.compile per block, then FSDP2 per block.

Reuses torchtitan's machinery unchanged. Laneformer needs no tensor or
pipeline parallelism (its lanes are the tensor axis, kept inside one replica
for training), so it runs on torchtitan's ``partial_dtensor`` backend, which
shards with plain FSDP2 and needs no per-parameter sharding declarations.
"""

from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

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
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp_to_decoder(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
    )
    return model
