"""data.tokenize: datatrove shards read back as SentencePiece's framed ids; reruns skip; manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import dill
import numpy as np
import pytest

from data import tokenize
from data.hf_tokenizer import PROBE_TEXTS as TRICKY
from data.shards import load_manifest, open_source
from data.tokenizer import TINY_TOKENIZER, load_tokenizer
from tests.requires import require

N_FILES = 3


def make_corpus(directory, n_docs: int = 300) -> list[list[str]]:
    """n_docs documents over N_FILES jsonl files; returns the texts per file."""
    rng = np.random.default_rng(0)
    words = TRICKY + ["data", "tokens", "</s>", "<s>", "𝔘", "漢字", "🤖", "\t", "  ", "\r\n", "0123456789"]
    files = [[] for _ in range(N_FILES)]
    for i in range(n_docs):
        text = "".join(str(rng.choice(words)) + str(rng.choice([" ", "", "\n"])) for _ in range(rng.integers(1, 40)))
        files[i % N_FILES].append(text if text.strip() else f"doc {i} </s>")  # readers drop empty texts
    directory.mkdir(parents=True, exist_ok=True)
    for f, docs in enumerate(files):
        with open(directory / f"part{f}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"id": f"{f}-{i}", "text": t}) + "\n" for i, t in enumerate(docs))
    return files


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    files = make_corpus(root / "in")
    manifest = tokenize.run(str(root / "in"), root / "out", TINY_TOKENIZER, tasks=2, workers=2)
    return root, files, manifest


def test_shards_hold_sentencepiece_ids(tokenized):
    root, files, _ = tokenized
    tok = load_tokenizer()
    source = open_source(root / "out", tok.fingerprint, tok.vocab_size)
    assert [s.path.name for s in source.shards] == ["00000_unshuffled.ds", "00001_unshuffled.ds"]
    for rank, shard in enumerate(source.shards):
        # JsonlReader gives task r the files r, r + 2, ... in order; documents are not shuffled
        texts = [t for f in range(rank, N_FILES, 2) for t in files[f]]
        assert shard.num_documents == len(texts)
        assert shard.tokens.dtype == np.uint16
        for i, text in enumerate(texts):
            assert shard.document(i).tolist() == tok.encode_document(text), repr(text)


def test_manifest(tokenized):
    root, files, manifest = tokenized
    tok = load_tokenizer()
    assert load_manifest(root / "out") == manifest
    expected = [tok.encode_document(t) for f in files for t in f]
    assert manifest["tokenizer"] == {"path": "assets/tokenizer/tokenizer.model", "fingerprint": tok.fingerprint,
                                     "vocab_size": 4096, "bos_id": 1, "eos_id": 2, "framing": "bos_eos"}
    assert manifest["num_documents"] == 300
    assert manifest["num_tokens"] == sum(map(len, expected))
    assert (manifest["token_size"], manifest["dtype"], manifest["tasks"]) == (2, "uint16", 2)
    assert manifest["datatrove_version"] == version("datatrove")
    assert manifest["input"]["kind"] == "jsonl" and manifest["input"]["folder"] == str(root / "in")
    for entry in manifest["shards"]:
        path = root / "out" / entry["file"]
        assert entry["bytes"] == path.stat().st_size == 2 * entry["tokens"]
    assert sum(e["documents"] for e in manifest["shards"]) == 300


def test_rerun_skips_finished_tasks(tokenized):
    root, _, manifest = tokenized
    out = root / "out"
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.ds")}
    assert tokenize.run(str(root / "in"), out, TINY_TOKENIZER, tasks=2) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.ds")} == mtimes
    # lose task 1: only it runs again, with the same result
    (out / "logs" / "completions" / "00001").unlink()
    (out / "00001_unshuffled.ds").unlink()
    assert tokenize.run(str(root / "in"), out, TINY_TOKENIZER, tasks=2) == manifest
    assert (out / "00000_unshuffled.ds").stat().st_mtime_ns == mtimes["00000_unshuffled.ds"]
    assert (out / "00001_unshuffled.ds").stat().st_mtime_ns != mtimes["00001_unshuffled.ds"]


def test_manifest_step_pickles_and_refuses_unfinished(tokenized):
    root, _, manifest = tokenized
    step = dill.loads(dill.dumps(tokenize.WriteManifest(str(root / "out"), manifest["tokenizer"],
                                                        manifest["input"], tasks=2)))
    assert type(step).__module__ == "data.tokenize"
    list(step.run())
    step.tasks = 3
    with pytest.raises(RuntimeError, match=r"tasks \[2\] did not finish"):
        step.run()


def test_parquet_glob_input(tmp_path):
    pa = require("pyarrow", "parquet input (datasets' own dependency)")
    import pyarrow.parquet as pq

    texts = ["first </s> doc", " second\r\n", "日本語 🤖"]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"content": texts}), tmp_path / "in" / "a.parquet")
    manifest = tokenize.run(str(tmp_path / "in" / "*.parquet"), tmp_path / "out", TINY_TOKENIZER, text_key="content")
    tok = load_tokenizer()
    shard = open_source(tmp_path / "out").shards[0]
    assert [shard.document(i).tolist() for i in range(3)] == [tok.encode_document(t) for t in texts]
    assert manifest["input"]["kind"] == "parquet" and manifest["input"]["glob"] == "*.parquet"


def test_a_text_key_that_matches_nothing_exits_2_naming_the_columns_and_a_fixed_rerun_tokenizes(tmp_path, capsys):
    """A wrong --text-key reads every row and finds no text: an error naming the key and the columns
    the rows have (parquet too), no manifest; the same command with the right key then tokenizes."""
    pa = require("pyarrow", "parquet input (datasets' own dependency)")
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"content": ["one doc", "two docs"], "id": [1, 2]}), tmp_path / "in" / "a.parquet")
    argv = ["--input", str(tmp_path / "in" / "*.parquet"), "--tokenizer", str(TINY_TOKENIZER), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        tokenize.main([*argv, "--text-key", "text"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no documents: --text-key 'text' matched no text; its rows have the columns ['content', 'id']" in err
    assert not (tmp_path / "out" / "manifest.json").exists()
    tokenize.main([*argv, "--text-key", "content"])
    assert load_manifest(tmp_path / "out")["num_documents"] == 2


def test_describe_input(tmp_path):
    assert tokenize.describe_input("HuggingFaceFW/fineweb-edu", "train", "sample-10BT") == {
        "kind": "hub", "dataset": "HuggingFaceFW/fineweb-edu", "split": "train", "subset": "sample-10BT"}
    assert tokenize.describe_input(f"{tmp_path}/data/**/*.jsonl.gz") == {
        "kind": "jsonl", "folder": f"{tmp_path}/data", "glob": "**/*.jsonl.gz"}
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x.parquet").touch()
    assert tokenize.describe_input(str(tmp_path / "p"))["glob"] == "**/*.parquet"


FAKE_SBATCH = """#!/bin/bash
# records the job script (last argument) and its sbatch options instead of submitting
n=$(( $(ls "$FAKE_SLURM_DIR" | grep -c '\\.sh$') + 1 ))
cp "${@: -1}" "$FAKE_SLURM_DIR/job$n.sh"
echo "$@" > "$FAKE_SLURM_DIR/job$n.args"
echo "Submitted batch job $n"
"""
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do [[ "$1" == -n ]] && shift; shift; done
exec "$@"
"""


