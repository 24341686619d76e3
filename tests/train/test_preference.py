"""The preference objective by hand, the pair loader's order and rows, the reference cache's key and
its errors (train.preference). The runs themselves: tests/e2e/test_preference.py."""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import rundir
from data.mixture import IGNORE_INDEX
from tests.conftest import tiny_random_model
from tests.train.pair_sources import write_pair_source
from train.preference import reference
from train.preference.loss import PreferenceLoss, sequence_logps
from data.pairs import PairError
from data.pairs_loader import PairLoader, PairSet

X = IGNORE_INDEX


def test_dpo_equals_torchtune_case_by_hand():
    """torchtune's test case (tests/torchtune/rlhf/loss/test_dpo_loss.py): logits beta x (pi - ref) are
    0.1 x [0, 10, 20], so the losses are -log sigmoid([0, 1, 2])."""
    policy_chosen, policy_rejected = torch.tensor([-0.5, -10.0, -1.0]), torch.tensor([-0.1, -30.0, -21.0])
    ref_chosen, ref_rejected = torch.tensor([-0.5, -10.1, -0.1]), torch.tensor([-0.1, -20.1, -0.1])
    losses, chosen, rejected = PreferenceLoss("dpo", 0.1, 0.0, 0.0)(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    assert losses.tolist() == pytest.approx([0.6931, 0.3133, 0.1269], abs=1e-4)
    assert losses.tolist() == pytest.approx([math.log(2), math.log(1 + math.exp(-1)), math.log(1 + math.exp(-2))],
                                            rel=1e-6)
    assert chosen.tolist() == pytest.approx([0.0, 0.01, -0.09], abs=1e-6)  # 0.1 x (policy - reference)
    assert rejected.tolist() == pytest.approx([0.0, -0.99, -2.09], abs=1e-6)
    # label smoothing 0.2 (conservative DPO): 0.8 x -log sigmoid(z) + 0.2 x -log sigmoid(-z)
    smoothed, _, _ = PreferenceLoss("dpo", 0.1, label_smoothing=0.2, gamma=0.0)(policy_chosen, policy_rejected, ref_chosen,
                                                                     ref_rejected)
    z = 2.0
    assert float(smoothed[2]) == pytest.approx(0.8 * math.log(1 + math.exp(-z)) + 0.2 * math.log(1 + math.exp(z)))


def two_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits over a 2-id vocabulary where p(0) is 3/4 ([ln 3, 0]) or 1/2 ([0, 0]); the chosen row's
    answer is ids (0, 1): log-probs ln 3/4 and ln 1/2; the rejected row's is (1, 1): ln 1/4 twice."""
    a, h = [math.log(3), 0.0], [0.0, 0.0]
    logits = torch.tensor([[a, h, h], [h, a, a]])
    labels = torch.tensor([[0, 1, X], [X, 1, 1]])
    return logits, labels


def test_sequence_logps_sum_and_mean_over_the_answer_in_fp32():
    logits, labels = two_rows()
    total = sequence_logps(logits, labels, average=False)
    assert total.tolist() == pytest.approx([math.log(3 / 8), math.log(1 / 16)], rel=1e-6)
    mean = sequence_logps(logits.to(torch.bfloat16), labels, average=True)
    assert mean.dtype == torch.float32  # upcast before log-softmax (TRL #878)
    assert mean.tolist() == pytest.approx([math.log(3 / 8) / 2, math.log(1 / 4)], rel=1e-2)  # bf16 logits


def test_dpo_norm_and_dpo_by_hand():
    """Equal reference log-probs on both sides: the logit is beta x (chosen - rejected). Means: the
    difference is ln(sqrt(3/8) / (1/4)) = ln sqrt 6, so the loss is ln(1 + 1/sqrt 6); sums: ln 6, ln(7/6)."""
    logits, labels = two_rows()
    ref = torch.tensor([-1.0])
    mean = sequence_logps(logits, labels, average=True)
    losses, chosen, rejected = PreferenceLoss("dpo_norm", 1.0, 0.0, 0.0)(mean[:1], mean[1:], ref, ref)
    assert float(losses[0]) == pytest.approx(math.log(1 + 1 / math.sqrt(6)), rel=1e-6)
    assert float(chosen[0] - rejected[0]) == pytest.approx(math.log(math.sqrt(6)), rel=1e-6)
    total = sequence_logps(logits, labels, average=False)
    losses, _, _ = PreferenceLoss("dpo", 1.0, 0.0, 0.0)(total[:1], total[1:], ref, ref)
    assert float(losses[0]) == pytest.approx(math.log(7 / 6), rel=1e-6)


def test_simpo_by_hand_needs_no_reference():
    """SimPO: -log sigmoid(beta x (chosen - rejected) - gamma) on mean log-probs: 2 x (-1 - -2) - 0.5 = 1.5;
    rewards beta x log-probs."""
    losses, chosen, rejected = PreferenceLoss("simpo", 2.0, label_smoothing=0.0, gamma=0.5)(torch.tensor([-1.0]), torch.tensor([-2.0]))
    assert float(losses[0]) == pytest.approx(math.log(1 + math.exp(-1.5)), rel=1e-6)
    assert (float(chosen[0]), float(rejected[0])) == (-2.0, -4.0)
    with pytest.raises(ValueError, match="unknown preference loss 'ipo'"):
        PreferenceLoss("ipo", 0.1, 0.0, 0.0)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return write_pair_source(root / "train", 10, seed=0), write_pair_source(root / "more", 3, seed=1, shards=1)


def test_held_out_pairs_are_scored_with_the_loss_the_trainer_trains_with(sources):
    """The preference objective scores held-out pairs (its ``evaluate``, the eval callback's part) with the loss
    it trains with (built once): the policy as its own reference gives ln 2 on every pair and wins none (ties)."""
    from types import SimpleNamespace

    from train import recipe as R
    from train.callbacks.eval import Eval
    from train.objectives.preference import Preference
    from train.preference.metrics import EVAL_ACCURACY, EVAL_LOSS

    model, pairs, cpu = tiny_random_model(), PairSet([sources[1]], seq_len=32), torch.device("cpu")
    logps = torch.from_numpy(reference.pair_logps(model, pairs, local_pairs=2, average=False, device=cpu))
    objective = Preference(Preference.Config(preference=R.Preference(loss="dpo", held_out=[str(sources[1])])))
    assert objective.evaluates and objective.loss.beta == 0.1
    objective.held_out_pairs, objective.local_pairs, objective.reference = pairs, 2, {"held_out": logps}
    trainer = SimpleNamespace(model_parts=[model], device=cpu, objective=objective)
    [(name, part)] = Eval.objective_part(trainer).items()
    scored = part(trainer)
    assert scored[EVAL_LOSS] == pytest.approx(math.log(2), rel=1e-6) and scored[EVAL_ACCURACY] == 0.0


def test_pair_rows_are_chosen_then_rejected_with_answer_labels_and_padding_of_its_own(sources):
    pairs = PairSet([sources[0]], seq_len=32)
    shard = pairs.sources[0].shards[0]
    rows = pairs.rows(np.array([1, 0]))
    for row, doc in ((0, 2), (1, 0), (2, 3), (3, 1)):  # chosen of pairs 1 and 0, then their rejected
        tokens, mask = shard.document(doc).astype(np.int64), np.asarray(shard.loss[shard.doc_ends[doc - 1] if doc else 0:
                                                                                    shard.doc_ends[doc]])
        n = len(tokens) - 1
        assert rows["input_ids"][row, :n].tolist() == tokens[:-1].tolist()
        assert rows["labels"][row, :n].tolist() == [t if m else X for t, m in zip(tokens[1:], mask[1:])]
        assert (rows["labels"][row, n:] == X).all()
        assert rows["positions"][row].tolist() == [*range(n), *range(32 - n)]  # the padding starts a document
    assert PairSet(list(sources), seq_len=32).describe(11) == \
        f"pair 11 ({sources[1] / '00000_unshuffled.ds'}, documents 2 and 3)"


def test_pair_loader_visits_each_pair_once_an_epoch_splits_ranks_and_resumes(sources):
    pairs = PairSet(list(sources), seq_len=32)  # 13 pairs: one table over both sources
    one = PairLoader(pairs, local_batch_size=4, seed=7)  # 2 pairs a micro batch
    seen = np.concatenate([next(one)["pair_ids"] for _ in range(13)])  # 26 pairs: two epochs
    assert sorted(seen[:13]) == list(range(13)) and sorted(seen[13:]) == list(range(13))
    assert seen[:13].tolist() != seen[13:].tolist()  # another order each epoch
    ranks = [PairLoader(pairs, local_batch_size=4, seed=7, rank=r, world_size=2) for r in range(2)]
    split = np.concatenate([np.concatenate([next(r)["pair_ids"] for r in ranks]) for _ in range(6)])
    assert split.tolist() == seen[:24].tolist()  # rank r of W reads pairs next + r x k + j (k = 2 here)
    resumed = PairLoader(pairs, local_batch_size=4, seed=7)
    resumed.load_state_dict({**one.state_dict(), "next_index": 2 * 6})
    again = PairLoader(pairs, local_batch_size=4, seed=7)
    for _ in range(3):
        next(again)
    assert next(resumed)["pair_ids"].tolist() == next(again)["pair_ids"].tolist()
    with pytest.raises(PairError, match="written for 13 pairs with seed 7; this run has 13 pairs with seed 8"):
        PairLoader(pairs, 4, seed=8).load_state_dict(one.state_dict())
    with pytest.raises(PairError, match="must be even"):
        PairLoader(pairs, 3, seed=7)


def test_a_source_that_is_not_pairs_is_refused_naming_its_file(sources, tmp_path):
    from tests.conftest import repeated_batch_source

    plain = repeated_batch_source(tmp_path / "plain", tokens=20)
    with pytest.raises(PairError, match=f"{plain / 'manifest.json'}: no 'pairs' entry"):
        PairSet([plain], seq_len=32)
    with pytest.raises(PairError, match=r"00000_unshuffled.ds: pair \d+ of the shard \((chosen|rejected), document "
                                        r"\d+\) has \d+ tokens, over seq_len 8 \+ 1"):
        PairSet([sources[0]], seq_len=8)


def checkpoint(folder: Path, weights: bytes = b"1") -> Path:
    """A DCP-shaped step dir: what is in it is what the key reads."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"meta")
    (folder / "__0_0.distcp").write_bytes(weights)
    return folder


def test_reference_key_changes_with_each_input_and_not_with_beta_paths_or_times(sources, tmp_path):
    init = reference.checkpoint_identity(checkpoint(tmp_path / "sft" / "checkpoints" / "step-40"))
    assert init["step"] == 40
    args = {"init": init, "sources": [str(sources[0])], "loss": "dpo", "seq_len": 32, "template_sha256": "sha",
            "param_dtype": "float32", "compile": False}
    key = reference.cache_key(reference.key_inputs(**args))  # beta, label smoothing, gamma: not inputs at all
    other = {"init": [reference.checkpoint_identity(checkpoint(tmp_path / "a" / "step-41")),  # the step
                      reference.checkpoint_identity(checkpoint(tmp_path / "b" / "step-40", b"2"))],  # the contents
             "sources": [[str(sources[1])], [str(sources[0]), str(sources[1])]], "loss": ["dpo_norm"],
             "seq_len": [64], "template_sha256": ["other"], "param_dtype": ["bfloat16"], "compile": [True]}
    assert set(other) == set(args)  # every input is changed below
    for name, values in other.items():
        for value in values:
            assert reference.cache_key(reference.key_inputs(**{**args, name: value})) != key, (name, value)
    # A copy elsewhere, with new times and the replica check's note beside it, is the same checkpoint.
    copy = shutil.copytree(tmp_path / "sft", tmp_path / "elsewhere" / "sft", copy_function=shutil.copy)
    step = copy / "checkpoints" / "step-40"
    (step / rundir.VERIFIED_FILE).write_text("{}")
    os.utime(step / "__0_0.distcp", (1, 1))
    moved = reference.checkpoint_identity(step)
    assert moved["path"] != init["path"] and {**moved, "path": ""} == {**init, "path": ""}
    assert reference.cache_key(reference.key_inputs(**{**args, "init": moved})) == key


def test_a_key_without_its_file_at_a_resumed_step_names_what_changed(sources, tmp_path):
    init = reference.checkpoint_identity(checkpoint(tmp_path / "step-40"))
    args = {"init": init, "loss": "dpo", "seq_len": 32, "template_sha256": "sha", "param_dtype": "float32",
            "compile": False}
    train, held_out = [str(sources[0])], [str(sources[1])]
    record = {"init": init, "train": {"sources": train, "inputs": reference.key_inputs(sources=train, **args)}}
    run = tmp_path / "run"
    error = str(reference.missing_at_resume(run, "held_out", 7, record, held_out,
                                            reference.key_inputs(sources=held_out, **args)))
    assert error.startswith(f"{run / rundir.REFERENCE_LOGPS_DIR}/held_out-")
    assert "the run is at step 7" in error and str(reference.inputs_file(run)) in error
    assert f"[preference] held_out: unset at the first launch, {held_out} now" in error
    bf16 = reference.key_inputs(sources=train, **{**args, "param_dtype": "bfloat16", "compile": True})
    error = str(reference.missing_at_resume(run, "train", 7, record, train, bf16))
    assert ("[parallel] param_dtype (on CPU: float32 unless cpu_fp32 = false): 'float32' at the first launch, "
            "'bfloat16' now; [parallel] compile: False at the first launch, True now") in error
    error = str(reference.missing_at_resume(run, "train", 7, record, train, record["train"]["inputs"]))
    assert "Nothing its key holds changed since the first launch" in error and "the file was removed" in error
    with pytest.raises(reference.ReferenceError, match=f"{reference.inputs_file(run)}: missing, and the run is at "
                                                       "step 7"):
        reference.read_inputs(run, 7)
    reference.write_inputs(run, record)
    assert reference.read_inputs(run, 7) == record

    # a run dir from before laneformer 0.2 names the held-out role "heldout": read as held_out
    key = reference.cache_key(record["train"]["inputs"])
    reference.write_inputs(run, {**record, reference.OLD_ROLE: record["train"]})
    assert reference.read_inputs(run, 7) == {**record, "held_out": record["train"]}
    assert reference.cache_file(run, "held_out", key).name == f"held_out-{key}.npy"
    old = reference.cache_file(run, reference.OLD_ROLE, key)
    old.write_bytes(b"")
    assert reference.cache_file(run, "held_out", key) == old


def test_a_pair_without_reference_log_probs_is_named(sources, tmp_path):
    pairs = PairSet([sources[0]], seq_len=32)
    logps = np.zeros((10, 2), np.float32)
    logps[3, 1] = np.nan
    path = reference.cache_file(tmp_path, "train", "0123456789abcdef")
    reference.save(path, logps)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left
    with pytest.raises(reference.ReferenceError, match=r"no reference log-probs for 1 pair\(s\), first pair 3 \("):
        reference.load(path, pairs)


def test_reference_pass_in_chunks_equals_one_forward_per_pair(sources):
    """The chunked pass (2 pairs a forward, the last chunk padded) against a forward of each pair alone."""
    model = tiny_random_model()
    pairs = PairSet([sources[0], sources[1]], seq_len=32)
    chunked = reference.pair_logps(model, pairs, local_pairs=2, average=False, device=torch.device("cpu"))
    assert chunked.shape == (13, 2)
    for p in range(13):
        rows = pairs.rows(np.array([p]))
        with torch.no_grad():
            logits = model(torch.from_numpy(rows["input_ids"]), positions=torch.from_numpy(rows["positions"]))
        alone = sequence_logps(logits, torch.from_numpy(rows["labels"]), average=False)
        assert chunked[p].tolist() == pytest.approx(alone.tolist(), rel=1e-5)


def test_preflight_a_preference_run_reads_pair_sources_only_and_pairs_need_a_preference_loss(sources, tmp_path):
    from tests.conftest import repeated_batch_source
    from train import recipe as R
    from train.build import preflight

    plain = repeated_batch_source(tmp_path / "plain", tokens=20)
    both = (f'data.sources=[{{name = "plain", path = "{plain}", weight = 1.0}}, '
            f'{{name = "pairs", path = "{sources[0]}", pairs = true, weight = 1.0, max_epochs = 100}}]')
    recipe = R.load("tiny-dpo.toml", [f"run.output_dir={tmp_path / 'run'}", both])
    problems = "\n".join(preflight(recipe, 1).problems)
    assert "source(s) ['plain']: a preference run trains on pairs only" in problems
    recipe = R.load("tiny-sft.toml", [f"run.output_dir={tmp_path / 'sft'}", both])
    problems = "\n".join(preflight(recipe, 1).problems)
    assert "[preference] loss: source(s) ['pairs'] are preference pairs: a run on them needs a preference loss" \
        in problems
    few = (f'data.sources=[{{name = "pairs", path = "{sources[0]}", pairs = true, weight = 1.0, max_epochs = 1}}]')
    recipe = R.load("tiny-dpo.toml", [f"run.output_dir={tmp_path / 'run'}", few, "preference.held_out=[]"])
    problems = "\n".join(preflight(recipe, 1).problems)  # 60 steps x 8 pairs of 10
    assert "source 'pairs': the run reads 480 pairs, 48.00 epochs of the 10 pairs, over its max_epochs 1" in problems


def test_pair_sources_take_equal_weights_and_no_token_budget_whatever_the_loss(sources, tmp_path):
    """A preference run draws its pairs uniformly from all its pair sources: a weight or budget that
    would be ignored is refused at recipe load, naming the file and field (issue 43's table, its weights row;
    two pair sources of equal weight train in tests/e2e/test_preference.py). The refusal is the ``[data]``
    table's own (``train.recipe.schema.Data``), which never reads ``[preference]``: the loss type plays no
    part, so this runs once, on tiny-dpo's loss (tests/test_combinations.py marks the row so)."""
    from train import recipe as R

    def two(second: str) -> str:
        return (f'data.sources=[{{name = "a", path = "{sources[0]}", pairs = true, weight = 2.0, max_epochs = 100}}, '
                f'{{name = "b", path = "{sources[1]}", pairs = true, {second}, max_epochs = 100}}]')

    base = [f"run.output_dir={tmp_path}"]
    assert [s.weight for s in R.load("tiny-dpo.toml", [*base, two("weight = 2.0")]).data.sources] == [2.0, 2.0]
    given = f"--set {two('weight = 1.0')} (over {R.find('tiny-dpo.toml')})"
    with pytest.raises(R.RecipeError, match=re.escape(
            f"{given}: [data.sources[1]] weight: 1.0 for source 'b', 2.0 for 'a': a preference run draws its pairs "
            "uniformly from all its pair sources together")):
        R.load("tiny-dpo.toml", [*base, two("weight = 1.0")])
    with pytest.raises(R.RecipeError, match=re.escape("[data.sources[1]] tokens: source 'b' is a pair source")):
        R.load("tiny-dpo.toml", [*base, two("tokens = 1000")])
