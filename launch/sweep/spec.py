"""The sweep file, checked, and its variants: loaded and preflighted as train.py would, named by what
differs from the baseline (the file's format is in ``launch.sweep``'s docstring)."""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rundir import parse_set
from train import recipe as R
from report.comparable import METRICS

RESERVED = ("run.output_dir", "run.seed", "run.name")  # the sweep sets these for every run
KEYS = {"name", "recipe", "seeds", "baseline", "set", "vary", "metric"}


class SweepError(ValueError):
    """A sweep file or variant problem, naming the file (and variant, key)."""


@dataclass
class Sweep:
    path: Path
    name: str
    recipe: str
    seeds: list[int]
    baseline: dict[str, Any]
    sets: dict[str, Any]  # [set] plus the command line's --set, flattened to dotted keys
    grids: list[dict[str, list]]  # [vary], or each [[vary]]
    metric: str | None = None  # what report compares the runs on; None: its default for the runs' kind

    @property
    def axes(self) -> list[str]:
        """Every varied key, in the file's order."""
        return list(dict.fromkeys(k for g in self.grids for k in g))


@dataclass
class Variant:
    declared: dict[str, Any]  # the axis values this variant sets
    values: dict[str, Any] = field(default_factory=dict)  # every axis key's value as the run resolves it
    name: str = ""
    recipe: R.Recipe | None = None
    config: Any = None  # the model config, None when the model's checks failed


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"delay": 2}}`` and ``{"model.delay": 2}`` alike as ``{"model.delay": 2}``."""
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_sweep(path: str | Path, extra_sets: list[str] = ()) -> Sweep:
    """The sweep file, checked: every problem names the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: sweep file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    R.check_keys(raw, KEYS, path, "sweep")  # a RecipeError naming the file and the closest key
    for key in ("recipe", "seeds", "vary"):
        if key not in raw:
            raise SweepError(f"{path}: missing key '{key}'")
    for key in ("set", "baseline"):
        if not isinstance(raw.get(key, {}), dict):
            raise SweepError(f"{path}: {key}: expected a table")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise SweepError(f"{path}: name: expected letters, digits, '.', '_' or '-', got {name!r}")
    seeds = raw["seeds"]
    if not (isinstance(seeds, list) and seeds and all(type(s) is int for s in seeds) and len(set(seeds)) == len(seeds)):
        raise SweepError(f"{path}: seeds: expected a non-empty list of distinct integers, got {seeds!r}")
    sets = _flatten(raw.get("set", {}))
    for item in extra_sets:
        try:
            key, value = parse_set(item)
        except ValueError as e:
            raise SweepError(f"--set: {e}") from None
        sets[key] = value
    vary = raw["vary"]
    if not all(isinstance(g, dict) for g in (vary if isinstance(vary, list) else [vary])):
        raise SweepError(f"{path}: vary: expected a table [vary] or tables [[vary]]")
    grids = [_flatten(g) for g in (vary if isinstance(vary, list) else [vary])]
    for i, grid in enumerate(grids):
        where = f"{path}: [vary]" if not isinstance(vary, list) else f"{path}: [[vary]] #{i + 1}"
        if not grid:
            raise SweepError(f"{where}: no axes")
        for key, values in grid.items():
            if not (isinstance(values, list) and values):
                raise SweepError(f"{where} {key}: expected a non-empty list of values, got {values!r}")
    axes = {k for g in grids for k in g}
    for key in (*sets, *axes):
        if key in RESERVED:
            raise SweepError(f"{path}: {key}: set by the sweep for every run (its dir, seed and name)")
        if "." not in key:
            raise SweepError(f"{path}: {key}: expected table.key")
    baseline = _flatten(raw.get("baseline", {}))
    if not baseline:
        raise SweepError(f"{path}: baseline: missing, e.g. baseline = {{ \"{sorted(axes)[0]}\" = ... }}")
    for key in baseline:
        if key not in axes:
            raise SweepError(f"{path}: baseline: {key} is not an axis of [vary] ({', '.join(sorted(axes))})")
    if not isinstance(raw["recipe"], str):
        raise SweepError(f"{path}: recipe: expected a recipe file or a name in recipes/, got {raw['recipe']!r}")
    metric = raw.get("metric")
    if metric is not None and metric not in METRICS:
        raise SweepError(f"{path}: metric: {metric!r} is not one a sweep is compared on; one of: {', '.join(METRICS)}")
    recipe = str(R.find(raw["recipe"]).resolve())  # the launchers run in the repo, wherever this ran
    return Sweep(path, name, recipe, seeds, baseline, sets, grids, metric)


