"""Every check a launch makes before anything is written (``preflight``; ``--dry-run`` runs the same):
the recipe against the model, the files and this machine. Each problem is ``file: [table] key: why``;
a launch starts only with none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

import rundir
from rundir import writable
from data.chat import resolve_template, template_sha256
from data.held_out import held_out_dir, recorded_held_out
from data.loader import build_mixture
from data.mixture import Mixture
from data.pairs import MANIFEST_KEY as PAIRS
from data.shards import MANIFEST, load_manifest, open_source
from data.tokenizer import Tokenizer, check_sha256, how_to_get
from eval.suite import check_inputs
from models.laneformer import Laneformer
from models.laneformer.checkpoint import open_checkpoint
from health.storage import run_dir_problem
from train.build.resume import check_resume, optimizer_of
from train.muon import muon_names
from train.objectives import OBJECTIVES
from train.recipe.objective import PREFERENCE
from train.recipe import Recipe, RecipeError, check_needs, check_world, model_config


def initial_load(recipe: Recipe) -> tuple[str | None, bool]:
    """(checkpoint step dir or HF folder to start from, whether it is an HF export)."""
    src = recipe.checkpoint.init_from
    if src is None:
        return None, False
    path = Path(src)
    why = f"{recipe.path}: [checkpoint] init_from: {path}"
    if not path.exists():
        raise RecipeError(f"{why} does not exist")
    try:
        checkpoint = open_checkpoint(path)
    except FileNotFoundError:
        raise RecipeError(
            f"{why} holds no complete checkpoint "
            "(a run dir with checkpoints/step-N, a step dir with .metadata, or an HF export)"
        ) from None
    return str(checkpoint.folder), checkpoint.kind == "hf"


@dataclass
class Preflight:
    """What the checks found: the model config and mixture when they could be built, and
    every problem as ``file: [table] key: why``. A launch starts only with no problems."""

    config: Laneformer.Config | None = None
    mixture: Mixture | None = None
    problems: list[str] = field(default_factory=list)
    no_space: bool = False  # the run dir cannot hold its checkpoints (Exit.NO_SPACE when the only problem)


def preflight(recipe: Recipe, world_size: int) -> Preflight:
    """Every check a launch makes before anything is written (``--dry-run`` runs the same)."""
    out, p = Preflight(), recipe.path
    d, t, c = recipe.data, recipe.training, recipe.checkpoint

    def check(fn):
        try:
            return fn()
        except RecipeError as e:
            out.problems.append(str(e))

    check(lambda: check_world(recipe, world_size))
    out.config = check(lambda: model_config(recipe))
    if out.config is not None and t.seq_len > out.config.max_seq_len:
        out.problems.append(f"{p}: [training] seq_len: {t.seq_len} exceeds the model's max_seq_len "
                            f"{out.config.max_seq_len}")
    if out.config is not None and (beyond := [n for n in recipe.eval.val_seq_lens if n > out.config.max_seq_len]):
        out.problems.append(f"{p}: [eval] val_seq_lens: {beyond} exceed the model's max_seq_len "
                            f"{out.config.max_seq_len} (validation at a length the model has no positions for)")
    check(lambda: initial_load(recipe))
    tokenizer = None
    if not Path(d.tokenizer).is_file():
        out.problems.append(f"{p}: [data] tokenizer: {d.tokenizer} not found{how_to_get(d.tokenizer)}")
    else:
        try:
            tokenizer = Tokenizer(d.tokenizer)
        except (ValueError, OSError, RuntimeError) as e:
            out.problems.append(f"{p}: [data] tokenizer: {e}")
        if d.tokenizer_sha256 and (wrong := check_sha256(d.tokenizer, d.tokenizer_sha256)):
            out.problems.append(f"{p}: [data] tokenizer_sha256: {wrong}{how_to_get(d.tokenizer)}")
            tokenizer = None
    objective = OBJECTIVES[recipe.objective]
    if objective.reads_sources:
        out.problems += check_needs(recipe)
    if not d.sources and objective.reads_sources:
        out.problems.append(f"{p}: [data] sources: needs at least one [[data.sources]]")
    missing = [(i, s) for i, s in enumerate(d.sources) if not Path(s.path).is_dir()]
    for i, s in missing:
        out.problems.append(f"{p}: [data.sources[{i}]] path: {s.path} not found (source {s.name!r}; make it with "
                            f"{make_source_command(recipe, s)})")
    if out.config is not None and tokenizer is not None and (d.sources or not objective.reads_sources) \
            and not missing:
        try:  # the objective's own questions (a preference run's pairs open as pairs), then the mixture
            problems = objective.check(recipe, out.config, tokenizer)
            if not problems and recipe.objective != PREFERENCE and d.sources:
                out.mixture = check_data(recipe, out.config, tokenizer)
        except (ValueError, OSError) as e:
            out.problems.append(f"{p}: [data] sources: {e}")
        else:
            out.problems += problems + check_chat_templates(recipe)
    if tokenizer is not None:
        out.problems += check_held_out(recipe, tokenizer)
    if not writable(recipe.output_dir):
        out.problems.append(f"{p}: [run] output_dir: {recipe.output_dir} is not writable")
    elif out.config is not None:
        with torch.device("meta"):
            nparams = sum(q.numel() for q in out.config.build().parameters())
        if space := run_dir_problem(recipe.output_dir, nparams, c.keep_last, c.milestones):
            out.problems.append(f"{p}: [run] output_dir: {space}")
            out.no_space = True
    out.problems += [f"{p}: [eval] {problem}" for problem in check_inputs(recipe.eval.spec())]
    if c.export_hf and not writable(recipe.export_dir):
        out.problems.append(f"{p}: [checkpoint] export_dir: {recipe.export_dir} is not writable")
    if out.config is not None:
        out.problems += check_optimizer(recipe, out.config)
        out.problems += check_resume(recipe, out.config)
    return out


def check_optimizer(recipe: Recipe, config: Laneformer.Config) -> list[str]:
    """The optimizer against the model and the initial checkpoint: with ``[optimizer] name = "muon"``,
    ``muon_params`` picks at least one parameter, and only matrices (2-D, or ``[lanes, R, C]`` stacks), which
    torchtitan's groups would otherwise find at build; an ``init_from`` loaded with its optimizer state
    (``init_weights_only = false``) trained the same optimizer."""
    o, c, problems = recipe.optimizer, recipe.checkpoint, []
    where = getattr(recipe.path, "of", lambda table, key: str(recipe.path))
    if c.init_from and not c.init_weights_only:
        try:
            run = open_checkpoint(c.init_from).run_dir
        except FileNotFoundError:
            run = None  # initial_load reports it
        recorded = rundir.recorded_recipe(run) if run is not None else None
        if run is not None and recorded is not None and (then := optimizer_of(recorded)) != o.name:
            problems.append(f"{where('checkpoint', 'init_weights_only')}: [checkpoint] init_weights_only: false "
                            f"loads the optimizer state of {c.init_from}, which trained {then!r} "
                            f"({run / rundir.RECIPE_FILE}), into [optimizer] name = {o.name!r}: set "
                            f"init_weights_only = true (its weights, a fresh optimizer), or name {then!r}")
    if o.name != "muon":
        return problems
    with torch.device("meta"):
        shapes = {name: tuple(q.shape) for name, q in config.build().named_parameters()}
    picked, key = muon_names(shapes, o.muon_params), f"{where('optimizer', 'muon_params')}: [optimizer] muon_params"
    if not picked:
        return problems + [f"{key}: {o.muon_params} match no parameter of the model (names like "
                           f"{next(iter(shapes))!r})"]
    return problems + [f"{key}: {name} has shape {list(shapes[name])}; Muon takes 2-D matrices and [lanes, R, C] "
                       "stacks of them (leave it to AdamW)" for name in picked if len(shapes[name]) not in (2, 3)]


def make_source_command(recipe: Recipe, source) -> str:
    """The command that makes a missing source's shards: from its Hub dataset or ``input`` where it
    names one (train.data reads the recipe), else from the user's own files (data.tokenize)."""
    if source.hub_id or source.input:
        return f"python -m train.data tokenize --recipe {recipe.path} --source {source.name}"
    key = f"--chat-key {source.chat_key}" if source.chat_key else f"--text-key {source.text_key or 'text'}"
    if source.pairs:
        key = f"--pairs --seq-len {recipe.training.seq_len}"
    return (f"python -m data.tokenize --input <your jsonl/parquet files> {key} "
            f"--tokenizer {recipe.data.tokenizer} --out {source.path}")


