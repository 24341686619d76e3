"""Day one on real data, offline: ``train.data download`` fetches a recipe source from a Hub
(a local folder served as one, to huggingface_hub's real client) at a pinned commit, and
``train.data tokenize`` then tokenizes that local copy with the Hub cut off, keeping hub id,
subset, split, revision and the row filter in the manifest. ``data.tokenizer fetch`` puts a
tokenizer in place only if its sha256 is the expected one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.download import DownloadError, config_patterns
from data.shards import load_manifest, open_source
from data.tokenizer import TINY_TOKENIZER, fingerprint, load_tokenizer
from rundir import REPO
from tests.data.fake_hub import FakeHub, commit_of
from train import recipe as R

ROWS = {"high": [("web page one", "cc"), ("I am Tülu, made by Ai2", "hard_coded"), ("web page two", "cc")],
        "low": [("spam", "cc")]}


def hub_dataset(folder: Path) -> Path:
    """A dataset repo as the Hub lays it out: two configs in the card, one folder each."""
    for config, rows in ROWS.items():
        (folder / config).mkdir(parents=True)
        (folder / config / "part-0.jsonl").write_text(
            "".join(json.dumps({"text": t, "source": s}) + "\n" for t, s in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: High-Quality\n  data_files:\n  - split: train\n    path: high/*.jsonl\n"
        "- config_name: Low-Quality\n  data_files:\n  - split: train\n    path: low/*.jsonl\n---\n# A card\n")
    return folder


def recipe_with(tmp_path: Path, block: str) -> Path:
    """recipes/tiny.toml with its sources replaced by ``block``."""
    text = (REPO / "recipes" / "tiny.toml").read_text()
    start, stop = text.index("[[data.sources]]"), text.index("[optimizer]")
    path = tmp_path / "recipe.toml"
    path.write_text(text[:start] + block + "\n" + text[stop:])
    return path


def data_cli(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


WEB = ('[[data.sources]]\nname = "web"\nhub_id = "org/web"\nsubset = "High-Quality"\n'
       'path = "tokenized/web-high"\nweight = 1.0\nexclude = {{ source = ["hard_coded"] }}\nheld_out = 0\n{extra}')


def test_download_then_tokenize_the_local_copy_with_the_hub_cut_off(tmp_path):
    root, recipe = tmp_path / "data", recipe_with(tmp_path, WEB.format(extra=""))
    env = {"LANEFORMER_DATA_ROOT": str(root)}  # the one place the data lives
    with FakeHub({("dataset", "org/web"): hub_dataset(tmp_path / "repo")}, tmp_path / "hf") as hub:
        got = data_cli("train.data", "download", "--recipe", str(recipe), "--source", "web", env={**env, **hub.env})
    assert got.returncode == 0, got.stderr[-3000:]
    commit = commit_of("org/web")
    assert f'revision = "{commit}"' in got.stderr  # unpinned: says what to pin
    copy = root / "hub" / "org" / "web"
    files = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert files == ["README.md", "download-High-Quality.json", "high/part-0.jsonl"]  # that config only

    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf2")}
    got = data_cli("train.data", "tokenize", "--recipe", str(recipe), "--source", "web", env=offline)
    assert got.returncode == 0, got.stderr[-3000:]
    out = root / "tokenized" / "web-high"
    manifest = load_manifest(out)
    assert manifest["input"] == {"kind": "hub", "dataset": "org/web", "split": "train", "subset": "High-Quality",
                                 "revision": commit, "text_key": "text", "local_copy": str(copy),
                                 "exclude": {"source": ["hard_coded"]}}
    assert manifest["excluded_rows"] == 1
    tok = load_tokenizer()
    shard = open_source(out, tok.fingerprint).shards[0]
    got_docs = sorted(shard.document(i).tolist() for i in range(shard.num_documents))
    assert got_docs == sorted(tok.encode_document(t) for t, s in ROWS["high"] if s != "hard_coded")

    pinned = recipe_with(tmp_path, WEB.format(extra=f'revision = "{"0" * 40}"\n'))
    got = data_cli("train.data", "tokenize", "--recipe", str(pinned), "--source", "web", env=offline)
    assert got.returncode == 2
    assert f"web: revision: {'0' * 40}, but the copy in {copy} is {commit}" in got.stderr


def test_a_dataset_with_several_configs_needs_a_subset_before_anything_is_fetched(tmp_path):
    recipe = recipe_with(tmp_path, WEB.format(extra="").replace('subset = "High-Quality"\n', ""))
    with FakeHub({("dataset", "org/web"): hub_dataset(tmp_path / "repo")}, tmp_path / "hf") as hub:
        got = data_cli("train.data", "download", "--recipe", str(recipe), "--source", "web",
                       env={"LANEFORMER_DATA_ROOT": str(tmp_path / "data"), **hub.env})
    assert got.returncode == 2
    assert "org/web has 2 configs and no default: set subset to one of High-Quality, Low-Quality" in got.stderr
    assert not (tmp_path / "data" / "hub" / "org" / "web" / "high").exists()


@pytest.mark.parametrize("configs, subset, split, expected", [
    ([{"config_name": "a", "data_files": "a/*.parquet"}], None, "train", ["a/*.parquet"]),  # the only one
    ([{"config_name": "a", "data_files": [{"split": "train", "path": ["a/x-*.parquet", "a/y-*.parquet"]},
                                           {"split": "test", "path": "a/t-*.parquet"}]}], "a", "test", ["a/t-*.parquet"]),
    ([{"config_name": "a", "data_files": "a/*"}, {"config_name": "b", "default": True, "data_files": "b/*"}],
     None, "train", ["b/*"]),
    ([], None, "train", ["*"]),
])
def test_config_patterns_follow_the_card(configs, subset, split, expected):
    assert config_patterns(configs, "org/x", subset, split) == expected


def test_config_patterns_refuse_what_the_card_does_not_have():
    two = [{"config_name": "a", "data_files": "a/*"}, {"config_name": "b", "data_files": "b/*"}]
    with pytest.raises(DownloadError, match="no config 'c'; its card lists a, b"):
        config_patterns(two, "org/x", "c", "train")
    with pytest.raises(DownloadError, match="has no split 'test'"):
        config_patterns([{"config_name": "a", "data_files": [{"split": "train", "path": "a/*"}]}], "org/x", "a", "test")


def test_tokenizer_fetch_puts_in_place_only_the_expected_file(tmp_path):
    repo = tmp_path / "tok-repo"
    repo.mkdir()
    (repo / "tokenizer.model").write_bytes(TINY_TOKENIZER.read_bytes())
    out = tmp_path / "llama2"
    with FakeHub({("model", "org/tok"): repo}, tmp_path / "hf") as hub:
        wrong = data_cli("data.tokenizer", "fetch", "--repo", "org/tok", "--out", str(out), env=hub.env)
        right = data_cli("data.tokenizer", "fetch", "--repo", "org/tok", "--out", str(out),
                         "--sha256", fingerprint(TINY_TOKENIZER), env=hub.env)
    assert wrong.returncode == 2 and "expected 9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347" in wrong.stderr
    assert f"sha256 {fingerprint(TINY_TOKENIZER)}" in wrong.stderr and "nothing written" in wrong.stderr
    assert right.returncode == 0, right.stderr[-2000:]
    assert (out / "tokenizer.model").read_bytes() == TINY_TOKENIZER.read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.model"]


def test_the_data_root_moves_every_source_path_and_set_beats_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(R.DATA_ROOT_ENV, str(tmp_path / "env-root"))
    phase1 = R.load("phase1.toml")
    assert {Path(s.path).parent.parent.parent for s in phase1.data.sources} == {tmp_path / "env-root"}
    moved = R.load("phase1.toml", [f"data.root={tmp_path / 'set-root'}"])
    assert all(Path(s.path).is_relative_to(tmp_path / "set-root") for s in moved.data.sources)
    monkeypatch.delenv(R.DATA_ROOT_ENV)
    assert all(Path(s.path).is_relative_to("/data/laneformer") for s in R.load("phase1.toml").data.sources)


def test_every_source_of_a_recipe_is_verified_with_progress_on_stderr():
    result = data_cli("train.data", "verify", "--recipe", "tiny", env={})
    assert result.returncode == 0, result.stderr
    names = ("prose", "code", "prose/held_out", "code/held_out")  # the training sources and their held-out sets
    for name in names:
        assert f"ok {REPO / 'assets' / 'sample_data' / name}:" in result.stdout
    total = sum(p.stat().st_size for name in names
                for p in (REPO / "assets" / "sample_data" / name).glob("*.ds*") if not p.name.endswith(".metadata"))
    assert "verify: 100%" in result.stderr and "verify" not in result.stdout
    assert f"{total / 1e6:.2f}M/{total / 1e6:.2f}M" in result.stderr


def test_download_on_slurm_submits_the_same_command_as_a_job(tmp_path):
    """``--slurm``: one job running this command without --slurm (sbatch here is a stand-in that keeps
    the script; the download itself is tested above)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncat > {tmp_path / "job.sh"}\necho "Submitted batch job 7"\n')
    (bin_dir / "sbatch").chmod(0o755)
    recipe = recipe_with(tmp_path, WEB.format(extra=""))
    got = data_cli("train.data", "download", "--recipe", str(recipe), "--source", "web", "--slurm", "--partition",
                   "cpu", "--sbatch-arg", "account=lab", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "Submitted batch job 7"
    script = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --partition=cpu" in script and "#SBATCH --account=lab" in script
    assert f"-m train.data download --recipe {recipe} --source web --partition cpu" in script
    assert "--slurm" not in script
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)