def test_slurm_submission_runs_on_nodes(tmp_path):
    """--slurm writes array + manifest jobs; run as a node would (other cwd, bare PATH) they finish the job."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", "#!/bin/sh\necho localhost\n")):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    make_corpus(tmp_path / "in", 60)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "FAKE_SLURM_DIR": str(jobs), "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "data.tokenize", "--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
           "--tokenizer", str(TINY_TOKENIZER), "--tasks", "2", "--slurm", "--partition", "cpu", "--time", "1:00:00", "--sbatch-arg", "signal=USR1@60"]
    subprocess.run(cmd, check=True, env=env, cwd=Path(tokenize.__file__).parent.parent, capture_output=True)
    scripts = {p.stem: p.read_text() for p in jobs.glob("*.sh")}
    array = [k for k, v in scripts.items() if "launch_pickled_pipeline" in v and "/out/logs/" in v]
    manifest_job = [k for k, v in scripts.items() if "launch_pickled_pipeline" in v and "logs_manifest" in v]
    assert len(array) == 1 and len(manifest_job) == 1
    assert "#SBATCH --array=0-1" in scripts[array[0]] and "#SBATCH --signal=USR1@60" in scripts[array[0]]
    assert "--qos" not in scripts[array[0]]
    assert "--dependency=afterok:" in (jobs / f"{manifest_job[0]}.args").read_text()
    assert not (tmp_path / "out" / "manifest.json").exists()
    for job, ranks in ((array[0], (0, 1)), (manifest_job[0], (0,))):
        for rank in ranks:
            node_env = {**env, "SLURM_ARRAY_TASK_ID": str(rank), "RUN_OFFSET": "0", "SLURM_NODELIST": "localhost"}
            subprocess.run(["bash", str(jobs / f"{job}.sh")], check=True, env=node_env, cwd=tmp_path,
                           capture_output=True)
    manifest = load_manifest(tmp_path / "out")
    assert manifest["num_documents"] == 60 and len(manifest["shards"]) == 2


def test_hub_reader_arguments(tmp_path, monkeypatch):
    """The Hub branch's reader, pointed at a local dataset folder (no network here)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = make_corpus(tmp_path / "ds", 30)
    reader = tokenize.make_reader({"kind": "hub", "dataset": str(tmp_path / "ds"), "split": "train",
                                   "subset": None}, "text")
    texts = [d.text for d in reader.run(rank=0, world_size=1)]
    assert sorted(texts) == sorted(t for f in files for t in f)


@pytest.mark.parametrize("block, source, message", [
    ('[[data.sources]]\nname = "web"\nhub_id = "org/name"\npath = "x"\nweight = 1.0\n', "web-high",
     "no source named 'web-high'; sources: web"),
    ('[[data.sources]]\nname = "web"\npath = "x"\nweight = 1.0\n', "web", "web: hub_id: not set"),
])
def test_a_recipe_source_that_cannot_be_tokenized_is_refused(tmp_path, block, source, message):
    from tests.train.test_data_commands import recipe_with

    recipe = recipe_with(tmp_path, block)
    result = subprocess.run([sys.executable, "-m", "train.data", "tokenize", "--recipe", str(recipe), "--source", source],
                            cwd=Path(tokenize.__file__).parent.parent, capture_output=True, text=True)
    assert result.returncode == 2 and f"{recipe}: [[data.sources]]" in result.stderr and message in result.stderr


def test_input_needs_a_tokenizer(tmp_path, capsys):
    """No silent default: shards made with the tiny test tokenizer would not fit a real run's model."""
    make_corpus(tmp_path / "in", 3)
    with pytest.raises(SystemExit) as exit_:
        tokenize.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert "the following arguments are required: --tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
