"""plan/comm.py: the bytes of each layout's collectives against the arithmetic done by hand
(nccl-tests' ring formulas on the 2B's parameter counts), and the overlap at its two limits.

The step's compute is a synthetic roofline (one op per FSDP unit and phase), so nothing is traced.
"""

from __future__ import annotations

import pytest

from train import recipe as R
from train.recipe import model_config
from plan.comm import Layout, candidate_layouts, cluster_for, communication
from plan.roofline import Op, Speed

GPUS, ACC = 192, 4
H100 = cluster_for("h100")  # 8 GPUs per node, 360 GB/s inside a node, 45 GB/s per GPU across nodes


@pytest.fixture(scope="module")
def config():
    return model_config(R.load("phase1.toml"))


@pytest.fixture(scope="module")
def counts(config):
    """(all parameters, the norm + head's, the embeddings'), counted from the model itself."""
    import torch

    with torch.device("meta"):
        model = config.build()
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())
    return count(model), count(model.norm, model.lm_head), count(model.tok_embeddings)


def speed(config, seconds_per_unit: float) -> Speed:
    """A roofline whose every FSDP unit computes ``seconds_per_unit`` forward and backward."""
    units = ["tok_embeddings", *(f"layers.{i}" for i in range(config.n_layers)), "lm_head"]
    ops = [Op(u, "mm", phase, 0, seconds_per_unit, 0.0) for u in units for phase in ("forward", "backward")]
    step = 2 * len(units) * seconds_per_unit
    return Speed(micro_batch_s=step, optimizer_s=0.0, accumulation=ACC, tokens_per_step=ACC * 2 * 4096,
                 flops_per_token=1, peak_flops=1.0, ops=ops)


def plan(config, layout, seconds_per_unit=0.0, gpus=GPUS):
    return communication(config, layout, speed(config, seconds_per_unit), H100, gpus=gpus, accumulation=ACC,
                         param_dtype="bfloat16", reduce_dtype="float32")


def test_fsdp_over_192_moves_the_issues_bytes_and_one_eighth_crosses_the_network(config, counts):
    n, (P, head, _) = GPUS, counts
    c = plan(config, Layout(1, GPUS))
    # per micro batch: bf16 gathered for the forward and again for the backward (not the head: it stays
    # gathered), fp32 reduce-scattered; each ring moves (n-1)/n of the buffer through every GPU
    bus = ACC * (n - 1) / n * (2 * P + 2 * (P - head) + 4 * P)
    assert c.intra_bytes + c.network_bytes == pytest.approx(bus, rel=1e-3)  # padding: < 0.1%
    assert 72e9 < bus < 74e9  # the issue's ~74 GB, less the head's second gather and the (n-1)/n
    assert c.network_bytes == pytest.approx(bus / 8, rel=1e-3)  # rings leave a node once per NIC
    assert c.by_kind["all-reduce"].seconds == 0


@pytest.mark.parametrize("reduce_grads, all_reduces", [("every_micro_batch", ACC), ("replicas_last_micro_batch", 1)])
def test_hsdp_keeps_gathers_and_scatters_in_the_node_and_all_reduces_shards_over_the_network(
        config, counts, reduce_grads, all_reduces):
    P, head, _ = counts
    c = plan(config, Layout(GPUS // 8, 8, reduce_grads=reduce_grads))
    assert c.intra_bytes == pytest.approx(ACC * 7 / 8 * (2 * P + 2 * (P - head) + 4 * P), rel=1e-9)
    assert c.network_bytes == pytest.approx(all_reduces * 2 * 23 / 24 * 4 * P / 8, rel=1e-9)
    assert c.held_bytes == (4 * P // 8 if reduce_grads == "replicas_last_micro_batch" else 0)


def test_deferring_every_reduction_and_keeping_parameters_gathered_trade_bytes_for_memory(config, counts):
    P, head, _ = counts
    n = GPUS
    c = plan(config, Layout(1, n, "never", "last_micro_batch"))
    bus = (n - 1) / n * (ACC * 2 * P + 4 * P)  # one gather per micro batch, one reduce-scatter per step
    assert c.intra_bytes + c.network_bytes == pytest.approx(bus, rel=1e-3)
    assert c.held_bytes == pytest.approx(4 * P, rel=1e-3)  # unsharded fp32 gradients
    assert c.gathered_bytes == pytest.approx(2 * (P - head), rel=1e-3)  # all but the head, gathered anyway
    always = plan(config, Layout(1, n, "always"))
    assert always.by_kind["all-gather"].intra == pytest.approx(ACC * 7 / 8 * (n - 1) / n * 4 * P, rel=1e-3)


def test_without_compute_nothing_is_hidden(config):
    for layout in candidate_layouts(GPUS, 8):
        c = plan(config, layout)
        assert c.exposed_s == pytest.approx(c.seconds, rel=1e-9), layout


def test_with_ample_compute_only_the_first_gather_and_the_last_reduction_are_exposed(config, counts):
    _, _, emb = counts  # the embeddings: the first unit of the forward, the last of the backward
    intra, net = 360e9, 45e9
    gather, scatter = 7 / 8 * 2 * emb / intra, 7 / 8 * 4 * emb / intra
    all_reduce = 2 * 23 / 24 * 4 * emb / 8 / net
    c = plan(config, Layout(GPUS // 8, 8, reduce_grads="replicas_last_micro_batch"), seconds_per_unit=1.0)
    assert c.exposed_s == pytest.approx(ACC * (gather + scatter) + all_reduce, rel=1e-9)
    assert c.step_s == pytest.approx(c.speed.step_s + c.exposed_s)
    # one window too short: the layer before the head hides the head's reduction and layer 13's gather
    short = plan(config, Layout(GPUS // 8, 8, reduce_grads="replicas_last_micro_batch"), seconds_per_unit=1e-6)
    assert short.exposed_s > c.exposed_s


def test_the_layouts_the_sweep_ranks():
    layouts = candidate_layouts(GPUS, 8)
    assert {(x.replicate, x.shard) for x in layouts} == {(1, 192), (24, 8)}
    assert len(layouts) == 3 * 2 + 3 * 3  # reshard policies x reductions (replicas_last_micro_batch: HSDP only)
    assert {(x.replicate, x.shard) for x in candidate_layouts(8, 8)} == {(1, 8)}


def test_cluster_flags_override_the_preset_and_bad_ones_are_refused(config):
    c = cluster_for("h100", gpus_per_node=4, network_gbs=25)
    assert (c.gpus_per_node, c.intra_node_gbs, c.network_gbs) == (4, 360, 25) and "network_gbs=25" in c.name
    assert cluster_for("a100").network_gbs == 22.5
    with pytest.raises(R.RecipeError, match="unknown cluster 'h100-eth'"):
        cluster_for("h100", "h100-eth")
    with pytest.raises(R.RecipeError, match="--network-gbs: must be > 0"):
        cluster_for("h100", network_gbs=0)
    with pytest.raises(R.RecipeError, match="--gpus 20 is not a whole number of nodes of 8 GPUs"):
        plan(config, Layout(1, 20), gpus=20)
    with pytest.raises(R.RecipeError, match=r"\[parallel\] shard: 12 neither fills whole nodes of 8 GPUs"):
        plan(config, Layout(2, 12), gpus=24)
