"""Lane-parallel decoding on 8, 4 and 2 gloo ranks equals the one-process decode, token for token.

One torchrun launch of 8 ranks runs this file's ``__main__`` (each launch
costs ~15 s here, so everything shares it; 4 and 2 ranks are subgroups):

- the CLI (``--lane-parallel``) on a trained tiny checkpoint on 8 ranks, and
  the same checkpoint through the library on 4 and 2 ranks;
- every exchange variant of ``tests.models.conftest.DECODE_VARIANTS`` (delay 0, 1, 2,
  4; early present/scaled, with and without sending forward; late
  drop/flush/present; mean-of-norms and norm-of-sum; no delayed exchange), random
  tiny weights, on 8 ranks (one lane each) and 4 (two lanes summed on a rank
  before the exchange; 2 ranks of 4 lanes are the checkpoint's case);
- a 2B-shaped model (dim 3072, 32/16 heads of 96, MLP 12288, 8 lanes, delay 2,
  window layers) in fp32 with random weights, over a few tokens, on 8 ranks
  (one lane each, as DTP deploys it; the 4- and 2-rank splits are proven on the
  tiny cases), with two cuts that leave every lane weight and every rule of the
  exchange as in the 2B: 5 of its 15 layers (layers 0-1 early, 2 sends to 4,
  3-4 late; all 15 would need ~8.5 GB of lane weights over the ranks plus as
  much again for the one-process reference), and a vocabulary of 4,096 instead
  of 32,000 (embeddings and head are replicated on every rank, never
  exchanged; at 32,000 their random init alone took ~25 s of this test);
- generation past the base model's length (issue 44 item 7), on 8 ranks: the
  YaRN x4 case of tests/models/test_generate_long.py, a 256-token prompt (4x
  its original length of 64, a window of 16 wrapping its ring 16 times),
  decoded past its max_seq_len; checked against that file's reference, greedy
  decoding by full forward passes of ``Laneformer.forward``.

The one-process references run in the test process (for the 2B-shaped model
also checked against ``Laneformer.forward``) and, for the checkpoint, through
the CLI's ``main`` without ``--lane-parallel``.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rundir import REPO
from tests.conftest import TORCHRUN, env, free_port, train
from tests.models.conftest import DECODE_PROMPT, DECODE_VARIANTS, decode_config, model_from_weights
from tests.models.test_generate_long import NEW as LONG_NEW
from tests.models.test_generate_long import PROMPT as LONG_PROMPT
from tests.models.test_generate_long import long_config, long_weights, reference_greedy

LONG_CASE = "yarn x4, 4x the original length"

SPLITS = (8, 4, 2)
VARIANT_SPLITS = (8, 4)
PROMPT_TEXT = "The cat sat on the"
NEW = 6
BIG_PROMPT, BIG_NEW, VARIANT_NEW = [1, 450, 3996, 1735], 3, 4


def big_config():
    """The 2B's lane shapes and exchange with 5 of its 15 layers (window layers 0-2, as 0-9 of 15)
    and a 4,096-id vocabulary."""
    from models.laneformer import laneformer_configs
    from models.laneformer.attention import attention_config

    return dataclasses.replace(laneformer_configs["2B"](), n_layers=5, window_layers=[0, 1, 2], vocab_size=4096,
                               inner_attention=attention_config("dense"))


def worker(spec_path: str, out_path: str) -> None:
    """Every rank: the cases above; rank 0 writes case -> ids."""
    import torch.distributed as dist

    from data.tokenizer import Tokenizer
    from models.laneformer import generate as G
    from models.laneformer.checkpoint import open_checkpoint

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {8: dist.group.WORLD, **{p: dist.new_group(list(range(p))) for p in SPLITS if p != 8}}
    results = {"checkpoint/8": G.main(["--checkpoint", spec["checkpoint"], "--prompt", PROMPT_TEXT,
                                       "--max-new-tokens", str(NEW), "--lane-parallel"])}

    def run(p, config, weights_of, prompt, n):
        if rank >= p:
            return None
        lanes = G.lane_range(config.n_lanes, rank, p)
        decoder = G.LaneDecoder(config, weights_of(lanes), lanes, torch.device("cpu"), group=groups[p])
        return G.greedy(decoder, prompt, n).ids

    ckpt = spec["checkpoint"]
    checkpoint = open_checkpoint(ckpt)
    config = checkpoint.model_config()
    prompt = Tokenizer().encode(PROMPT_TEXT, bos=True)
    for p in SPLITS[1:]:
        results[f"checkpoint/{p}"] = run(p, config, lambda lanes: checkpoint.load_weights(config, lanes), prompt, NEW)
    for name, overrides in DECODE_VARIANTS.items():
        config = decode_config(**overrides)
        for p in VARIANT_SPLITS:
            results[f"{name}/{p}"] = run(p, config, lambda lanes: G.random_weights(config, lanes, seed=1),
                                         DECODE_PROMPT, VARIANT_NEW)
    big = big_config()
    results["2B/8"] = run(8, big, lambda lanes: G.random_weights(big, lanes, seed=2), BIG_PROMPT, BIG_NEW)
    long = long_config(LONG_CASE)
    results["long/8"] = run(8, long, lambda lanes: long_weights(long, lanes), LONG_PROMPT, LONG_NEW)
    dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run (6 layers so that layers 2-3 send, a window of 4 that binds) after 10 training steps."""
    run = tmp_path_factory.mktemp("decode") / "run"
    result = train("tiny.toml", f"run.output_dir={run}", "training.steps=10", "schedule.warmup_steps=2",
                   "training.seq_len=64", "training.global_batch=8", "training.micro_batch=8",
                   "checkpoint.interval=10", "model.n_layers=6", "model.window_size=4", "eval.every=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def ids_line(stdout: str) -> list[int]:
    (line,) = [x for x in stdout.splitlines() if x.startswith("ids:")]
    return [int(t) for t in line.split()[1:]]


@pytest.mark.slow
def test_lane_parallel_ids_equal_one_process(trained, tmp_path, capsys):
    from models.laneformer import generate as G

    spec, out = tmp_path / "spec.json", tmp_path / "ids.json"
    spec.write_text(json.dumps({"checkpoint": str(trained)}))
    launch = subprocess.run(
        [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "8", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), __file__, str(spec), str(out)],
        cwd=REPO, env={**env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1200)
    assert launch.returncode == 0, launch.stderr[-4000:]
    got = json.loads(out.read_text())

    # The trained checkpoint: the one-process CLI is the reference (its main, in this process).
    capsys.readouterr()
    reference = G.main(["--checkpoint", str(trained), "--prompt", PROMPT_TEXT, "--max-new-tokens", str(NEW)])
    assert ids_line(capsys.readouterr().out) == reference and len(reference) >= 1
    assert ids_line(launch.stdout) == reference  # what the 8-rank CLI printed
    for p in SPLITS:
        assert got[f"checkpoint/{p}"] == reference, p
    # The CLI's timing report: every rank's wait against compute, and the delay-0 ratio.
    assert all(re.search(rf"rank {r}: waiting on the exchange [\d.]+ ms/token, compute", launch.stdout)
               for r in range(8))
    assert re.search(r"RATIO TP/DTP per-token latency: [\d.]+x", launch.stdout)

    # Every variant, random tiny weights: the one-process decoder (equal to Laneformer.forward: tests/models).
    for name, overrides in DECODE_VARIANTS.items():
        config = decode_config(**overrides)
        one = G.LaneDecoder(config, G.random_weights(config, range(8), seed=1), range(8), torch.device("cpu"))
        reference = G.greedy(one, DECODE_PROMPT, VARIANT_NEW).ids
        assert len(reference) == VARIANT_NEW
        for p in VARIANT_SPLITS:
            assert got[f"{name}/{p}"] == reference, (name, p)

    # The 2B-shaped model: one process, and the model's own forward over the decoded sequence.
    big = big_config()
    weights = G.random_weights(big, range(8), seed=2)
    reference = G.greedy(G.LaneDecoder(big, weights, range(8), torch.device("cpu")), BIG_PROMPT, BIG_NEW).ids
    with torch.no_grad():
        logits = model_from_weights(big, weights)(torch.tensor([BIG_PROMPT + reference]))[0]
    assert logits[len(BIG_PROMPT) - 1:-1].argmax(-1).tolist() == reference
    assert got["2B/8"] == reference

    # Past the base model's length: the reference is the model's own forward, once per token.
    long = long_config(LONG_CASE)
    reference, _ = reference_greedy(long, long_weights(long), LONG_PROMPT, LONG_NEW)
    assert got["long/8"] == reference


@pytest.mark.slow
def test_dtp_decode_bench_runs_on_two_ranks(capfd, monkeypatch):
    """bench.dtp_decode end to end at a tiny size (its timing means nothing here; it says so). Its main
    runs here and starts torchrun itself, as ``python -m bench.dtp_decode`` does."""
    from bench import dtp_decode

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = dtp_decode.main(["--ranks", "2", "--flavor", "tiny", "--tokens", "3", "--prompt-len", "4"])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert any("checks the mechanism only" in line for line in lines)
    assert re.fullmatch(r"RATIO TP/DTP per-token latency \(tiny, 2 ranks\): [\d.]+x", lines[-1])


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(900, exit=True)  # a hang shows where each rank waits
    worker(*sys.argv[1:3])
