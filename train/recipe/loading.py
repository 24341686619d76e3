"""Reading a recipe: the TOML file, ``$LANEFORMER_DATA_ROOT`` and ``--set`` overrides, every key checked
against its table's declared type, then the tables' own checks (``__post_init__``) and ``resolve``.
Every problem found while parsing is reported at once, each naming the file (or the ``--set`` that
gave the key), the table and the key, with the closest valid key on a typo. ``to_toml`` writes the
resolved recipe back (``--print-config``, the run dir's ``recipe.toml``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from data.mixture import MixtureError
from eval.spec import EvalSpecError
from rundir import REPO, parse_set
from train.recipe.checks import resolve
from train.recipe.schema import RENAMED, TABLES, Model, Recipe, RecipeError, TableError

RECIPES = REPO / "recipes"
DATA_ROOT_ENV = "LANEFORMER_DATA_ROOT"


class RecipeFile(str):
    """A recipe's path, as every error prints it, that knows which keys ``--set`` gave: an error about
    such a key names the command line's ``--set table.key=value`` instead of the file."""

    sets: dict[tuple[str, str], str]

    def __new__(cls, path: Path | str, sets: dict[tuple[str, str], str] | None = None):
        self = super().__new__(cls, str(path))
        self.sets = sets or {}
        return self

    def of(self, where: str, key: str) -> str:
        """Who gave ``[where] key``: ``--set ...`` (on the command line, over the file) or the file."""
        table = where[1:-1] if where.startswith("[") else where  # "[data.sources[1]]" and "data.sources[1]"
        item = self.sets.get((table, key.split("[")[0].split(".")[0]))
        return f"--set {item} (over {self})" if item else str(self)


def find(name: str) -> Path:
    """A recipe path; a bare name is looked up in ``recipes/``."""
    path = Path(name)
    if not path.exists() and not path.is_absolute() and len(path.parts) == 1:
        candidate = RECIPES / (name if name.endswith(".toml") else name + ".toml")
        if candidate.exists():
            return candidate
    if not path.exists():
        raise RecipeError(f"{name}: recipe file not found (also looked in {RECIPES})")
    return path


