"""Mixture loader tokens/s per rank, as headroom over what one GPU of the 2B recipe consumes.

Why: the loader runs in the training process of every rank; if it cannot
stay far ahead of the GPU it stalls training. The need is one H100 training
the 2B flavor at seq 4096 and 40% MFU: 0.4 * 989e12 / FLOPs-per-token tokens/s
(FLOPs per token from models.laneformer.flops). The loader must deliver at
least 20x that on one core (the process is pinned to one CPU while timed).

Measured as rank 0 of the 2B recipe's layout (global batch 1536 over 192
ranks: 8 sequences of 4096 per batch), with data.mixture.MixtureLoader over
(1) the bundled sample data (prose + code, small documents re-read for many
epochs) and (2) a larger synthetic source written to a temp dir (random ids,
log-normal document lengths, median ~600 tokens, so many document cuts per
sample). Token files were just written or are small, so reads come from the
page cache.

    .venv/bin/python -m bench.dataloader [--synthetic-tokens 32000000] [--batches 50]

``--index-memory N`` instead measures what the mixture's per-source index costs each
rank on one node, for one source of N documents (10^8 in bench/README.md), with 1 and
4 ranks reading it at once: the index memory-mapped from the files data.index builds
once (today's loader) against each rank holding its own copy of the same arrays (the
loader before). Each rank touches all of it (lengths and two epochs' permutations, as
a long run does) and reports its proportional set size (PSS: shared pages divided
among the processes that map them) and RSS, above what it held before opening the
source.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench import common
from data.mixture import Mixture, MixtureLoader, SourceSpec
from data.shards import write_manifest, write_shard
from models.laneformer import laneformer_configs
from models.laneformer.flops import nparams_and_flops_per_token
from rundir import REPO
from plan.gpus import GPUS

H100_PEAK_BF16 = GPUS["h100"].peak_flops("bfloat16")
HEADROOM = 20.0


def gpu_tokens_per_s(mfu: float = 0.4, peak: float = H100_PEAK_BF16, flavor: str = "2B", seq_len: int = 4096) -> float:
    """Tokens/s one GPU consumes training ``flavor`` at ``mfu`` of ``peak``."""
    config = laneformer_configs[flavor]()
    with torch.device("meta"):
        model = config.build()
    _, flops_per_token = nparams_and_flops_per_token(config, model, seq_len)
    return mfu * peak / flops_per_token


def write_synthetic(directory: Path, n_tokens: int, vocab: int = 32000, shards: int = 2, seed: int = 0) -> None:
    """A tokenized source in the project's format: <s> random ids </s> documents."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        lens = np.clip(rng.lognormal(np.log(600), 1.0, size=2 * n_tokens // shards // 600 + 16), 3, 60000)
        lens = lens.astype(np.int64)[: np.searchsorted(np.cumsum(lens.astype(np.int64)), n_tokens // shards) + 1]
        tokens = rng.integers(3, vocab, size=int(lens.sum()), dtype=np.uint16)
        ends = np.cumsum(lens)
        tokens[ends - lens] = 1  # BOS
        tokens[ends - 1] = 2  # EOS
        write_shard(directory / f"{s:05d}_unshuffled.ds", np.split(tokens, ends[:-1]), tokenizer_name="synthetic")
    tokenizer = {"path": "synthetic", "fingerprint": "synthetic", "vocab_size": vocab, "bos_id": 1, "eos_id": 2}
    write_manifest(directory, tokenizer, {"kind": "synthetic", "tokens": n_tokens})


@contextmanager
def one_core():
    """Pin this process to one CPU while timing (where the OS allows it)."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def loader_tokens_per_s(sources: list[SourceSpec], seq_len: int, batches: int) -> tuple[float, float]:
    """(tokens/s of rank 0 of 192 at 8 x seq_len per batch, seconds of the first batch)."""
    mixture = Mixture(sources, seq_len=seq_len, seed=1234)
    loader = MixtureLoader(mixture, global_batch_size=1536, rank=0, world_size=192)
    with one_core():
        t0 = time.perf_counter()
        next(loader)  # first epoch permutations are built here
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = sum(next(loader)["input_ids"].size for _ in range(batches))
        return n / (time.perf_counter() - t0), first


def write_many_documents(directory: Path, n_docs: int, seed: int = 0) -> None:
    """One shard of ``n_docs`` framed documents of 2-7 tokens (sizes the index, not the tokens)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, 8, size=n_docs, dtype=np.int64)
    ends = np.cumsum(lens)
    tokens = np.full(int(ends[-1]), 5, dtype=np.uint16)
    tokens[ends - lens] = 1
    tokens[ends - 1] = 2
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "00000_unshuffled.ds"
    tokens.tofile(path)
    ends.astype("<u8").tofile(f"{path}.index")
    Path(f"{path}.metadata").write_text(f"synthetic|2\n{len(tokens)}\n{len(tokens)}")
    tokenizer = {"path": "synthetic", "fingerprint": "synthetic", "vocab_size": 32000, "bos_id": 1, "eos_id": 2}
    write_manifest(directory, tokenizer, {"kind": "synthetic", "documents": n_docs})


def _memory() -> tuple[int, int]:
    """(PSS, RSS) of this process in bytes, from /proc/self/smaps_rollup."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return int(fields["Pss"].split()[0]) * 1024, int(fields["Rss"].split()[0]) * 1024


def _index_rank(directory: str, copy: bool, barrier, results, rank: int) -> None:
    """One rank: open the source and touch its whole index (lengths, two epochs' permutations and their
    prefix sums), as the shared maps (now) or computed into its own memory (as the loader did before)."""
    from data.index import ckpt_sums

    before = _memory()
    mixture = Mixture([SourceSpec("s", directory, weight=1.0, max_epochs=1e9)], seq_len=4096, seed=1234)
    stream = mixture.streams[0]
    if copy:  # the loader before: every rank builds and holds the arrays itself
        lens = stream.index._build_lens()
        perms = [stream.index._build_perm(stream._key, e) for e in (0, 1)]
        arrays = [lens, ckpt_sums(lens), *perms, *(ckpt_sums(lens[p]) for p in perms)]
    else:
        arrays = [stream.lens, stream.starts_ckpt, *stream.epoch(0), *stream.epoch(1)]
    touched = sum(int(a[:: max(1, 4096 // a.itemsize)].sum()) for a in arrays)  # every page
    barrier.wait()  # all ranks hold it at once, as on a node
    after = _memory()
    results[rank] = (after[0] - before[0], after[1] - before[1], touched)
    barrier.wait()


def index_memory(n_docs: int, ranks: tuple[int, ...] = (1, 4)) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="bench-index-"))
    rows = []
    try:
        t0 = time.perf_counter()
        write_many_documents(tmp / "s", n_docs)
        written = time.perf_counter() - t0
        with ctx.Manager() as manager:
            t0 = time.perf_counter()
            barrier, results = ctx.Barrier(1), manager.dict()
            p = ctx.Process(target=_index_rank, args=(str(tmp / "s"), False, barrier, results, 0))
            p.start(), p.join()  # builds the index files once
            if p.exitcode:
                raise RuntimeError("building the index failed")
            built = time.perf_counter() - t0
            for copy in (True, False):
                for n in ranks:
                    barrier, results = ctx.Barrier(n), manager.dict()
                    procs = [ctx.Process(target=_index_rank, args=(str(tmp / "s"), copy, barrier, results, r))
                             for r in range(n)]
                    for q in procs:
                        q.start()
                    for q in procs:
                        q.join()
                    if any(q.exitcode for q in procs):
                        raise RuntimeError(f"a rank failed ({'copy' if copy else 'mapped'}, {n} ranks)")
                    pss = [results[r][0] for r in range(n)]
                    rows.append({"index": "own copy per rank (before)" if copy else "memory-mapped, shared (now)",
                                 "ranks": n, "PSS/rank MB": f"{max(pss) / 1e6:,.0f}",
                                 "RSS/rank MB": f"{max(results[r][1] for r in range(n)) / 1e6:,.0f}",
                                 "pss": max(pss), "copy": copy})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"mixture index of one source of {n_docs:,} documents (written in {written:.0f} s; index built once "
          f"in {built:.0f} s): memory per rank above its start, all ranks holding it at once")
    print(common.table(rows, ["index", "ranks", "PSS/rank MB", "RSS/rank MB"]))
    for copy in (True, False):
        one, four = (r["pss"] for r in rows if r["copy"] == copy)
        print(f"RATIO {'copy' if copy else 'mapped'}: PSS per rank with {ranks[1]} ranks / with 1 rank: "
              f"{four / one:.2f} (target for the mapped index: <= {1 / ranks[1]:.2f} plus O(1))")
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--synthetic-tokens", type=int, default=32_000_000)
    p.add_argument("--index-memory", type=int, metavar="DOCS",
                   help="instead: index memory per rank for one source of DOCS documents, 1 and 4 ranks")
    args = p.parse_args(argv)
    if args.index_memory:
        return {"index_memory": index_memory(args.index_memory)}
    need = gpu_tokens_per_s()
    sample = REPO / "assets" / "sample_data"
    many = 1e9  # the sample data is tiny: allow re-reading it for as many epochs as it takes
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    try:
        t0 = time.perf_counter()
        write_synthetic(tmp / "synthetic", args.synthetic_tokens)
        gen_s = time.perf_counter() - t0
        cases = {
            "sample prose+code": [SourceSpec("prose", sample / "prose", weight=0.5, max_epochs=many),
                                  SourceSpec("code", sample / "code", weight=0.5, max_epochs=many)],
            f"synthetic {args.synthetic_tokens / 1e6:.0f}M tokens": [
                SourceSpec("synthetic", tmp / "synthetic", weight=1.0, max_epochs=many)],
        }
        rows = []
        for name, sources in cases.items():
            tps, first = loader_tokens_per_s(sources, args.seq, args.batches)
            rows.append({"source": name, "tokens/s/rank": f"{tps:,.0f}", "x need": f"{tps / need:.0f}x",
                         "first batch s": f"{first:.3f}", "ratio_value": tps / need})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"mixture loader on one core: seq {args.seq}, 8 sequences per batch (rank 0 of 192), "
          f"{args.batches} batches; synthetic source written in {gen_s:.1f} s")
    print(f"need: 2B at seq {args.seq}, 40% MFU of an H100 (989 TFLOP/s bf16) = {need:,.0f} tokens/s/GPU")
    print(common.table(rows, ["source", "tokens/s/rank", "x need", "first batch s"]))
    worst = min(r["ratio_value"] for r in rows)
    verdict = "PASS" if worst >= HEADROOM else "FAIL"
    print(f"RATIO loader tokens/s / GPU need: {worst:.0f}x (worst case; required >= {HEADROOM:.0f}x): {verdict}")
    return {"need": need, "ratio": worst, "rows": rows}


if __name__ == "__main__":
    main()
