"""Every file and folder name of a run dir or a sweep dir is written once, in ``rundir``: outside it
(and the tests) no ``.py`` file spells one as a string literal, so a writer and its readers cannot
drift apart (``"attempts.jsonl"`` was once spelled in four files).

The names are rundir's upper-case string constants ending in ``_FILE``, ``_DIR``, ``_PAGE`` or
``_LOG``. A literal is a ``str`` constant of the AST (docstrings and other bare strings aside) or a
literal piece of an f-string; one that holds a path (a ``/`` and no space) counts each of its parts.

- A name with a dot, dash or underscore (``attempts.jsonl``, ``compile_cache``) is flagged wherever
  it is a literal or a part of one.
- A plain word (``logs``, ``report``, ``hf``) is also a JSON key, a phase, a checkpoint kind: it is
  flagged where it is used as a path: beside ``/``, an argument of ``Path``/``open``/``joinpath``/
  ``with_name``/``os.path.join``, a keyword argument named like a path (``save_tb_folder=``),
  the value of an upper-case ``*_FILE``/``*_DIR``/``*_PAGE``/``*_LOG`` constant, or a part of a path
  literal.
- A template (``rank-{rank}.json``) is flagged as an f-string of the same shape (``f"rank-{r}.json"``)
  and as its glob (``"rank-*.json"``).

``ALLOWED`` lists the same word used for something that is not in a run dir, with why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rundir
from rundir import REPO

SKIP = {"tests", "rundir", ".venv", "runs", "assets"}
ALLOWED = {
    ("data/shards.py", "logs"): "datatrove's logging dir in a tokenized source's folder, not a run dir",
    ("bench/dataloader.py", "code"): "the bundled sample data's code source (assets/sample_data/code)",
    ("models/laneformer/push.py", "step-{step}"): "a Hub branch named after the checkpoint's step, not a folder",
    ("train/build/__init__.py", "compile_cache"): "the name of the function train.build.config.compile_cache in __all__",
}
PATH_CALLS = {"Path", "PurePath", "PosixPath", "open", "joinpath", "with_name"}
PATH_KEYWORD = re.compile(r".*(dir|folder|file|path)$")
NAME_CONSTANT = re.compile(r"[A-Z0-9_]+_(FILE|DIR|PAGE|LOG)")


def constants(module=rundir) -> dict[str, str]:
    """Every name constant of ``module``: constant name -> the name it spells."""
    return {key: value for key, value in vars(module).items() if NAME_CONSTANT.fullmatch(key) and isinstance(value, str)}


def names(module=rundir) -> dict[str, str]:
    """The name spelled -> its constant."""
    return {value: key for key, value in constants(module).items()}


def _shape(template: str) -> str:
    """``rank-{rank}.json`` -> ``rank-{}.json``."""
    return re.sub(r"\{[^}]*\}", "{}", template)


def _path_parts(text: str) -> list[str]:
    return [p for p in text.split("/") if p] if "/" in text and not re.search(r"\s", text) else []


def _is_path_use(node: ast.Constant, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.keyword):
        return bool(parent.arg and PATH_KEYWORD.fullmatch(parent.arg))
    if isinstance(parent, ast.Call) and node in parent.args:
        func = parent.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        joined = isinstance(func, ast.Attribute) and func.attr == "join" and ast.unparse(func.value) == "os.path"
        return name in PATH_CALLS or joined
    if isinstance(parent, (ast.Assign, ast.AnnAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return any(isinstance(t, ast.Name) and NAME_CONSTANT.fullmatch(t.id) for t in targets)
    return False


def literals(source: str, filename: str, names: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, the literal, the name it spells) for each literal of a name in ``source``, in line order."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings, bare strings
    plain = {v for v in names if "{" not in v}
    shapes = {_shape(v): v for v in names if "{" in v}
    globs = {re.sub(r"\{[^}]*\}", "*", v): v for v in names if "{" in v}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            shape = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if shape in shapes:
                found.append((node.lineno, ast.unparse(node), shapes[shape]))
            for piece in node.values:
                if isinstance(piece, ast.Constant):
                    found += [(node.lineno, piece.value, p) for p in _path_parts(piece.value) if p in plain]
            continue
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in bare:
            continue
        if isinstance(parents.get(node), ast.JoinedStr):
            continue  # a piece, seen above
        text = node.value
        if text in globs:
            found.append((node.lineno, text, globs[text]))
        elif text in plain and (not text.isalpha() or _is_path_use(node, parents)):
            found.append((node.lineno, text, text))
        else:
            found += [(node.lineno, text, p) for p in _path_parts(text) if p in plain]
    return sorted(found)


def repo_literals(root: Path, names: dict[str, str]) -> list[str]:
    """``file:line: 'literal' (rundir.NAME)`` for every literal of a name under ``root``, outside SKIP."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info"):
            continue
        for line, text, name in literals(path.read_text(), str(rel), names):
            if (rel.as_posix(), name) not in ALLOWED:
                out.append(f"{rel}:{line}: {text!r} (rundir.{names[name]})")
    return out


