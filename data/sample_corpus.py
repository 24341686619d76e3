"""Small, license-clean text corpora found on every machine, for tests and tiny recipes.

Nothing can be downloaded where the tests run, so the tiny tokenizer and the bundled
sample dataset are built from text the OS and the Python install already ship:

- prose: the license texts in /usr/share/common-licenses plus the Python
  documentation topics bundled with the standard library (pydoc_data);
- code: modules of the CPython standard library.

Every function returns documents in a fixed (sorted) order, so what is built from
them is reproducible on the same OS image and Python version.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

LICENSES_DIR = Path("/usr/share/common-licenses")
# Directories of the stdlib that are tests, demos, vendored or generated data.
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__",
              "ensurepip", "pydoc_data", "lib2to3"}


def stdlib_dir() -> Path:
    """The standard library of the running interpreter (the venv's base Python)."""
    return Path(sysconfig.get_paths()["stdlib"])


def prose_documents(licenses_dir: Path = LICENSES_DIR) -> list[tuple[str, str]]:
    """(id, text) pairs: one document per distinct license file, one per pydoc topic."""
    docs, seen = [], set()
    if licenses_dir.is_dir():
        for path in sorted(licenses_dir.iterdir()):
            real = path.resolve()
            if real in seen or not real.is_file():
                continue  # GPL -> GPL-3 etc. are symlinks: keep each text once
            seen.add(real)
            docs.append((f"license/{path.name}", real.read_text(encoding="utf-8", errors="replace")))
    from pydoc_data.topics import topics

    docs += [(f"pydoc/{name}", topics[name]) for name in sorted(topics)]
    return docs


def code_documents(max_bytes: int, root: Path | None = None, max_file_bytes: int = 120_000) -> list[tuple[str, str]]:
    """(id, text) pairs: stdlib .py files in sorted path order until max_bytes of text."""
    root = root or stdlib_dir()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        paths += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    docs, total = [], 0
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip() or len(text.encode()) > max_file_bytes:
            continue
        if total + len(text.encode()) > max_bytes:
            break
        docs.append((f"stdlib/{path.relative_to(root).as_posix()}", text))
        total += len(text.encode())
    return docs
