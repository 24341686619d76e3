"""Upload an exported Laneformer folder to the Hugging Face Hub.

    python -m models.laneformer.push <hf dir> --repo-id ORG/NAME [--revision BRANCH | --step N] [--private] [--dry-run]

The token comes from ``HF_TOKEN``. ``--revision`` (or ``--step N``, which
names the branch ``step-N``) uploads to a branch, created from main if
missing, so every checkpoint of a run can be published side by side.

Files go up one commit each, ``README.md`` and ``config.json`` last, so a
branch interrupted mid-upload never looks like a loadable model, and a
failure names exactly the files that did not arrive. ``--dry-run`` touches
no network: it prints the target and every file with its size and sha256.
Progress goes to stderr: files uploaded of total, and within a file
huggingface_hub's own upload bar (unless ``HF_HUB_DISABLE_PROGRESS_BARS`` is set).
"""

import argparse
import hashlib
import os
import sys
from pathlib import Path

from rundir.progress import progress

LAST = ("README.md", "config.json")  # uploaded last: their presence means the upload finished


def upload_order(folder: Path) -> list[Path]:
    """Every file under ``folder`` (hidden ones excluded), README.md and config.json last."""
    files = [p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(files, key=lambda p: (LAST.index(p.name) + 1 if p.name in LAST else 0, str(p)))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dry_run(folder: Path, repo_id: str, revision: str, private: bool) -> str:
    lines = [f"repo: {repo_id}", f"revision: {revision}", f"private: {private}", "files:"]
    files = upload_order(folder)
    for p in files:
        lines.append(f"  {p.relative_to(folder)}  {p.stat().st_size} bytes  sha256 {sha256(p)}")
    lines.append(f"total: {len(files)} files, {sum(p.stat().st_size for p in files)} bytes")
    return "\n".join(lines)


class UploadError(RuntimeError):
    pass


def push(folder: Path, repo_id: str, revision: str = "main", private: bool = False) -> None:
    """Create the repo (and branch), then upload file by file; raise UploadError naming the files that did not arrive."""
    from huggingface_hub import HfApi

    api = HfApi(token=os.environ.get("HF_TOKEN"))
    files = upload_order(folder)
    done: list[Path] = []
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        for p in progress(files, desc="files uploaded", unit="file"):
            name = str(p.relative_to(folder))
            api.upload_file(
                path_or_fileobj=p, path_in_repo=name, repo_id=repo_id, revision=revision,
                commit_message=f"Upload {name}",
            )
            done.append(p)
    except Exception as e:
        missing = [str(p.relative_to(folder)) for p in files if p not in done]
        raise UploadError(
            f"upload to {repo_id}@{revision} failed ({type(e).__name__}: {e}); "
            f"{len(missing)} of {len(files)} files did not arrive: {', '.join(missing)}"
        ) from e


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.laneformer.push", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an exported HF folder (convert to-hf)")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME")
    branch = parser.add_mutually_exclusive_group()
    branch.add_argument("--revision", help="branch to upload to (created if missing); default main")
    branch.add_argument("--step", type=int, help="upload to branch step-<STEP>")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    args = parser.parse_args(argv)

    if not (args.folder / "config.json").exists():  # bad input: 2, as every CLI here
        parser.exit(2, f"error: {args.folder} has no config.json: not an exported model folder "
                       "(make one with python -m models.laneformer.convert to-hf RUN OUT)\n")
    revision = f"step-{args.step}" if args.step is not None else args.revision or "main"
    if args.dry_run:
        print(dry_run(args.folder, args.repo_id, revision, args.private))
        return
    try:
        push(args.folder, args.repo_id, revision, args.private)
    except UploadError as e:  # the Hub or the network, not the input: 1
        sys.exit(f"error: {e}")
    print(f"uploaded {args.folder} to {args.repo_id}@{revision}")


if __name__ == "__main__":
    main()
