"""The packages form layers, and a module imports only from its own layer or those below:

    rundir <- data <- models <- eval <- train <- launch <- bench

(train.py is in train's layer; tests may import anything). Every import counts: at module
level, inside functions, under ``if TYPE_CHECKING``. An upward import is how a cycle starts
(the decoder's CLI once imported eval.load while eval.load imported the decoder)."""

from __future__ import annotations

import ast
from pathlib import Path

from rundir import REPO

LAYERS = ["rundir", "data", "models", "eval", "train", "launch", "bench"]
SKIP = {"tests", ".venv", "runs", "assets", "recipes"}


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name of this repo, or None (the standard library, a dependency)."""
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts == ["train"]:  # the train.py script
        return "train"
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``, relative ones resolved."""
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
    return found


def upward_imports(root: Path) -> list[str]:
    """``file:line: a (layer) imports b (higher layer)`` for every upward import under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info"):
            continue
        name = module_name(root, path)
        own = layer_of(name)
        if own is None:
            continue
        for line, target in imports(root, path):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                found.append(f"{rel}:{line}: {name} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]})")
    return found


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(REPO) == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_check_finds_a_planted_upward_import_wherever_it_hides(tmp_path):
    write(tmp_path, {
        "rundir/__init__.py": "import json\n",
        "data/__init__.py": "",
        "data/shards.py": "import rundir\nfrom rundir import REPO\n",  # downward: fine
        "models/__init__.py": "",
        "models/m.py": "def cli():\n    from eval.load import x  # the cycle the check exists for\n",
        "eval/__init__.py": "",
        "eval/load.py": "from models.m import cli\nfrom . import run\n",  # downward, and its own layer
        "eval/run.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from train.trainer import T\n",
        "train/__init__.py": "",
        "train/sub/__init__.py": "",
        "train/sub/x.py": "from ...launch import attempts\n",  # relative, two packages up
        "train.py": "import train.sub.x\nimport bench.common\n",
        "launch/__init__.py": "",
        "launch/attempts.py": "import rundir, data, models, eval, train\n",
        "bench/__init__.py": "",
        "bench/common.py": "import launch.attempts\n",
        "tests/test_x.py": "import bench.common\n",  # tests may import anything
    })
    assert upward_imports(tmp_path) == [
        "eval/run.py:3: eval.run (eval) imports train.trainer (train)",
        "models/m.py:2: models.m (models) imports eval.load (eval)",
        "train/sub/x.py:1: train.sub.x (train) imports launch (launch)",
        "train.py:2: train (train) imports bench.common (bench)",
    ]
