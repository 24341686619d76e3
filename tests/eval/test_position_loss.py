"""Held-out loss by position in the document (eval.position_loss), as the training eval callback logs it
and as ``eval.run --loss-by-position`` scores a checkpoint or an export: each bucket against the mean of
torch's own cross-entropy over the tokens whose in-document position falls in it, counted by hand here;
the export's way (each document piece a row of its own) against the document mask; 2 ranks against 1;
``eval.run --loss-by-position`` on a DCP checkpoint and on its HF export against both, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
from data.tokenizer import Tokenizer
from eval.position_loss import (bucket_edges, bucket_of, loss_by_position, position_metric, unpacked_logits,
                                validation_rows)
from eval.spec import EvalSpec
from rundir import REPO
from tests.data.test_held_out_split import TOK, write_source
from tests.eval.test_eval_harness import exported  # noqa: F401  (the fixture: a tiny model, DCP and export)
from train.callbacks.eval import Eval

SEQ_LEN, MICRO, SAMPLES, BUCKETS = 64, 2, 5, 3  # 5 samples: the last batch holds a padding row; 3 buckets: 21, 21, 22


def documents(n: int, seed: int, longest: int) -> list[tuple[int, ...]]:
    """BOS, 3 to ``longest`` random ids, EOS: most longer than a bucket, many longer than a row."""
    rng = np.random.default_rng(seed)
    return [(TOK.bos_id, *rng.integers(3, 4000, rng.integers(3, longest)).tolist(), TOK.eos_id) for _ in range(n)]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> dict[str, str]:
    """Two held-out sets: one plain, one with a loss mask (only odd ids are labels, as a chat set's answers)."""
    root = tmp_path_factory.mktemp("held_out")
    return {"plain": str(write_source(root / "plain", [documents(40, 1, 150)])),
            "masked": str(write_source(root / "masked", [documents(40, 2, 150)], loss=True))}


def tiny_model() -> torch.nn.Module:
    from models.laneformer import model_registry

    torch.manual_seed(0)
    model = model_registry("tiny", attn_backend="dense").model.build()
    model.init_states()
    return model.eval()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


def callback_validation(model, sets: dict[str, str], val_samples: int = SAMPLES, **spec) -> dict[str, float]:
    """The eval callback's held-out validation of ``model`` (train.callbacks.eval), as a run at SEQ_LEN calls it."""
    hook = Eval(Eval.Config(spec=EvalSpec(val_samples=val_samples, **spec), val_sets=sets), trainer=None)
    trainer = SimpleNamespace(config=SimpleNamespace(training=SimpleNamespace(seq_len=SEQ_LEN, local_batch_size=MICRO)),
                              tokenizer=SimpleNamespace(tokenizer=Tokenizer()), model_parts=[model], device="cpu")
    with torch.no_grad():
        return hook.validation(trainer)


def mixture(name: str, path: str, length: int) -> Mixture:
    """A held-out set as the loop reads it (its document order is seeded by its name)."""
    return Mixture([SourceSpec(name=name, path=path, weight=1.0, max_epochs=1e9)], length)


def by_hand(model, sets: dict[str, str], edges: list[int], in_document: bool = True) -> dict[str, float]:
    """Each bucket's mean of torch's cross-entropy over the scored tokens whose position falls in it,
    over samples 0 .. SAMPLES - 1 of every set, counted token by token; ``in_document=False``: the position
    in the packed row instead (what the loss by position must not be)."""
    nats, tokens = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for name, path in sets.items():
        batch = {k: torch.from_numpy(v) for k, v in mixture(name, path, SEQ_LEN).batch(np.arange(SAMPLES)).items()}
        with torch.no_grad():
            logits = model(batch["input_ids"], positions=batch["positions"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none").view(SAMPLES, -1)
        for b in range(SAMPLES):
            for s in range(SEQ_LEN):
                if batch["labels"][b, s] == IGNORE_INDEX:
                    continue
                position = int(batch["positions"][b, s]) if in_document else s
                i = next(i for i in range(len(edges) - 1) if edges[i] <= position < edges[i + 1])
                nats[i] += float(loss[b, s])
                tokens[i] += 1
    return {position_metric(a, b): n / t for a, b, n, t in zip(edges, edges[1:], nats, tokens) if t}


def test_buckets_are_equal_parts_of_the_length_and_their_names_read_back():
    assert bucket_edges(16384, 8) == [0, 2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384]
    assert bucket_edges(10, 3) == [0, 3, 6, 10]
    for bad in (0, 11):
        with pytest.raises(ValueError, match=f"position_buckets: {bad} buckets of a length of 10"):
            bucket_edges(10, bad)
    assert position_metric(4096, 6144) == "eval/val_loss_pos/4096-6144"
    assert bucket_of(position_metric(4096, 6144)) == (4096, 6144)
    assert bucket_of("eval/val_loss/prose") is None and bucket_of("eval/val_loss_pos/x-1") is None


def test_the_loop_logs_each_bucket_as_the_mean_loss_of_the_tokens_at_those_document_positions(model, held_out):
    edges = bucket_edges(SEQ_LEN, BUCKETS)
    got = callback_validation(model, held_out, position_buckets=BUCKETS)
    expected = by_hand(model, held_out, edges)
    assert list(expected) == [position_metric(a, b) for a, b in zip(edges, edges[1:])]  # every bucket reached
    assert {k: got[k] for k in got if bucket_of(k)} == pytest.approx(expected, rel=1e-6)
    in_row = by_hand(model, held_out, edges, in_document=False)
    assert max(abs(in_row[k] - expected[k]) for k in expected) > 1e-3  # the data tells the two apart
    assert callback_validation(model, held_out).keys() == {k for k in got if not bucket_of(k)}  # 0: none


def test_a_bucket_no_token_reaches_has_no_number(model, tmp_path):
    """Documents of at most 31 tokens (BOS + 29 + EOS): positions 31 and on are never reached."""
    sets = {"short": str(write_source(tmp_path / "short", [documents(60, 3, 30)]))}
    got = callback_validation(model, sets, position_buckets=BUCKETS)
    assert [k for k in got if bucket_of(k)] == [position_metric(0, 21), position_metric(21, 42)]  # not 42-64
    scored = {k: got[k] for k in got if bucket_of(k)}
    assert scored == pytest.approx(by_hand(model, sets, bucket_edges(SEQ_LEN, BUCKETS)), rel=1e-6)


def test_a_model_without_document_masks_scores_each_piece_as_the_mask_does(model, held_out):
    """unpacked_logits (eval.run's way for an HF export) gives the document-masked logits at every token,
    and eval.run's loss by position equals the loop's on the same rows."""
    rows = mixture("plain", held_out["plain"], SEQ_LEN).batch(np.arange(4))
    batch = {k: torch.from_numpy(v) for k, v in rows.items()}
    assert ((batch["positions"] == 0).sum(1) > 1).any()  # documents share a row: the mask matters
    calls = []

    def no_positions(ids):  # the interface an export has: ids only
        calls.append(tuple(ids.shape))
        return model(ids)

    with torch.no_grad():
        masked = model(batch["input_ids"], positions=batch["positions"])
        unpacked = unpacked_logits(no_positions, batch["input_ids"], batch["positions"])
        whole_rows = model(batch["input_ids"])
    assert torch.allclose(unpacked, masked, atol=1e-5)
    assert not torch.allclose(whole_rows, masked, atol=1e-3)  # without the pieces, documents would see each other
    assert all(rows * width <= batch["input_ids"].numel() or rows == 1 for rows, width in calls)

    edges = bucket_edges(SEQ_LEN, BUCKETS)
    sets = [mixture(n, p, SEQ_LEN) for n, p in held_out.items()]
    scored = loss_by_position(no_positions, sets, SAMPLES, edges, "cpu")
    assert scored == pytest.approx(by_hand(model, held_out, edges), rel=1e-6)


def ranks_validate(rank: int, store: str, sets: dict[str, str], out: str) -> None:
    """One of 2 gloo ranks: the loop's validation and eval.run's loss by position, written by rank 0."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tiny_model()
        edges = bucket_edges(SEQ_LEN, BUCKETS)
        looped = callback_validation(model, sets, position_buckets=BUCKETS)
        mixtures = [mixture(n, p, SEQ_LEN) for n, p in sets.items()]
        run = loss_by_position(lambda ids: model(ids), mixtures, SAMPLES, edges, "cpu")
        if rank == 0:
            Path(out).write_text(json.dumps({"loop": looped, "run": run}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_one_rank_s_numbers(model, held_out, tmp_path):
    """The sums are reduced, not the means: 5 samples dealt to 2 ranks (rank 0 scores 3 of them, rank 1 two
    and a padding row) give the numbers of 1 rank, in the loop and in eval.run."""
    assert [list(r) for r in validation_rows(SAMPLES, MICRO, 2, 1)] == [[2, 3], [-1, -1]]
    mp.spawn(ranks_validate, args=(str(tmp_path / "store"), held_out, str(tmp_path / "out.json")), nprocs=2)
    two = json.loads((tmp_path / "out.json").read_text())
    one = callback_validation(model, held_out, position_buckets=BUCKETS)
    assert two["loop"] == pytest.approx(one, rel=1e-6)
    assert two["run"] == pytest.approx({k: v for k, v in one.items() if bucket_of(k)}, rel=1e-6)


# --- eval.run --loss-by-position: a checkpoint or an export on held-out sets ---

TOKENIZER = REPO / "assets" / "tokenizer"  # what the held-out sets were tokenized with (TOK)


def run_loss_by_position(checkpoint, held_out: str, *flags: str) -> dict[str, float]:
    from eval.run import main

    out = main(["--checkpoint", str(checkpoint), "--loss-by-position", str(BUCKETS), "--held-out", held_out,
                "--seq-len", str(SEQ_LEN), "--val-samples", str(SAMPLES), *flags])
    return out["metrics"]


def test_eval_run_scores_a_checkpoint_and_its_export_as_the_loop_does(exported, held_out):  # noqa: F811
    """On the run's DCP checkpoint and on its HF export, eval.run's buckets are torch's cross-entropy
    counted by hand on the document-masked training model, and eval.position_loss called directly."""
    model, step, hf_dir = exported
    edges = bucket_edges(SEQ_LEN, BUCKETS)
    expected = by_hand(model, held_out, edges)
    sets = ",".join(held_out.values())  # named by their folders: plain, masked (as by_hand names them)
    dcp = run_loss_by_position(step.parent.parent, sets, "--tokenizer", str(TOKENIZER))
    assert list(dcp) == [position_metric(a, b) for a, b in zip(edges, edges[1:])]  # only the buckets: asked alone
    assert dcp == pytest.approx(expected, rel=1e-6)
    direct = loss_by_position(lambda ids: model(ids), [mixture(n, p, SEQ_LEN) for n, p in held_out.items()],
                              SAMPLES, edges, "cpu")
    assert dcp == pytest.approx(direct, rel=1e-6)
    assert run_loss_by_position(hf_dir, sets) == pytest.approx(expected, rel=1e-5)  # its own modeling code


def test_eval_run_reads_a_split_source_s_held_out_set_under_the_run_s_name(exported, tmp_path):  # noqa: F811
    """A source split by data.held_out: its held_out/ is read, its documents in the order of the set's name
    in the run (NAME=DIR; default: the source's folder name), which a run names after the recipe's source."""
    from data.held_out import split

    model, step, _ = exported
    source = write_source(tmp_path / "books-16k", [documents(120, 4, 150)])
    split(source, 0.4)
    edges = bucket_edges(SEQ_LEN, BUCKETS)
    flags = ("--tokenizer", str(TOKENIZER))
    named = run_loss_by_position(step.parent.parent, f"books={source}", *flags)
    assert named == pytest.approx(by_hand(model, {"books": str(source / "held_out")}, edges), rel=1e-6)
    unnamed = run_loss_by_position(step.parent.parent, str(source), *flags)
    assert unnamed == pytest.approx(by_hand(model, {"books-16k": str(source / "held_out")}, edges), rel=1e-6)
    assert max(abs(named[k] - unnamed[k]) for k in named) > 1e-3  # the name orders the documents


def exit_2(capsys, argv: list[str]) -> str:
    from eval.run import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_eval_run_refuses_bad_input_naming_the_flag(exported, held_out, tmp_path, capsys):  # noqa: F811
    _, _, hf_dir = exported
    none = str(tmp_path / "no-such-run")  # said before a checkpoint is opened: this one would fail to open
    plain = held_out["plain"]
    (tmp_path / "empty").mkdir()
    before_loading = {
        ("--held-out", str(tmp_path / "nope")): f"--held-out {tmp_path / 'nope'}: {tmp_path / 'nope'}: no such folder",
        ("--held-out", str(tmp_path / "empty")): "holds neither held_out/manifest.json (a source split by python -m "
                                                 "data.held_out) nor a manifest.json (a tokenized folder)",
        ("--held-out", f"{plain},{plain}"): "--held-out: two sets named 'plain'",
        ("--held-out", plain, "--seq-len", "64", "--loss-by-position", "65"):
            "--loss-by-position 65: more buckets than --seq-len 64 has tokens",
        ("--held-out", plain, "--seq-len", "0"): "--seq-len: must be > 0 (got 0)",
        ("--held-out", plain, "--val-samples", "0"): "--val-samples: must be > 0 (got 0)",
        ("--held-out", plain, "--loss-by-position", "-1"): "--loss-by-position: must be >= 0 (got -1; 0: none)",
    }
    for flags, message in before_loading.items():
        flags = ("--loss-by-position", "4", *flags) if "--loss-by-position" not in flags[2:] else flags
        err = exit_2(capsys, ["--checkpoint", none, *flags])
        assert message in err and "no-such-run" not in err, (flags, err)
    assert "--loss-by-position N scores the --held-out sets: pass both" in exit_2(
        capsys, ["--checkpoint", none, "--loss-by-position", "4"])
    assert "--held-out: only --loss-by-position N reads it" in exit_2(
        capsys, ["--checkpoint", none, "--core", str(tmp_path), "--held-out", plain])
    assert "--seq-len: only --loss-by-position N reads it" in exit_2(
        capsys, ["--checkpoint", none, "--core", str(tmp_path), "--seq-len", "64"])
    # against the loaded model: a length beyond it (RoPE's tables end there), a default length of fewer tokens than N
    assert "--seq-len 2048 exceeds the checkpoint's max_seq_len 1024 (a longer context for a DCP checkpoint: " \
           "--set max_seq_len=N)" in exit_2(capsys, ["--checkpoint", str(hf_dir), "--loss-by-position", "4",
                                                   "--held-out", plain, "--seq-len", "2048"])
    assert "--loss-by-position 1025: more buckets than --seq-len 1024 has tokens" in exit_2(
        capsys, ["--checkpoint", str(hf_dir), "--loss-by-position", "1025", "--held-out", plain])