def check_data(recipe: Recipe, config: Laneformer.Config, tokenizer: Tokenizer | None = None) -> Mixture:
    """Open and validate every source against the tokenizer and model, as training will."""
    t = recipe.training
    return build_mixture(recipe.data.sources, tokenizer or Tokenizer(recipe.data.tokenizer), t.seq_len,
                         recipe.run.seed, config.vocab_size, t.samples)


def check_held_out(recipe: Recipe, tokenizer: Tokenizer) -> list[str]:
    """Problems of the held-out sets the run validates on: a source with a ``held_out`` whose documents
    were not split off (the command that splits them, without re-tokenizing), or split with another
    setting, or whose held-out set cannot be read with the run's tokenizer."""
    p, problems = recipe.path, []
    for i, s in enumerate(recipe.data.sources):
        if not s.held_out or not Path(s.path).is_dir():
            continue  # a missing source is reported with the command that makes it (and holds out)
        where, held = f"{p}: [data.sources[{i}]] held_out: source {s.name!r}", held_out_dir(s.path)
        try:
            entry = recorded_held_out(s.path)
            if entry is None:
                problems.append(f"{where} has no held-out set ({held}); split it off without re-tokenizing: "
                                f"python -m train.data held-out --recipe {p} --source {s.name}")
            elif entry["held_out"] != s.held_out:
                problems.append(f"{where} is {s.held_out!r}, but {held / MANIFEST} records held_out {entry['held_out']!r}: "
                                "give that, or tokenize the source again")
            else:
                open_source(held, tokenizer.fingerprint, tokenizer.vocab_size)
        except ValueError as e:  # ShardError: an unreadable held-out set
            problems.append(f"{where}: {e}")
    return problems


