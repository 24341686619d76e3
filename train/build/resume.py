"""A launch into a run dir that holds a complete checkpoint resumes from it, so the model and the data
order must be the ones those checkpoints were trained with: the run's ``laneformer_config.json`` and
``recipe.toml``, which the launch that trained them wrote. A recipe edited between launches (another
``ffn_hidden_dim``, ``seq_len``, seed or mixture) is refused here, before anything is written. Without
this check a model that no longer fits failed inside the load, and each of the run's checkpoints in
turn was moved aside as damaged; a changed mixture loaded and went on with another data order, its
past tokens per source recounted as if the new mixture had always held.

What may change on a resume: the world size, the batch, the steps, the optimizer's settings and the
schedule, the data's location (``[data] root``, a source's ``path``) and ``init_std`` (used only to
initialize). Not the optimizer itself (``[optimizer] name``): its state is in the checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import rundir
from models.laneformer import Laneformer, native_fields, read_native_config
from train.recipe import Recipe

Change = tuple[str, str, object, object, str]  # (table, key, now, then, the run's file saying then)
MAY_CHANGE = {"init_std"}  # model fields a resume may change
SCHEDULE_KEYS = ("name", "weight", "tokens")  # a source's keys that set which samples it gives (data.mixture)


def check_resume(recipe: Recipe, config: Laneformer.Config) -> list[str]:
    """``file: [table] key: why`` for each model field and data-order key that differs from what the run's
    checkpoints were trained with; [] when the run dir holds no complete checkpoint."""
    run = Path(recipe.output_dir)
    if rundir.latest_complete_checkpoint(run) is None:
        return []
    changed: list[Change] = []
    if (model_record := rundir.model_config_file(run)).is_file():
        try:
            then = _plain(native_fields(read_native_config(run)))
        except (ValueError, TypeError) as e:  # JSON's errors are ValueErrors; an unknown field, a TypeError
            return [f"{model_record}: cannot be read ({e}); the run's checkpoints were trained with the model it records"]
        now = _plain(native_fields(config))
        changed += [("model", k, now[k], then[k], rundir.MODEL_CONFIG_FILE) for k in now
                    if k not in MAY_CHANGE and now[k] != then[k]]
    optimizer: list[str] = []
    where = getattr(recipe.path, "of", lambda table, key: str(recipe.path))
    if (recorded := rundir.recorded_recipe(run)) is not None:
        changed += _data_order_changes(recipe, recorded)
        if (trained := optimizer_of(recorded)) != recipe.optimizer.name:
            optimizer.append(
                f"{where('optimizer', 'name')}: [optimizer] name: {recipe.optimizer.name!r}, but the checkpoints in "
                f"{run} hold the state of {trained!r} ({run / rundir.RECIPE_FILE}). A resume loads the optimizer's "
                f"state, which another optimizer cannot take: restore it, or start {recipe.optimizer.name!r} in "
                f"another run dir ([run] name) from these weights ([checkpoint] init_from = \"{run}\", with a fresh "
                "optimizer: init_weights_only = true)")
    return [f"{where(table, key)}: [{table}] {key}: {now!r}, but the checkpoints in {run} were trained with "
            f"{then!r} ({run / file}). A resume goes on with their model and data order: restore it, or train "
            f"the change in another run dir ([run] name) from these weights ([checkpoint] init_from = \"{run}\")"
            for table, key, now, then, file in changed] + optimizer


def optimizer_of(recorded: dict) -> str:
    """The ``[optimizer] name`` a run recorded (runs from before the field trained AdamW)."""
    return recorded.get("optimizer", {}).get("name", "adamw")


def _data_order_changes(recipe: Recipe, recorded: dict) -> list[Change]:
    """What data.mixture's sample order depends on: the length, the seed, and each source's name and
    share, in order (its path may move)."""
    file = rundir.RECIPE_FILE
    out: list[Change] = []
    for table, key, now in (("training", "seq_len", recipe.training.seq_len), ("run", "seed", recipe.run.seed)):
        if (then := recorded.get(table, {}).get(key)) is not None and then != now:
            out.append((table, key, now, then, file))
    sources_then = recorded.get("data", {}).get("sources", [])
    sources_now = [{k: getattr(s, k) for k in SCHEDULE_KEYS} for s in recipe.data.sources]
    names_then, names_now = [s.get("name") for s in sources_then], [s["name"] for s in sources_now]
    if names_then != names_now:
        return out + [("data", "sources", names_now, names_then, file)]
    for i, (spec, recorded_spec) in enumerate(zip(sources_now, sources_then)):
        out += [(f"data.sources[{i}]", k, spec[k], recorded_spec.get(k), file) for k in SCHEDULE_KEYS
                if spec[k] != recorded_spec.get(k)]
    return out


def _plain(fields: dict) -> dict:
    """As JSON holds it (tuples as lists), so a recorded config compares equal to a built one."""
    return json.loads(json.dumps(fields))
