"""What every launch leaves in its run dir, so the run stays reproducible.

``<run>/recipe.toml`` (resolved), ``<run>/laneformer_config.json`` (the model,
for export), and per launch ``<run>/launches/<n>/``: the git commit, the
uncommitted diff, the installed package versions, and a copy of the code.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import rundir
from rundir import REPO
from train.recipe import Recipe, to_toml

CODE_SUFFIXES = {".py", ".toml", ".md", ".cfg", ".txt", ".json", ".sh"}
CODE_NAMES = {"Makefile", "run"}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return f"(git {' '.join(args)} failed: {e})\n"


def code_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored source files, relative to the repo."""
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    return sorted(
        Path(f) for f in listed
        if (Path(f).suffix in CODE_SUFFIXES or Path(f).name in CODE_NAMES)
        and Path(f).parts[0] not in ("assets", rundir.RUNS_DIR) and (REPO / f).is_file()
    )


def record_launch(recipe: Recipe, model_config) -> Path:
    """Write the run's recipe and model config and this launch's snapshot; return its folder."""
    from models.laneformer import write_native_config

    run = recipe.output_dir
    run.mkdir(parents=True, exist_ok=True)
    (run / rundir.RECIPE_FILE).write_text(to_toml(recipe))
    write_native_config(model_config, run)
    launches = run / rundir.LAUNCHES_DIR
    launches.mkdir(exist_ok=True)
    n = 1 + max((int(p.name) for p in launches.iterdir() if p.name.isdigit()), default=0)
    launch = launches / f"{n:03d}"
    tmp = launches / f".{n:03d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / rundir.STARTED_FILE).write_text(datetime.now(timezone.utc).isoformat() + "\n")
    (tmp / rundir.GIT_COMMIT_FILE).write_text(_git("rev-parse", "HEAD"))
    (tmp / rundir.GIT_STATUS_FILE).write_text(_git("status", "--short"))
    (tmp / rundir.GIT_DIFF_FILE).write_text(_git("diff", "HEAD"))
    (tmp / rundir.PACKAGES_FILE).write_text("".join(
        sorted(f"{d.metadata['Name']}=={d.version}\n" for d in importlib.metadata.distributions())
    ))
    for f in code_files():
        (tmp / rundir.CODE_DIR / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tmp / rundir.CODE_DIR / f)
    tmp.rename(launch)
    return launch
