"""What holds across a recipe's tables, checked and resolved once, at load (``resolve``), and the
questions asked of a resolved recipe later (the world it runs on, the sizes its sources promise).

``resolve`` makes every path absolute (a data path relative to ``[data] root``, the rest to the repo),
turns ``warmup_tokens`` into steps, records the one chat template the run uses and the held-out sets
it validates on, and refuses what no single table can see: a schedule longer than the run, two
sources reading the same rows, a preference run with a setting of ``[training]`` it cannot keep.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from data.chat import TEMPLATES, check_template, checkpoint_template, resolve_template
from data.held_out import held_out_dir
from data.mixture import MixtureError, check_distinct, needs
from train.recipe.objective import PREFERENCE
from train.recipe.schema import Recipe, RecipeError, TableError, absolute


def in_data_root(recipe: Recipe, path: str | Path) -> Path:
    """A data path: relative to ``[data] root`` when set, else to the repo."""
    root = recipe.data.root
    return Path(os.path.abspath(Path(root) / path)) if root else absolute(path)


def resolve(recipe: Recipe) -> None:
    """Make paths absolute, derive what needs two tables, and check what must hold together. Runs once
    a process, in ``train.recipe.load``: everything downstream gets the resolved recipe."""
    p, d, e, c = recipe.path, recipe.data, recipe.eval, recipe.checkpoint
    t, sched = recipe.training, recipe.schedule

    def fail(where: str, why: str):
        raise RecipeError(f"{p}: [{where}] {why}")

    recipe.run.output_dir = str(recipe.output_dir)
    d.tokenizer = str(absolute(d.tokenizer))
    d.root = d.root and str(absolute(d.root))
    d.sources = [dataclasses.replace(s, path=str(in_data_root(recipe, s.path)),
                                     input=s.input and str(absolute(s.input)),
                                     held_out=d.held_out if s.held_out is None and not s.pairs else s.held_out)
                 for s in d.sources]  # pairs: held out in a file of their own (data.held_out splits documents)
    e.val_sources = [str(in_data_root(recipe, v)) for v in e.val_sources]
    recipe.preference.held_out = [str(in_data_root(recipe, v)) for v in recipe.preference.held_out]
    e.core_bundle = e.core_bundle and str(absolute(e.core_bundle))
    e.lm_eval_tasks = e.lm_eval_tasks and str(absolute(e.lm_eval_tasks))
    e.evalplus_data = e.evalplus_data and ",".join(str(absolute(f)) for f in e.evalplus_data.split(","))
    c.init_from = c.init_from and str(absolute(c.init_from))
    c.export_dir = str(recipe.export_dir)
    d.chat_template = chat_template(recipe)

    try:
        check_distinct(d.sources)  # after the paths: two spellings of one input are one input
    except MixtureError as err:
        fail("data", f"sources: {err}")
    assert t.steps is not None and t.global_batch_tokens is not None  # made by Training.__post_init__
    if sched.warmup_tokens is not None and sched.warmup_steps is None:
        sched.warmup_steps = math.ceil(sched.warmup_tokens / t.global_batch_tokens)
    assert sched.warmup_steps is not None  # given, 0 (Schedule.__post_init__) or made just above
    if sched.warmup_steps + round(sched.decay_fraction * t.steps) > t.steps:
        fail("schedule", f"warmup ({sched.warmup_steps}) and decay ({sched.decay_fraction} of {t.steps}) exceed "
                         "the run")
    try:
        recipe.preference.check(t)
    except TableError as err:
        fail(err.table, str(err))
    check_context_parallel(recipe)
    recipe.validation_sets = validation_sets(recipe)


# torch's CP BlockMask (torch.distributed.tensor.experimental._attention._create_cp_block_mask) is rebuilt
# for a rank's queries in blocks of 128 tokens: each of the 2 x CP head-tail chunks needs whole blocks.
CP_BLOCK = 128


def check_context_parallel(recipe: Recipe) -> None:
    """What ``[parallel] context_parallel`` > 1 asks of the other tables, refused at load rather than as
    torch's error (or an eval's shape error) at the first step: a ``seq_len`` that CP's block mask can cut,
    no in-loop evaluation (the evals run the whole sequence through a model whose attention gathers the
    other CP ranks' keys), no preference run (its forward and reference pass do not slice the batch), no
    source ``loss_weight`` (torchtitan's CP slicing cuts tokens, labels and positions, not the weights)."""
    cp, t, e = recipe.parallel.context_parallel, recipe.training, recipe.eval
    if cp == 1:
        return
    where = f"{recipe.path}: [parallel] context_parallel: {cp}"
    if t.seq_len % (cp * CP_BLOCK):
        raise RecipeError(f"{where} needs [training] seq_len ({t.seq_len}) to be a multiple of {cp} x {CP_BLOCK} "
                          f"(torch's context-parallel block mask cuts each rank's share in blocks of {CP_BLOCK})")
    if e.every or e.at_end:
        raise RecipeError(f"{where} with in-loop evaluation ([eval] every, at_end): the evals do not cut their "
                          f"sequences over the CP ranks; set [eval] every = 0 and at_end = false and evaluate "
                          f"the checkpoints afterwards (python -m eval)")
    if recipe.objective == PREFERENCE:
        raise RecipeError(f"{where} in a preference run ([preference] loss): its loss and reference pass take "
                          f"whole sequences (a pair's log-probs), which CP cuts over its ranks")


def validation_sets(recipe: Recipe) -> dict[str, str]:
    """The held-out sets the run validates on, by the name its metrics carry: every source's with a
    held_out (``<path>/held_out``, named as the source), then each ``[eval] val_sources`` dir (named as
    its folder). ``resolve`` records them as ``recipe.validation_sets``."""
    sets = {s.name: str(held_out_dir(s.path)) for s in recipe.data.sources if s.held_out}
    for i, v in enumerate(recipe.eval.val_sources):
        if Path(v).name in sets:
            raise RecipeError(f"{recipe.path}: [eval] val_sources[{i}]: {v} would be named {Path(v).name!r}, as "
                              f"another held-out set is: rename its folder")
        sets[Path(v).name] = v
    return sets


def chat_template(recipe: Recipe) -> str:
    """The run's chat template as a data.chat spec: ``[data] chat_template`` (a name, or a path made
    absolute), else the template ``[checkpoint] init_from`` carries, else data.chat.DEFAULT; it must resolve,
    and a file's must render. A bundled one is not rendered here: its tests render it, and rendering
    imports transformers (0.5 s at every rank's start, in a run that may never use a template)."""
    spec, init = recipe.data.chat_template, recipe.checkpoint.init_from
    where = f"{recipe.path}: [data] chat_template"
    if spec is None and init:
        where += f" (unset, so the template of [checkpoint] init_from {init})"
    try:
        if spec is None:
            spec = (init and checkpoint_template(init)) or resolve_template()[0]
        elif spec not in TEMPLATES:
            spec = str(absolute(spec))
        if spec not in TEMPLATES:
            check_template(spec)
    except FileNotFoundError:
        raise RecipeError(f"{where}: {recipe.data.chat_template or spec!r} is neither a template name ({', '.join(TEMPLATES)}) "
                          f"nor an existing .jinja file, HF folder or tokenizer_config.json") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"{where}: {e}") from None
    return spec


def check_needs(recipe: Recipe) -> list[str]:
    """Sources whose expected size by their card cannot give what the run reads within ``max_epochs``:
    known before anything is downloaded or tokenized. Token sources are sized in tokens
    (``expected_tokens``), pair sources in pairs (``expected_pairs``, train.preference.plan)."""
    t, p = recipe.training, recipe.path
    if recipe.objective == PREFERENCE:
        from train.preference.plan import size_lines

        return size_lines(recipe)[1]
    try:
        rows = needs(recipe.data.sources, t.seq_len, t.samples)
    except MixtureError as e:
        return [f"{p}: [data] sources: {e}"]
    return [f"{p}: [data.sources[{i}]] expected_tokens: source {n.name!r} holds ~{n.expected_tokens:,} tokens by "
            f"its card but the plan reads {n.planned_tokens:,} (needs >= {n.needs:,} at max_epochs "
            f"{n.max_epochs:g}): lower its weight, raise max_epochs or add data"
            for i, n in enumerate(rows) if n.fits is False]


def dp_degrees(recipe: Recipe, world_size: int) -> tuple[int, int]:
    """(replicate, shard) on ``world_size`` ranks; a layout that does not divide them is an error naming the key.
    The ``[parallel] context_parallel`` ranks of a sequence are one data-parallel rank: shard x replicate is
    the world over CP (with CP 1, the world)."""
    par = recipe.parallel
    cp = par.context_parallel
    if world_size % cp:
        raise RecipeError(f"{recipe.path}: [parallel] context_parallel: {cp} does not divide the {world_size} ranks "
                          f"(ranks = context_parallel x shard x replicate)")
    world_size //= cp
    for key in ("replicate", "shard"):
        degree = getattr(par, key)
        if degree != -1 and world_size % degree:
            raise RecipeError(f"{recipe.path}: [parallel] {key}: {degree} does not divide the {world_size} ranks")
    replicate = par.replicate if par.replicate != -1 else world_size // par.shard
    shard = par.shard if par.shard != -1 else world_size // replicate
    if shard * replicate != world_size:
        raise RecipeError(f"{recipe.path}: [parallel] shard, replicate: {shard} x {replicate} is not the "
                          f"{world_size} ranks")
    return replicate, shard


def check_world(recipe: Recipe, world_size: int) -> int:
    """The data-parallel degree on ``world_size`` ranks; checks the layout and that the batch divides."""
    t = recipe.training
    replicate, shard = dp_degrees(recipe, world_size)
    dp = shard * replicate
    assert t.global_batch is not None  # made by Training.__post_init__
    if t.global_batch % (t.micro_batch * dp):
        raise RecipeError(
            f"{recipe.path}: [training] global_batch ({t.global_batch}) is not divisible by "
            f"micro_batch ({t.micro_batch}) x data-parallel size ({dp})"
        )
    return dp
