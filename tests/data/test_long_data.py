"""Long data (issue 44): documents of at least N tokens, one document per code repository, the manifest's
counts of long documents, and packing at 16k/32k with the document masking of 4k."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from data import tokenize
from data.mixture import Mixture, SourceSpec
from data.shards import LONG_DOCUMENTS, load_manifest, open_source, write_manifest, write_shard
from data.tokenizer import TINY_TOKENIZER, load_tokenizer
from models.laneformer import model_registry
from rundir import REPO
from tests.data.test_tokenize import make_corpus

TOK = {"path": "test", "fingerprint": "f" * 64, "vocab_size": 4096, "bos_id": 1, "eos_id": 2}


def documents(directory) -> list[list[int]]:
    return [s.document(i).tolist() for s in open_source(directory).shards for i in range(s.num_documents)]


def test_min_doc_tokens_keeps_the_long_documents_and_counts_the_others(tmp_path):
    files = make_corpus(tmp_path / "in", 120)
    tok = load_tokenizer()
    encoded = [tok.encode_document(t) for f in files for t in f]  # task 0 reads every file: tasks=1
    n = int(np.median([len(e) for e in encoded]))
    manifest = tokenize.run(str(tmp_path / "in"), tmp_path / "out", TINY_TOKENIZER, min_doc_tokens=n)
    kept, short = [e for e in encoded if len(e) >= n], [e for e in encoded if len(e) < n]
    assert documents(tmp_path / "out") == kept and short
    assert manifest["min_doc_tokens"] == {"min": n, "dropped_documents": len(short),
                                          "dropped_tokens": sum(map(len, short))}
    assert manifest["input"]["min_doc_tokens"] == n


def code_rows(seed=0) -> list[dict]:
    """Files of 9 repositories, shuffled; one row has no repository."""
    rng = random.Random(seed)
    rows = [{"max_stars_repo_name": f"org/repo{r}", "max_stars_repo_path": f"src/{name}.py",
             "content": f"# repo {r}, file {name}\nx = {rng.randint(0, 10**6)}\n"}
            for r in range(9) for name in rng.sample("abcdefgh", rng.randint(1, 6))]
    rows.append({"max_stars_repo_path": "orphan.py", "content": "no repository\n"})
    rng.shuffle(rows)
    return rows


def tokenize_code(tmp_path, name: str, tasks: int) -> dict:
    """``code_rows`` over three jsonl files (a repository's files spread over them), concatenated by repository."""
    rows = code_rows()
    (tmp_path / "in").mkdir(exist_ok=True)
    for i in range(3):
        (tmp_path / "in" / f"part{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[i::3]))
    return tokenize.run(str(tmp_path / "in"), tmp_path / name, TINY_TOKENIZER, text_key="content", tasks=tasks,
                        workers=1, concat_by="max_stars_repo_name", concat_order="max_stars_repo_path")


def test_concat_by_makes_one_document_per_repository_its_files_sorted_by_path(tmp_path):
    manifest = tokenize_code(tmp_path, "out", tasks=2)
    repos: dict[str, list[tuple[str, str]]] = {}
    for row in code_rows():
        if "max_stars_repo_name" in row:
            repos.setdefault(row["max_stars_repo_name"], []).append((row["max_stars_repo_path"], row["content"]))
    tok = load_tokenizer()
    want = sorted(tok.encode_document("\n\n".join(f"{path}\n{text}" for path, text in sorted(files)))
                  for files in repos.values())
    assert sorted(documents(tmp_path / "out")) == want
    assert manifest["concat"] == {"by": "max_stars_repo_name", "order": "max_stars_repo_path",
                                  "files": len(code_rows()) - 1, "rows_without_column": 1, "repositories": 9}
    # the same documents whatever the number of tasks (each repository lands in one bucket)
    tokenize_code(tmp_path, "one-task", tasks=1)
    assert sorted(documents(tmp_path / "one-task")) == want


def test_concat_needs_an_order_and_text_sources(tmp_path, capsys):
    make_corpus(tmp_path / "in", 3)
    argv = ["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--tokenizer", str(TINY_TOKENIZER)]
    for extra, message in ((["--concat-by", "repo"], "give --concat-by and --concat-order together"),
                           (["--min-doc-tokens", "9", "--chat-key", "messages"], "are for text sources")):
        with pytest.raises(SystemExit):
            tokenize.main(argv + extra)
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_manifest_counts_the_tokens_of_long_documents(tmp_path):
    lengths = [100, 4095, 4096, 5000, 9000, 16384, 20000, 40000]
    write_shard(tmp_path / "00000_unshuffled.ds", [[1] + [7] * (n - 2) + [2] for n in lengths[:5]])
    write_shard(tmp_path / "00001_unshuffled.ds", [[1] + [7] * (n - 2) + [2] for n in lengths[5:]])
    stale = {str(n): {"documents": 0, "tokens": 0} for n in LONG_DOCUMENTS}  # as data.held_out carries them over
    manifest = write_manifest(tmp_path, TOK, {"kind": "test"}, {"long_documents": stale})
    assert manifest["long_documents"] == {
        str(n): {"documents": sum(x >= n for x in lengths), "tokens": sum(x for x in lengths if x >= n)}
        for n in (4096, 8192, 16384, 32768)}
    assert load_manifest(tmp_path)["long_documents"]["16384"] == {"documents": 3, "tokens": 76384}


@pytest.fixture(scope="module")
def long_source(tmp_path_factory):
    """Documents 2 to 50,000 tokens long; document i's tokens between its <s> and </s> are all 3 + i."""
    directory = tmp_path_factory.mktemp("long")
    rng = np.random.default_rng(0)
    docs = [[1] + [3 + i] * int(n - 2) + [2] for i, n in enumerate(rng.choice([2, 30, 900, 5000, 20_000, 50_000], 60))]
    write_shard(directory / "00000_unshuffled.ds", docs)
    write_manifest(directory, TOK, {"kind": "test"})
    return directory


@pytest.mark.parametrize("seq_len", [4096, 16384, 32768])
def test_packing_restarts_positions_and_masks_at_every_document(long_source, seq_len):
    """A packed sample's positions restart at 0 at every <s> and at its start (today's rule at 4k), and the
    model's masks (window and full layers) let a token see exactly the earlier tokens of its own document."""
    mixture = Mixture([SourceSpec("long", long_source, weight=1.0, max_epochs=10)], seq_len=seq_len)
    batch = mixture.batch([0, 1, 2])
    ids, positions = torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["positions"])
    starts = (ids == 1) | (torch.arange(seq_len) == 0)
    doc = starts.cumsum(1)  # which document (or sample-start piece) each token is in, from the tokens alone
    idx = torch.arange(seq_len).expand_as(ids)
    first = torch.zeros_like(ids).masked_scatter(starts, idx[starts])
    assert torch.equal(positions, idx - first.cummax(1).values)
    assert starts[:, 1:].sum() >= 3  # document boundaries inside the samples
    assert positions.max() >= min(seq_len // 2, 4096 * 2)  # and documents that run long inside them

    model = model_registry("tiny", attn_backend="dense", max_seq_len=seq_len).model.build()
    masks = model.attention_masks(ids, positions)
    for b in range(ids.shape[0]):
        bounds = torch.nonzero(starts[b]).flatten()
        q = torch.unique(torch.cat([bounds, (bounds - 1).clamp(min=0), torch.randint(0, seq_len, (16,))]))
        kv = torch.arange(seq_len)
        same_doc, causal = doc[b, q][:, None] == doc[b, kv][None, :], kv[None, :] <= q[:, None]
        for window, mask in masks.items():
            want = same_doc & causal & ((q[:, None] - kv[None, :] < window) if window else True)
            got = mask.mask_mod(torch.tensor(b), torch.tensor(0), q[:, None], kv[None, :])
            assert torch.equal(got, want), (b, window)


def test_concat_by_on_slurm_runs_its_two_stages_then_the_manifest(tmp_path):
    """Three jobs, each depending on the one before: rows to buckets, repositories to shards, the manifest."""
    from tests.data.test_tokenize import FAKE_SBATCH, FAKE_SRUN

    fake, jobs = tmp_path / "bin", tmp_path / "jobs"
    fake.mkdir(), jobs.mkdir()
    for name, body in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", "#!/bin/sh\necho localhost\n")):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    tokenize_code(tmp_path, "reference", tasks=2)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "FAKE_SLURM_DIR": str(jobs), "HOME": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "data.tokenize", "--input", str(tmp_path / "in"), "--out",
                    str(tmp_path / "out"), "--tokenizer", str(TINY_TOKENIZER), "--text-key", "content", "--tasks", "2",
                    "--concat-by", "max_stars_repo_name", "--concat-order", "max_stars_repo_path", "--slurm",
                    "--partition", "cpu"], check=True, env=env, cwd=REPO, capture_output=True)
    scripts = sorted((p for p in jobs.glob("*.sh") if "launch_pickled_pipeline" in p.read_text()),  # not merge_stats
                     key=lambda p: int(p.stem.removeprefix("job")))  # in submission order
    assert len(scripts) == 3 and "/logs/repositories" in scripts[0].read_text()
    for i, script in enumerate(scripts):
        assert ("--dependency=afterok:" in (jobs / f"{script.stem}.args").read_text()) == (i > 0)
        for rank in (0, 1) if i < 2 else (0,):
            node_env = {**env, "SLURM_ARRAY_TASK_ID": str(rank), "RUN_OFFSET": "0", "SLURM_NODELIST": "localhost"}
            subprocess.run(["bash", str(script)], check=True, env=node_env, cwd=tmp_path, capture_output=True)
    assert load_manifest(tmp_path / "out")["concat"] == load_manifest(tmp_path / "reference")["concat"]
    assert documents(tmp_path / "out") == documents(tmp_path / "reference")