def test_each_name_is_one_constant_of_rundir():
    found = constants()
    assert {"ATTEMPTS_FILE", "SWEEP_FILE", "REPORT_PAGE", "REPORT_LOG", "HEARTBEAT_DIR", "BEAT_FILE",
            "REFERENCE_LOGPS_DIR", "REFERENCE_LOGPS_FILE", "REFERENCE_INPUTS_FILE"} <= set(found)
    assert len(set(found.values())) == len(found), "two constants spell one name"


def test_no_run_dir_name_is_spelled_outside_rundir():
    assert repo_literals(REPO, names()) == []


def test_the_check_finds_a_planted_literal_wherever_it_hides(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "launch" / "x.py").write_text('''"""Reads attempts.jsonl: a docstring may name it."""
from pathlib import Path
import rundir

ATTEMPTS = "attempts.jsonl"
LOGS_DIR = "logs"
def f(run, rank, kind):
    """"logs" here is fine."""
    a = Path(run) / "launcher" / rundir.ATTEMPTS_FILE
    b = open(f"{run}/report/report.html")
    c = run.glob("rank-*.json"), f"rank-{rank}.json"
    d = {"logs": 1}["logs"], kind == "hf", "report" in ("eval", "report")
    e = Path(run, "evals"), dict(save_tb_folder="tensorboard"), "launcher/attempts.jsonl"
    g = rundir.launcher_dir(run) / "stall: see exit.json"
    h = Path(run) / "reference_logps" / f"{kind}-{rank}.npy", run.glob("*-*.npy"), "inputs.json"
''')
    (tmp_path / "tests" / "test_x.py").write_text('A = "attempts.jsonl"\n')
    assert repo_literals(tmp_path, names()) == [
        "launch/x.py:5: 'attempts.jsonl' (rundir.ATTEMPTS_FILE)",
        "launch/x.py:6: 'logs' (rundir.LOGS_DIR)",
        "launch/x.py:9: 'launcher' (rundir.LAUNCHER_DIR)",
        "launch/x.py:10: '/report/report.html' (rundir.REPORT_DIR)",
        "launch/x.py:10: '/report/report.html' (rundir.REPORT_PAGE)",
        "launch/x.py:11: \"f'rank-{rank}.json'\" (rundir.BEAT_FILE)",
        "launch/x.py:11: 'rank-*.json' (rundir.BEAT_FILE)",
        "launch/x.py:13: 'evals' (rundir.EVALS_DIR)",
        "launch/x.py:13: 'launcher/attempts.jsonl' (rundir.ATTEMPTS_FILE)",
        "launch/x.py:13: 'launcher/attempts.jsonl' (rundir.LAUNCHER_DIR)",
        "launch/x.py:13: 'tensorboard' (rundir.TENSORBOARD_DIR)",
        "launch/x.py:15: '*-*.npy' (rundir.REFERENCE_LOGPS_FILE)",
        "launch/x.py:15: \"f'{kind}-{rank}.npy'\" (rundir.REFERENCE_LOGPS_FILE)",
        "launch/x.py:15: 'inputs.json' (rundir.REFERENCE_INPUTS_FILE)",
        "launch/x.py:15: 'reference_logps' (rundir.REFERENCE_LOGPS_DIR)",
    ]