def set_args(values: dict[str, Any]) -> list[str]:
    """``key=value`` items in the --set grammar (a JSON scalar or list is a TOML value)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def _value(recipe: R.Recipe, config, key: str, declared: Any) -> Any:
    """What the run will use for ``key``: a model field from the built config, a recipe value from
    the resolved recipe; the declared value where neither holds it."""
    table, _, name = key.partition(".")
    if table == "model" and name != "flavor" and config is not None and hasattr(config, name):
        return getattr(config, name)
    obj: Any = recipe
    for part in R.key_parts(key):
        if isinstance(obj, list):  # [[data.sources]]: by index or by name, as --set
            obj = next((s for i, s in enumerate(obj) if part in (i, getattr(s, "name", None))), declared)
        else:
            obj = obj.get(part, declared) if isinstance(obj, dict) else getattr(obj, str(part), declared)
    return obj


def value_text(value: Any) -> str:
    """A value as variant names and the grid show it (no '/': names are dir names)."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text.replace("/", "_")


def variants(sweep: Sweep, world: int, root: Path) -> tuple[list[Variant], str]:
    """Every distinct variant, loaded and preflighted as train.py would on ``world`` ranks, and the
    problems of those that fail (each named by its values and the failing key; "" if none). A variant
    whose recipe does not load is left out; one that loads but fails a check is kept, with its problems,
    so a dry run can still plan it."""
    from train.build import preflight

    found: dict[tuple, Variant] = {}
    problems = []
    axes = sweep.axes
    for grid in sweep.grids:
        for combo in itertools.product(*grid.values()):
            declared = dict(zip(grid, combo))
            label = ",".join(f"{k}={value_text(v)}" for k, v in declared.items())
            sets = set_args({**sweep.sets, **declared, "run.output_dir": str(root)})
            try:
                recipe = R.load(sweep.recipe, sets)
                checked = preflight(recipe, world)
            except R.RecipeError as e:
                problems.append((label, [str(e)]))
                continue
            v = Variant(declared, recipe=recipe, config=checked.config)
            v.values = {k: _value(recipe, checked.config, k, declared.get(k)) for k in axes}
            key = tuple(json.dumps(v.values[k]) for k in axes)
            if key in found:  # the same run as an earlier grid's
                continue
            found[key] = v
            if checked.problems:
                problems.append((label, checked.problems))
    out = list(found.values())
    if out:
        name_variants(sweep, out)
    return out, _problem_text(sweep, problems) if problems else ""


def _problem_text(sweep: Sweep, problems: list[tuple[str, list[str]]]) -> str:
    """Problems every variant shares once (missing data, a tokenizer), the rest per variant."""
    common = set(problems[0][1]).intersection(*(set(p) for _, p in problems)) if len(problems) > 1 else set()
    lines = [f"{sweep.path}: {len(problems)} variant(s) refused"]
    if common:
        lines += ["every refused variant:", *(f"  {p}" for p in problems[0][1] if p in common)]
    for label, probs in problems:
        own = [p for p in probs if p not in common]
        lines += [f"variant {label}:", *(f"  {p}" for p in own)] if own else []
    return "\n".join(lines)


def name_variants(sweep: Sweep, found: list[Variant]) -> None:
    """Names from the values that differ from the baseline's (the baseline: its own values).
    A key is shown by its last part unless two axes share it."""
    axes = sweep.axes
    last = [k.rsplit(".", 1)[-1] for k in axes]
    short = {k: (s if last.count(s) == 1 else k) for k, s in zip(axes, last)}
    base = [v for v in found if all(v.values[k] == val for k, val in sweep.baseline.items())]
    if len(base) != 1:
        what = ", ".join(f"{k}={value_text(v)}" for k, v in sweep.baseline.items())
        raise SweepError(f"{sweep.path}: baseline: {what} matches {len(base)} variants; it must name exactly one "
                         "(add the keys that tell them apart)")
    for v in found:
        keys = list(sweep.baseline) if v is base[0] else [k for k in axes if v.values[k] != base[0].values[k]]
        v.name = ",".join(f"{short[k]}={value_text(v.values[k])}" for k in keys)
    found.sort(key=lambda v: v is not base[0])  # the baseline first
