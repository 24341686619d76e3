"""train.titan changes torchtitan 0.3.0 in a few places, and LaneformerTrainer.train ports its loop; each
relies on a signature of torchtitan's or on the source it was ported from. When torchtitan's side
changes, this fails, before a run silently loses the spike guard's norm, the last step's log or a part
of torchtitan's step. Nothing else in train/ changes torchtitan, and no trainer hangs work on
torchtitan's loop (``should_continue_training``)."""

from __future__ import annotations

import ast
import hashlib
import inspect

from rundir import REPO
from train.titan import TORCHTITAN_API, TORCHTITAN_LOOP, TORCHTITAN_LOOP_FROM


def test_every_torchtitan_signature_train_titan_relies_on_is_unchanged():
    changed = {f"{getattr(owner, '__name__', owner)}.{name}": str(inspect.signature(getattr(owner, name)))
               for (owner, name), expected in TORCHTITAN_API.items()
               if expected is not None and str(inspect.signature(getattr(owner, name))) != expected}
    assert changed == {}
    for owner, name in TORCHTITAN_API:  # the ones any signature (or value) will do for must still exist
        assert hasattr(owner, name), (owner, name)


def test_the_loop_is_ported_from_torchtitans_unchanged_train_and_train_step():
    changed = [f"{owner.__name__}.{name}" for (owner, name), digest in TORCHTITAN_LOOP.items()
               if hashlib.sha256(inspect.getsource(getattr(owner, name)).encode()).hexdigest()[:16] != digest]
    assert changed == [], (f"torchtitan changed {changed} since the loop was ported: diff them against "
                           f"{TORCHTITAN_LOOP_FROM}, port the change to train/trainer.py, then update TORCHTITAN_LOOP "
                           "and TORCHTITAN_LOOP_FROM")


def test_the_check_sees_a_changed_signature(monkeypatch):
    from torchtitan.components.checkpointer import CheckpointManager

    monkeypatch.setattr(CheckpointManager, "_should_save", lambda self, step: True)
    expected = TORCHTITAN_API[(CheckpointManager, "_should_save")]
    assert str(inspect.signature(CheckpointManager._should_save)) != expected


def torchtitan_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torchtitan's modules and objects (``import torchtitan.x as y``,
    ``from torchtitan.x import y``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torchtitan":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] == "torchtitan")
    return names


def assignments_into(tree: ast.Module, names: set[str]) -> list[tuple[str, str]]:
    """(name, attribute) of every ``name.attribute = ...`` (or ``+=``, ``del``, ``setattr(name, ...)``) whose name
    is one of ``names``."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        found += [(t.value.id, t.attr) for t in targets
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in names]
    return found


def test_only_train_titan_assigns_into_torchtitan_and_only_what_it_pins():
    pinned = {(getattr(owner, "__name__", ""), name) for owner, name in TORCHTITAN_API}
    outside, unpinned = [], []
    for path in sorted((REPO / "train").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = torchtitan_names(tree)
        hits = assignments_into(tree, names)
        if path.name == "titan.py" and path.parent.name == "train":
            import train.titan as titan

            unpinned = [hit for hit in hits if (getattr(titan, hit[0]).__name__, hit[1]) not in pinned]
        else:
            outside += [f"{path.relative_to(REPO)}: {name}.{attr}" for name, attr in hits]
            if "sys.modules" in path.read_text():  # a module's namespace reached another way
                outside.append(f"{path.relative_to(REPO)}: sys.modules")
    assert outside == [] and unpinned == []


def test_no_trainer_overrides_torchtitans_loop_hooks():
    """The loop is LaneformerTrainer.train: a step's work is in it, not in ``should_continue_training`` (which
    torchtitan's loop asks before every step) or an override of ``train_step``."""
    overrides = [f"{path.relative_to(REPO)}: {node.name}"
                 for path in sorted((REPO / "train").rglob("*.py"))
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.FunctionDef) and node.name in ("should_continue_training", "train_step")]
    assert overrides == []
