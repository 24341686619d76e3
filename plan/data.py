"""The data part of ``train.py --dry-run``: planned vs available tokens, and the realized mix."""

from __future__ import annotations

import os
from pathlib import Path

from train import recipe as R
from train.recipe.objective import PREFERENCE


def data_report(recipe: R.Recipe) -> str:
    """Every source's planned tokens, what it needs and its expected size (from the recipe alone,
    before any download), then the sources on this machine as the loader opens them.

    Raises ValueError when an opened source would be read beyond its max_epochs."""
    from data.mixture import needs
    from train.build import check_data
    from train.recipe import model_config

    t, sources = recipe.training, recipe.data.sources
    if recipe.objective == PREFERENCE:  # its pair sources are sized in pairs (train.preference.plan)
        return pairs_report(recipe)
    if not sources:  # an RL run reads its [rl] tasks (train.objectives.rl checks them in the preflight)
        return f"data plan: no [[data.sources]]: the {recipe.objective} objective reads its own data"
    rows = needs(sources, t.seq_len, t.steps * t.global_batch)
    lines = [f"data plan: {t.total_tokens:,} tokens; per source: planned tokens, the size that keeps it "
             "within max_epochs, and its expected size (expected_tokens, by its card)"]
    lines += [n.line() for n in rows]
    short = [n.name for n in rows if n.fits is False]
    unknown = [n.name for n in rows if n.fits is None]
    lines.append("data plan: " + (f"SHORT: {', '.join(short)}" if short else "every expected size covers its needs")
                 + (f"; not size-checked (no expected_tokens): {', '.join(unknown)}" if unknown else ""))
    unpinned = [s.name for s in sources if s.hub_id and not s.revision]
    if unpinned:
        lines.append(f"data plan: no revision pinned for {', '.join(unpinned)} (train.data download prints "
                     "the commit it fetched: pin it in the recipe)")
    missing = [str(s.path) for s in sources if not os.path.exists(s.path)]
    if missing:
        lines.append(f"not on this machine yet: {', '.join(missing)}")
    else:
        lines.append(check_data(recipe, model_config(recipe)).describe())
    return "\n".join(lines + long_documents_report(recipe) + held_out_report(recipe))


def long_documents_report(recipe: R.Recipe) -> list[str]:
    """Per source on this machine, the tokens its manifest counts in documents of at least 4k to 32k: a
    long-context phase packs documents, so only these teach it anything past the old length."""
    from data.shards import MANIFEST, describe_long_documents, load_manifest

    here = [s for s in recipe.data.sources if os.path.isfile(os.path.join(s.path, MANIFEST))]
    lines = [f"long documents (the run's seq_len: {recipe.training.seq_len:,}):"] if here else []
    return lines + [f"  {s.name}: {describe_long_documents(load_manifest(s.path))}" for s in here]


def held_out_report(recipe: R.Recipe) -> list[str]:
    """The held-out sets the run validates on, each with its size: its manifest's where it is split,
    else what the held_out setting makes of the source's expected size."""
    from data.held_out import held_out_dir, recorded_held_out
    from data.shards import load_manifest
    from train.metric_names import VAL_BPB, VAL_LOSS, per_set

    e, t = recipe.eval, recipe.training
    when = f"every {e.every} steps" if e.every else "at the end"
    lines = [f"held-out sets (never trained on; validated {when}"
             + (" and at the end" if e.every and e.at_end else "")
             + f", on the first {e.val_samples} sequences of {t.seq_len} tokens of each, on any number of GPUs): "
             f"{per_set(VAL_LOSS, '<name>')}, {per_set(VAL_BPB, '<name>')}"]
    for s in recipe.data.sources:
        if not s.held_out:
            lines.append(f"  {s.name}: none (held_out {s.held_out!r})")
            continue
        entry = recorded_held_out(s.path) if os.path.isdir(s.path) else None
        if entry is not None:
            size = f"{entry['documents']:,} documents, {entry['tokens']:,} tokens"
        elif isinstance(s.held_out, int):
            size = f"expected {s.held_out:,} documents"
        elif s.expected_tokens:
            size = f"expected ~{round(s.held_out * s.expected_tokens):,} tokens (of expected_tokens {s.expected_tokens:,})"
        else:
            size = "size unknown (no expected_tokens)"
        split = "" if entry is not None else ", not split yet"
        lines.append(f"  {s.name}: {size}; held_out {s.held_out!r}{split}: {held_out_dir(s.path)}")
    for name, path in recipe.validation_sets.items():
        if path in e.val_sources:
            try:
                m = load_manifest(path)
                size = f"{m['num_documents']:,} documents, {m['num_tokens']:,} tokens"
            except ValueError as err:
                size = f"unreadable: {err}"
            lines.append(f"  {name}: {size}; [eval] val_sources: {path}")
    return lines


def pairs_report(recipe: R.Recipe) -> str:
    """A preference run's data plan: pairs read against each pair source's expected pairs, then the
    pairs on this machine as the loader opens them."""
    from train.recipe import model_config
    from train.objectives.preference import check_pairs
    from train.preference.plan import size_lines

    lines = size_lines(recipe)[0]
    missing = [str(s.path) for s in recipe.data.sources if not os.path.exists(s.path)]
    if missing:
        lines.append(f"not on this machine yet: {', '.join(missing)}")
    else:
        lines.append(check_pairs(recipe, model_config(recipe), None))
    return "\n".join(lines)


def realized_mix(run_dir: Path, weights: dict[str, float]) -> str:
    """Tokens consumed per source so far, from the run's metrics.jsonl, and the data spike rollbacks skipped."""
    from rundir import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        return f"realized mix: no metrics yet in {run_dir}"
    consumed, step = {}, 0
    for row in rows:
        tokens = {k.removeprefix("data/tokens/"): v for k, v in row.items() if k.startswith("data/tokens/")}
        if tokens:
            consumed, step = tokens, row["step"]
    total = sum(consumed.values()) or 1
    norm = sum(weights.values()) or 1.0
    lines = [f"realized mix at step {step} ({run_dir}):"]
    lines += [f"  {name}: {n:,} tokens, share {n / total:.4f} (weight {weights.get(name, 0) / norm:.4f})"
              for name, n in consumed.items()]
    from health.rollback import read_rollbacks  # data a spike rollback skipped: read, never trained on

    for r in read_rollbacks(run_dir):
        lines.append(f"  rolled back at step {r['at_step']} to step {r['to_step']}: skipped "
                     f"{sum(r['skipped_tokens'].values()):,} tokens ("
                     + ", ".join(f"{k} {v:,}" for k, v in r["skipped_tokens"].items()) + "), not counted above")
    return "\n".join(lines)