def test_a_recipe_source_tokenizes_with_its_long_document_keys(tmp_path):
    """``min_doc_tokens``, ``concat_by`` and ``concat_order`` on ``[[data.sources]]`` reach data.tokenize:
    ``train.data tokenize`` makes what the command line's flags make."""
    from train import data as train_data
    from train import recipe as R

    rows = code_rows()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = (f'{{name = "repos", path = "{tmp_path / "out"}", input = "{tmp_path / "in"}", text_key = "content", '
              'weight = 1.0, concat_by = "max_stars_repo_name", concat_order = "max_stars_repo_path", '
              'min_doc_tokens = 30}')
    sets = [f"run.output_dir={tmp_path / 'run'}", f"data.sources=[{source}]", "data.held_out=0"]
    assert train_data.main(["tokenize", "--recipe", "tiny", "--source", "repos", *(f"--set={s}" for s in sets)]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["concat"]["repositories"] == 9 and manifest["min_doc_tokens"]["min"] == 30
    assert manifest["min_doc_tokens"]["dropped_documents"] > 0  # the small repositories
    flags = tokenize.run(str(tmp_path / "in"), tmp_path / "flags", TINY_TOKENIZER, text_key="content",
                         concat_by="max_stars_repo_name", concat_order="max_stars_repo_path", min_doc_tokens=30)
    assert sorted(documents(tmp_path / "out")) == sorted(documents(tmp_path / "flags"))
    assert {k: flags[k] for k in ("concat", "min_doc_tokens")} == {k: manifest[k] for k in ("concat", "min_doc_tokens")}

    for extra, message in ((', concat_by = "repo"}', "give concat_by and concat_order together"),
                           (', min_doc_tokens = 0}', "min_doc_tokens must be >= 1, got 0"),
                           (', min_doc_tokens = 9, chat_key = "messages"}', "are for text sources")):
        bad = source.replace(', min_doc_tokens = 30}', "").replace(', concat_by = "max_stars_repo_name", '
                                                                   'concat_order = "max_stars_repo_path"', "")
        with pytest.raises(R.RecipeError, match=r"\[data.sources\[0\]\] source 'repos' .*" + message):
            R.load("tiny", [*sets[:1], f"data.sources=[{bad + extra}]"])