def check_chat_templates(recipe: Recipe) -> list[str]:
    """Problems of chat and pair sources (training and held-out) against the run's template: a manifest
    that records another template (trained on one, exported with another), a ``chat_key`` source
    tokenized as plain text, or a ``pairs`` source not tokenized as pairs (and the reverse)."""
    p, d = recipe.path, recipe.data
    name, jinja = resolve_template(d.chat_template)
    sha = template_sha256(jinja)
    where: list[tuple[str, str, str | Path, str | None, bool | None]] = [  # table, source, path, chat_key, pairs
        (f"[data.sources[{i}]]", s.name, s.path, s.chat_key, s.pairs) for i, s in enumerate(d.sources)]
    where += [(f"[eval] val_sources[{i}]", Path(v).name, v, None, None) for i, v in enumerate(recipe.eval.val_sources)]
    where += [(f"[preference] held_out[{i}]", Path(v).name, v, None, True) for i, v in enumerate(recipe.preference.held_out)]
    where += [(f"[data.sources[{i}]] held_out", s.name, str(held_out_dir(s.path)), None, None)
              for i, s in enumerate(d.sources) if s.held_out]
    problems = []
    for table, source, path, chat_key, pairs in where:
        manifest = Path(path) / MANIFEST
        try:
            entries = load_manifest(path)
        except ValueError:
            continue  # a missing or unreadable manifest is reported by the checks that open the source
        key = PAIRS if PAIRS in entries else "chat"  # pair sources record their template as chat ones do
        chat = entries.get(key)
        retokenize = f"retokenize it with python -m train.data tokenize --recipe {p} --source {source}"
        if chat_key and chat is None:
            problems.append(f"{p}: {table} chat_key: source {source!r} is conversations, but {manifest} has no "
                            f"'chat' entry (tokenized as plain text?); {retokenize}")
        elif pairs is not None and pairs != (key == PAIRS):
            problems.append(f"{p}: {table} pairs: source {source!r} is {'' if pairs else 'not '}preference pairs, "
                            f"but {manifest} has {'no' if pairs else 'a'} 'pairs' entry; "
                            + (retokenize if pairs else "set pairs = true"))
        elif chat is not None and chat.get("template_sha256") != sha:
            problems.append(
                f"{p}: [data] chat_template: the run's template {name} (sha256 {sha[:12]}…) is not the one "
                f"source {source!r} was tokenized with: {manifest} records {key}.template "
                f"{chat.get('template')!r} (sha256 {str(chat.get('template_sha256'))[:12]}…). Set "
                "[data] chat_template to that template, or retokenize the source with this one")
    return problems
