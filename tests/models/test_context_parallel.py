"""Context parallelism (``[parallel] context_parallel``): CP 2 computes what CP 1 computes, and a recipe
asks for it only where it can work.

torchtitan 0.3.0's CP runs on CPU with gloo: ``apply_cp_to_forward`` gathers keys and values
(``flex_cp_allgather``, an all-gather), and torch compiles the sliced BlockMask with Inductor's CPU
backend (``_create_cp_block_mask``). So the whole training path is tested here, on 2 ranks, at a
length where document boundaries and the window layers' 32-token windows fall inside and across the
slices (tests/models/context_parallel_ranks.py says how).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rundir import REPO
from tests.conftest import env, metrics, poisoned_command
from train import recipe as R

RANKS = Path(__file__).with_name("context_parallel_ranks.py")
# tiny.toml at a length CP 2 can cut, without in-loop evaluation
CP2 = ["parallel.context_parallel=2", "training.seq_len=256", "eval.every=0", "eval.at_end=false"]


@pytest.mark.slow
def test_cp2_logits_gradients_and_one_step_equal_cp1_with_window_and_document_masks_and_loss_weights():
    """The rank script (RANKS) as bench.gpu_check's check 5 runs it on CPU (2 gloo ranks): the one run of it in the
    suite (tests/bench/test_gpu_check.py runs gpu_check's other checks)."""
    from bench.gpu_check import CONTEXT_PARALLEL_RANKS, check_context_parallel

    assert CONTEXT_PARALLEL_RANKS == RANKS
    checked = check_context_parallel(cpu=True)
    assert checked == {"result": "equal: logits, gradients, one step", "ok": True}, checked["result"]


@pytest.mark.slow
def test_training_with_cp2_logs_what_two_fsdp_ranks_log_and_skips_a_spike_on_one_slice(tmp_path):
    """train.py end to end (the masks built before slicing, the code source's loss weights cut with the
    tokens: LaneformerTrainer.post_dataloading_process): 2 ranks as CP 2 against 2 ranks as FSDP 2, the same
    global batches, on a weighted mixture (code tokens count 3 times: the weighted objective). Both shard the parameters over 2
    ranks, so both start from the same initial weights: a one-rank run's differ (its step-1 loss, computed
    before any update, was 8.7945 against 8.7933 here).

    Step 2 goes NaN on rank 0 only: under CP, in rank 0's slice of the sequences, the harder case for the
    spike guard (rank 1's own loss is finite). The guard reads the loss summed over the CP slices, so both
    ranks skip the update, and steps 3-4 log what the FSDP run logs after skipping the same step."""
    sets = [*CP2[1:], "training.steps=4", "logging.interval=1", "training.global_batch=4", "training.micro_batch=2",
            "schedule.warmup_steps=1", "data.sources.code.loss_weight=3"]
    # micro batches a step on each rank: FSDP 2, one (2 data-parallel ranks); CP 2, two (one data-parallel rank)
    logged, rows = {}, {}
    for name, extra, step2 in (("fsdp2", [], 2), ("cp2", [CP2[0]], 3)):
        cmd = poisoned_command(tmp_path, "tiny.toml", f"run.output_dir={tmp_path / name}", *sets, *extra,
                               calls={step2}, ranks={0}, nproc=2)
        run = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        assert "step 2: skipped (non-finite loss (nan))" in run.stdout + run.stderr
        rows[name] = metrics(tmp_path / name)
        logged[name] = [(step, row["loss_metrics/global_avg_loss"], row["grad_norm"], row["loss_metrics/global_max_loss"])
                        for step, row in sorted(rows[name].items()) if "grad_norm" in row]
    assert [row[0] for row in logged["cp2"]] == [1, 3, 4]
    assert [row[:3] for row in logged["cp2"]] == [pytest.approx(row[:3], rel=1e-5) for row in logged["fsdp2"]]
    assert [rows[name][s]["skipped_steps"] for name in rows for s in (1, 2, 4)] == [0, 1, 1] * 2
    # One data-parallel rank: its loss, summed over its CP slices, is the global mean.
    assert [row[3] for row in logged["cp2"]] == pytest.approx([row[1] for row in logged["cp2"]], rel=1e-6)


def test_the_degree_reaches_torchtitan_and_the_data_parallel_layout():
    """The CP ranks of a sequence are one data-parallel rank: shard x replicate is the world over CP."""
    from train.build import trainer_config

    recipe = R.load("tiny.toml", [*CP2, "parallel.replicate=-1", "parallel.shard=2"])
    config = trainer_config(recipe, 8)
    assert config.parallelism.context_parallel_degree == 2
    # 8 ranks: 4 data-parallel ranks of 2 CP ranks each, 2 shards x 2 replicas
    assert config.parallelism.data_parallel_replicate_degree == 2 and R.dp_degrees(recipe, 8) == (2, 2)
    with pytest.raises(R.RecipeError, match=r"tiny.toml: \[parallel\] context_parallel: 2 does not divide the 3 ranks"):
        R.dp_degrees(recipe, 3)


@pytest.mark.parametrize("sets, why", [
    (["parallel.context_parallel=2"],
     r"tiny.toml: \[parallel\] context_parallel: 2 needs \[training\] seq_len \(128\) to be a multiple of 2 x 128"),
    (CP2[:2], r"tiny.toml: \[parallel\] context_parallel: 2 with in-loop evaluation \(\[eval\] every, at_end\)"),
    (["parallel.context_parallel=0"], r"\[parallel\] context_parallel: must be >= 1 \(got 0\)"),
])
def test_a_recipe_that_cp_cannot_run_is_refused_at_load_naming_file_and_field(sets, why):
    """At load, not as torch's NotImplementedError (or a shape error in an eval) on the first step."""
    with pytest.raises(R.RecipeError, match=why):
        R.load("tiny.toml", sets)
