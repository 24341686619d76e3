"""The packages form layers, and a module imports only from its own layer or those below:

    rundir <- health <- data <- models <- eval <- train <- plan <- report <- train.py <- launch <- bench

(train.py, the command line, prints the planner's and the report's output; tests may import anything). Every import counts: at module
level, inside functions, under ``if TYPE_CHECKING``. An upward import is how a cycle starts
(the decoder's CLI once imported eval.load while eval.load imported the decoder).

``train`` has rooms of its own, layered the same way (``TRAIN_ROOMS``, lowest first): its
base modules (the recipe, a preference run's losses and reference log-probs), the objectives, the
callbacks, the trainer and its torchtitan adapter, the build, and the entry points. No import circle inside train/."""

from __future__ import annotations

import ast
from pathlib import Path

from rundir import REPO

SCRIPT = "train.py"  # the command line's layer, above the planner and the report it prints

LAYERS = ["rundir", "health", "data", "models", "eval", "train", "plan", "report", SCRIPT, "launch", "bench"]
TRAIN_ROOMS = [
    ["train.recipe", "train.cpu", "train.snapshot", "train.metric_names", "train.preference", "train.muon"],
    ["train.objectives"],  # one a run: its loss, inputs, metrics, reference pass (the trainer calls it)
    ["train.callbacks"],
    ["train.titan", "train.trainer"],
    ["train.build"],
    ["train.data", "train.config_registry", "train"],  # the entry points ("train": the train.py script)
]
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


def imports(root: Path, path: Path, names: bool = False) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``, relative ones resolved; with ``names``, also
    ``package.name`` for each ``from package import name`` (it may be a module)."""
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
            if names:
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def upward_imports(root: Path) -> list[str]:
    """``file:line: a (layer) imports b (higher layer)`` for every upward import under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info"):
            continue
        name = module_name(root, path)
        own = LAYERS.index(SCRIPT) if rel == Path(SCRIPT) else layer_of(name)
        if own is None:
            continue
        for line, target in imports(root, path):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                found.append(f"{rel}:{line}: {name} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]})")
    return found


def room_of(module: str) -> int | None:
    """The room in train/ of a dotted module name (``train.callbacks.guard`` -> the callbacks room), or None."""
    for i, room in enumerate(TRAIN_ROOMS):
        if any(module == r or (r != "train" and module.startswith(r + ".")) for r in room):
            return i
    return None


def train_modules(root: Path) -> dict[str, Path]:
    found = {module_name(root, p): p for p in sorted((root / "train").rglob("*.py"))}
    if (root / "train.py").exists():
        found["train"] = root / "train.py"
    return found


def upward_in_train(root: Path) -> list[str]:
    """``file:line: a (room) imports b (higher room)`` inside train/, and modules in no room."""
    found = []
    for name, path in train_modules(root).items():
        own = room_of(name)
        if own is None:
            found.append(f"{path.relative_to(root)}: {name} is in no room of TRAIN_ROOMS")
            continue
        for line, target in imports(root, path):
            theirs = room_of(target)
            if theirs is not None and theirs > own and target != "train":
                found.append(f"{path.relative_to(root)}:{line}: {name} ({TRAIN_ROOMS[own][0]}) imports {target} "
                             f"({TRAIN_ROOMS[theirs][0]})")
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """Every import circle among train's modules (each as the path that closes it)."""
    modules = train_modules(root)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, target in imports(root, path, names=True):
            while target and target not in modules:  # ``from train.callbacks import guard``: guard, else the package
                target = target.rpartition(".")[0]
            if target and target not in (name, "train"):  # "train": the package's __init__, not the script
                targets.add(target)
        graph[name] = targets
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(REPO) == []


def test_train_rooms_import_only_their_own_room_or_lower_and_form_no_circle():
    assert upward_in_train(REPO) == []
    assert import_cycles(REPO) == []


def test_the_room_check_finds_a_planted_upward_import_and_a_circle(tmp_path):
    write(tmp_path, {
        "train/__init__.py": "",
        "train/callbacks/__init__.py": "",
        "train/callbacks/guard.py": "from train.trainer import LaneformerTrainer\n",  # a callback above the trainer
        "train/trainer.py": "from train.callbacks import guard\n",
        "train/callbacks/a.py": "import train.callbacks.b\n",
        "train/callbacks/b.py": "from train.callbacks import a\n",  # a circle inside one room
        "train/stray.py": "",
    })
    assert upward_in_train(tmp_path) == [
        "train/callbacks/guard.py:1: train.callbacks.guard (train.callbacks) imports train.trainer (train.titan)",
        "train/stray.py: train.stray is in no room of TRAIN_ROOMS",
    ]
    assert sorted(map(tuple, import_cycles(tmp_path))) == [
        ("train.callbacks.a", "train.callbacks.b", "train.callbacks.a"),
        ("train.callbacks.guard", "train.trainer", "train.callbacks.guard"),
    ]


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
        "train.py:2: train (train.py) imports bench.common (bench)",
    ]