def load(name: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override (``$LANEFORMER_DATA_ROOT``, then ``table.key=value``), check and resolve a recipe."""
    path = find(name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from e
    if os.environ.get(DATA_ROOT_ENV) and isinstance(raw.get("data"), dict):
        raw["data"]["root"] = os.environ[DATA_ROOT_ENV]
    read_renamed(raw, path)
    sets = {}
    for item in overrides:
        sets[_apply_override(raw, item, path)] = item
    recipe = _parse(raw, RecipeFile(path, sets))
    resolve(recipe)
    return recipe


def read_renamed(raw: dict, path: Path) -> None:
    """Rename ``RENAMED``'s old keys in ``raw`` to their new names, saying so on stderr; a table that
    holds both names is refused (which one to believe is the user's call)."""
    data = raw["data"] if isinstance(raw.get("data"), dict) else {}
    tables = {name: raw[name] for name in RENAMED if isinstance(raw.get(name), dict)}
    tables |= {f"data.sources[{i}]": s for i, s in enumerate(data.get("sources") or []) if isinstance(s, dict)}
    for where, table in tables.items():
        for old, new in RENAMED[where.split("[")[0]].items():
            if old not in table:
                continue
            if new in table:
                raise RecipeError(f"{path}: [{where}] has both '{old}' and '{new}': '{old}' is the old name of "
                                  f"'{new}'; keep '{new}' only")
            table[new] = table.pop(old)
            print(f"{path}: [{where}] {old}: renamed '{new}' in laneformer 0.2; read as {new} = {table[new]!r} "
                  "(the old name is read until the next release)", file=sys.stderr)


def key_parts(key: str) -> list[str | int]:
    """A ``--set`` key's path: ``data.sources[1].weight`` -> ``["data", "sources", 1, "weight"]``; a part
    after an array of tables may also be an element's ``name`` (``data.sources.code.weight``)."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", key)]


def _apply_override(raw: dict, item: str, path: Path) -> tuple[str, str]:
    """Set ``table.key=value`` in ``raw``; returns (table, key), the table as errors name it
    (``data.sources[1]``). An array of tables takes an element by index or by name, so a mixture
    ablation is a ``--set data.sources.code.weight=0.3`` (a sweep axis too)."""
    try:
        key, value = parse_set(item)
    except ValueError:
        key, value = "", None
    parts = key_parts(key)
    if len(parts) < 2 or not isinstance(parts[-1], str):
        raise RecipeError(f"--set {item!r}: expected table.key=value")
    node, where = raw, ""
    for part in parts[:-1]:
        if isinstance(node, list):
            i = _element(node, part, item, where)
            node, where = node[i], f"{where}[{i}]"
        elif isinstance(node, dict) and isinstance(part, str):
            node, where = node.setdefault(part, {}), f"{where}.{part}" if where else part
        else:
            raise RecipeError(f"--set {item!r}: {where} is not an array of tables, so it has no [{part}]"
                              if isinstance(node, dict) else f"--set {item!r}: {where} is {node!r}, not a table")
    if isinstance(node, list):
        raise RecipeError(f"--set {item!r}: {where} is an array of tables; name one: {where}.<name>.{parts[-1]} "
                          f"or {where}[<index>].{parts[-1]} ({_names(node)})")
    if not isinstance(node, dict):
        raise RecipeError(f"--set {item!r}: {where} is {node!r}, not a table")
    node[parts[-1]] = value
    return where, parts[-1]


def _element(tables: list, part: str | int, item: str, where: str) -> int:
    """The index of the element ``part`` names in an array of tables: an index, or a table's ``name``."""
    if isinstance(part, int):
        if part < len(tables):
            return part
        raise RecipeError(f"--set {item!r}: {where} has {len(tables)} tables, so no [{part}] ({_names(tables)})")
    named = [i for i, t in enumerate(tables) if isinstance(t, dict) and t.get("name") == part]
    if len(named) != 1:
        count = f"{len(named)} tables" if named else "no table"
        raise RecipeError(f"--set {item!r}: {where} has {count} named {part!r} ({_names(tables)})")
    return named[0]


def _names(tables: list) -> str:
    return "names: " + ", ".join(f"[{i}] {t.get('name')!r}" for i, t in enumerate(tables) if isinstance(t, dict))


def _collect(errors: list[str], fn, *args):
    """``fn(*args)``, or None with its RecipeError's lines added to ``errors``: every problem is reported at once."""
    try:
        return fn(*args)
    except RecipeError as e:
        errors.append(str(e))
        return None


def _parse(raw: dict, path: RecipeFile) -> Recipe:
    errors: list[str] = []
    _collect(errors, check_keys, raw, TABLES, path, "recipe")
    values = {}
    for name, cls in TABLES.items():
        if name not in raw:
            if not _has_default(Recipe, name):
                errors.append(f"{path}: missing table [{name}]")
        elif not isinstance(raw[name], dict):
            errors.append(f"{path.of(name, '')}: [{name}] must be a table")
        else:
            values[name] = _collect(errors, _parse_table, cls, raw[name], path, name)
    if errors:
        raise RecipeError("\n".join(errors))
    return Recipe(**values, path=path)  # a RecipeFile: later checks name a --set key by its --set too


def _parse_table(cls, table: dict, path: str | Path, where: str):
    if cls is Model:  # flavor plus free-form overrides, checked against the model later
        if "flavor" not in table:
            raise RecipeError(f"{path}: [model] missing key 'flavor'")
        flavor = check_value(table["flavor"], str, path, where, "flavor")
        return Model(flavor=flavor, overrides={k: v for k, v in table.items() if k != "flavor"})
    hints = typing.get_type_hints(cls)
    errors: list[str] = []
    _collect(errors, check_keys, table, hints, path, f"[{where}]")
    values = {}
    for name, tp in hints.items():
        if name not in table:
            if not _has_default(cls, name):
                errors.append(f"{path}: [{where}] missing key '{name}'")
            continue
        values[name] = _collect(errors, check_value, table[name], tp, path, where, name)
    if errors:
        raise RecipeError("\n".join(errors))
    try:
        return cls(**values)  # the table checks its own values (__post_init__)
    except TableError as e:
        raise RecipeError(f"{_source(path, where, e.key) if e.key else path}: [{e.table or where}] {e}") from e
    except (MixtureError, EvalSpecError) as e:  # SourceSpec and EvalSpec check their own values
        raise RecipeError(f"{path}: [{where}] {e}") from e


def check_keys(table: dict, valid, path, where: str) -> None:
    """Refuse keys not in ``valid``, every one of them (a line each), suggesting the closest one."""
    unknown = []
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, list(valid), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            unknown.append(f"{_source(path, where, key)}: {where} has unknown key '{key}'{hint}")
    if unknown:
        raise RecipeError("\n".join(unknown))


def _source(path, where: str, key: str) -> str:
    """Where ``[where] key`` came from: the ``--set`` that gave it, else the file."""
    return path.of(where, key) if isinstance(path, RecipeFile) else str(path)


def check_value(value, tp, path: str | Path, where: str, key: str):
    """``value`` checked (and lightly converted: int -> float) against type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = RecipeError(f"{_source(path, where, key)}: [{where}] {key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return check_value(value, arg, path, where, key)
            except RecipeError:
                pass
        raise bad
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{_source(path, where, key)}: [{where}] {key}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad
        return [check_value(v, args[0], path, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return {check_value(k, args[0], path, where, key): check_value(v, args[1], path, where, f"{key}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _parse_table(tp, value, path, f"{where}.{key}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return int(value)  # 4e12 tokens written as a float
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise bad
    return value


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _has_default(cls, name: str) -> bool:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


DERIVED = {("training", "global_batch_tokens"), ("training", "total_tokens"), ("schedule", "warmup_tokens")}


def to_toml(recipe: Recipe) -> str:
    """The resolved recipe as TOML (what ``--print-config`` shows and the run dir keeps)."""
    lines = [f"# resolved from {recipe.path}"]
    for name in TABLES:
        table = getattr(recipe, name)
        values = dataclasses.asdict(table)
        if name == "model":
            values = {"flavor": table.flavor, **table.overrides}
        sources = values.pop("sources", None)
        lines.append(f"\n[{name}]")
        for k, v in values.items():
            if v is not None:  # derived sizes are kept as comments
                lines.append(("# " if (name, k) in DERIVED else "") + f"{k} = {_toml_value(v)}")
        for src in sources or []:
            lines.append(f"\n[[{name}.sources]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in src.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)
