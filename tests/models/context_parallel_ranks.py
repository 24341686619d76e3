"""One training step of the tiny Laneformer with context parallelism 2 against the same step without it.

Run by tests/models/test_context_parallel.py under ``torchrun --nproc-per-node 2`` (gloo, the dense-mask
kernel) and by bench/gpu_check.py on 2 GPUs (NCCL, flex: torchtitan's GPU path). Every rank
computes the reference itself (CP 1: the whole batch, the model unwrapped), then the CP 2 step through
the training path: ``parallelize_laneformer`` with a ``cp`` mesh (torchtitan's ``apply_cp_to_forward``,
FSDP2 over ``dp_shard x cp``), the masks of the whole sequence (``Laneformer.attention_masks``) sliced
with the tokens by torchtitan's ``prepare_context_parallel_input`` (head-tail order), the tokens' loss
weights cut the same way by the trainer's ``cut_like_tokens``, the loss the trainer's weighted objective
(train.objectives.weighted_cross_entropy) over this rank's slice divided by the batch's summed weights.
The weights differ by document (1, 0.5, 3), so a slice of the weights that is not the tokens' moves the
gradients. Logits (put back in order by torch's ``context_parallel_unshard``), gradients and the logits
after one AdamW step must match.
Prints ``CP OK`` on rank 0 when everything matched.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer, context_parallel_unshard

from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel import prepare_context_parallel_input

from data.mixture import LOSS_WEIGHTS
from models.laneformer import model_registry
from models.laneformer.parallelize import parallelize_laneformer
from train.objectives.weighted_cross_entropy import WeightedCrossEntropy
from train.titan import use_cpu_if_no_gpu
from train.trainer import cut_like_tokens

CP = 2
SEQ = 256  # torch's CP BlockMask needs seq_len divisible by CP x 128 (_create_cp_block_mask)
# Documents of each row (positions restart at 0): every boundary falls inside a head-tail chunk of
# SEQ / (2 CP) = 64 tokens, and the tiny model's 32-token windows (layers 0, 1) cross chunk and rank edges.
DOCS = ([40, 60, 50, 70, 36], [100, 20, 136])
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def batch(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, positions, loss weights) of a batch of 2 packed rows, the same on every rank."""
    assert all(sum(row) == SEQ for row in DOCS)
    tokens = torch.randint(3, vocab, (len(DOCS), SEQ + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    weights = torch.stack([torch.cat([torch.full((n,), (1.0, 0.5, 3.0)[i % 3]) for i, n in enumerate(row)])
                           for row in DOCS])
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device), positions.to(device), weights.to(device)


def step(model, tokens, labels, positions, attention_masks, weights, denominator):
    """Forward, the weighted objective's loss over ``denominator``, backward, one AdamW step; the logits
    before it and the parameter gradients (whole tensors). The optimizer's eps is large enough that a
    gradient that rounds differently near 0 cannot flip an update."""
    logits = model(tokens, positions=positions, attention_masks=attention_masks)
    loss, _ = WeightedCrossEntropy(WeightedCrossEntropy.Config())(logits, labels, denominator, **{LOSS_WEIGHTS: weights})
    loss.backward()
    grads = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    return logits.detach(), grads


def main() -> None:
    cpu = use_cpu_if_no_gpu()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl")
    config = model_registry("tiny").model  # the kernel of the device: dense-mask SDPA on CPU, flex on CUDA
    assert set(config.window_layers) and config.window_size < SEQ // (2 * CP)
    torch.manual_seed(0)
    with device:
        reference = config.build()
    reference.init_states()
    sliced = copy.deepcopy(reference)
    tokens, labels, positions, weights = batch(config.vocab_size, device)
    masks = reference.attention_masks(tokens, positions)

    # CP 1: the whole batch on one rank.
    ref_logits, ref_grads = step(reference, tokens, labels, positions, masks, weights, weights.sum())
    after = reference(tokens, positions=positions)
    # The test can see a window replaced by plain causal (accelerate#4177): that changes the logits by far
    # more than the tolerance.
    causal = reference.attention_masks(tokens, None)
    causal = {window: causal[None] for window in causal}
    assert (reference(tokens, positions=positions, attention_masks=causal) - after).abs().max() > 1e-2

    # CP 2: the training path.
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=CP, tp=1, pp=1, ep=1, world_size=CP,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    parallelism = ParallelismConfig(context_parallel_degree=CP, spmd_backend="partial_dtensor")
    parallelize_laneformer(
        sliced, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="")
    for module in sliced.modules():  # gloo has no PREMUL_SUM (train/cpu.py sets the same for training)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    mesh = dims.get_mesh("cp")
    whole_masks = sliced.attention_masks(tokens, positions)
    local_tokens, local_labels, kwargs = prepare_context_parallel_input(
        tokens, labels, {"positions": positions, "attention_masks": whole_masks}, mesh, device, "headtail")
    local_weights = cut_like_tokens({LOSS_WEIGHTS: weights}, whole_masks, mesh, parallelism)[LOSS_WEIGHTS]
    assert local_tokens.shape[1] == local_weights.shape[1] == SEQ // CP
    logits, grads = step(sliced, local_tokens, local_labels, kwargs["positions"], kwargs["attention_masks"],
                         local_weights, weights.sum())
    balancer = _HeadTailLoadBalancer(SEQ, CP, device)  # the order torchtitan's "headtail" sliced in

    def whole(local):
        return context_parallel_unshard(mesh, [local], [1], balancer)[0]

    torch.testing.assert_close(whole(logits), ref_logits, **TOLERANCE, msg="logits, CP 2 vs CP 1")
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOLERANCE, msg=f"gradient of {name}, CP 2 vs CP 1")
    local_tokens, _, kwargs = prepare_context_parallel_input(
        tokens, labels, {"positions": positions, "attention_masks": sliced.attention_masks(tokens, positions)},
        mesh, device, "headtail")
    with torch.no_grad():
        again = sliced(local_tokens, positions=kwargs["positions"], attention_masks=kwargs["attention_masks"])
    torch.testing.assert_close(whole(again), after.detach(), **TOLERANCE, msg="logits after one step, CP 2 vs CP 1")
    if int(os.environ["RANK"]) == 0:
        print("CP OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