def test_the_bundled_identity_conversations_tokenize_cleanly(tmp_path):
    """sft.toml's `identity` source: a file in the repo, rendered with the chat template, none refused."""
    block = ('[[data.sources]]\nname = "identity"\ninput = "assets/identity/conversations.jsonl"\nchat_key = "messages"\n'
             f'path = "{tmp_path / "identity"}"\nweight = 1.0\nheld_out = 0\n')
    got = data_cli("train.data", "tokenize", "--recipe", str(recipe_with(tmp_path, block)), "--source", "identity",
                   env={})
    assert got.returncode == 0, got.stderr[-2000:]
    manifest = load_manifest(tmp_path / "identity")
    lines = (REPO / "assets" / "identity" / "conversations.jsonl").read_text().splitlines()
    assert manifest["num_documents"] == len(lines) == 20 and manifest["chat"]["rejected"] == {}
    assert manifest["input"]["kind"] == "jsonl" and manifest["loss_mask"] is True
    assert all("Laneformer" in json.loads(line)["messages"][-1]["content"] for line in lines)


def test_a_plan_the_data_cannot_meet_is_refused_before_any_request(tmp_path):
    recipe = recipe_with(tmp_path, WEB.format(extra="expected_tokens = 10\nmax_epochs = 2\n"))
    with FakeHub({("dataset", "org/web"): hub_dataset(tmp_path / "repo")}, tmp_path / "hf") as hub:
        got = data_cli("train.data", "download", "--recipe", str(recipe), "--source", "web",
                       env={"LANEFORMER_DATA_ROOT": str(tmp_path / "data"), **hub.env})
        assert hub.requests == []
    assert got.returncode == 2
    assert f"{recipe}: [data.sources[0]] expected_tokens: source 'web' holds ~10 tokens by its card" in got.stderr
