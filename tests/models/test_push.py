"""Hub upload of an exported folder, offline: dry-run listing and failure reporting."""

import hashlib
import os
import subprocess
import sys

import huggingface_hub
import pytest

from models.laneformer import push
from rundir import REPO as ROOT

FILES = {
    "config.json": b"{}",
    "README.md": b"# card",
    "model-00001-of-00002.safetensors": b"a" * 3000,
    "model-00002-of-00002.safetensors": b"b" * 1000,
    "model.safetensors.index.json": b"{}",
    "modeling_laneformer.py": b"# code",
}


@pytest.fixture
def folder(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


def test_dry_run_lists_files_sizes_sha256_repo_and_revision(folder, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", None)  # any Hub access would fail
    push.main([str(folder), "--repo-id", "kog/laneformer-test", "--step", "1200", "--dry-run"])
    out = capsys.readouterr().out
    assert "repo: kog/laneformer-test" in out and "revision: step-1200" in out
    for name, data in FILES.items():
        assert f"{name}  {len(data)} bytes  sha256 {hashlib.sha256(data).hexdigest()}" in out
    lines = [line.split()[0] for line in out.splitlines() if "sha256" in line]
    assert lines[-2:] == ["README.md", "config.json"]  # a partial upload never has config.json


def test_unreachable_hub_names_every_file(folder):
    # A real client against a closed port (a subprocess: huggingface_hub reads HF_ENDPOINT at import).
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_dummy"}
    result = subprocess.run(
        [sys.executable, "-m", "models.laneformer.push", str(folder), "--repo-id", "kog/laneformer-test", "--revision", "exp"],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode != 0
    assert "kog/laneformer-test@exp" in result.stderr and f"{len(FILES)} of {len(FILES)} files did not arrive" in result.stderr
    for name in FILES:
        assert name in result.stderr


class FlakyApi:
    """Stands in for HfApi: records calls, fails on the third upload."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private, exist_ok):
        self.calls.append(("create_repo", repo_id, private))

    def create_branch(self, repo_id, branch, exist_ok):
        self.calls.append(("create_branch", branch))

    def upload_file(self, path_or_fileobj, path_in_repo, repo_id, revision, commit_message):
        if sum(c[0] == "upload" for c in self.calls) == 2:
            raise ConnectionError("reset by peer")
        self.calls.append(("upload", path_in_repo, revision))


def test_partial_upload_names_the_files_that_did_not_arrive(folder, monkeypatch):
    FlakyApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FlakyApi)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    order = [str(p.relative_to(folder)) for p in push.upload_order(folder)]
    with pytest.raises(push.UploadError) as err:
        push.push(folder, "kog/laneformer-test", revision="step-5", private=True)
    assert FlakyApi.calls[:2] == [("create_repo", "kog/laneformer-test", True), ("create_branch", "step-5")]
    assert [c[1] for c in FlakyApi.calls[2:]] == order[:2]
    assert f"{len(order) - 2} of {len(order)} files did not arrive: {', '.join(order[2:])}" in str(err.value)
