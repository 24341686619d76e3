"""A preference run's plan, from the recipe alone: pairs read against each pair source's expected size
(``expected_pairs``, by its card), and the reference pass's cost (``--dry-run``; the size check is the
preflight's too: train.recipe's ``check_needs`` sizes pair sources here).

Pairs are drawn uniformly from all pair sources together (data.pairs_loader; their weights are
equal, the recipe's ``[data]`` refuses others), so every source is read the same number of epochs: the
run's pairs over all sources' pairs. The reference pass is one
forward, no backward, over every pair before step 1: two sequences of ``seq_len`` a pair at a third of
a training token's FLOPs (forward 2N of 6N).
"""

from __future__ import annotations

from train.preference.loss import NEEDS_REFERENCE


def pairs_read(recipe) -> int:
    t = recipe.training
    return t.steps * t.global_batch // 2


def size_lines(recipe) -> tuple[list[str], list[str]]:
    """(the plan's lines, its problems as ``file: [table] key: why``) for the recipe's pair sources."""
    sources, p, read = recipe.data.sources, recipe.path, pairs_read(recipe)
    lines = [f"data plan: {read:,} pairs ({recipe.training.steps:,} steps x {recipe.training.global_batch // 2:,} "
             "pairs, two sequences each); per source: its expected pairs (expected_pairs, by its card)"]
    unknown = [s.name for s in sources if s.expected_pairs is None]
    if unknown:
        lines.append(f"data plan: not size-checked (no expected_pairs): {', '.join(unknown)}")
        return lines, []
    total = sum(s.expected_pairs for s in sources)
    epochs, problems = read / total, []
    for i, s in enumerate(sources):
        ok = epochs <= s.max_epochs
        lines.append(f"  {s.name}: expected {s.expected_pairs:,} pairs -> {epochs:.2f} epochs of max {s.max_epochs:g}: "
                     + ("ok" if ok else "SHORT"))
        if not ok:
            problems.append(f"{p}: [data.sources[{i}]] expected_pairs: the run reads {read:,} pairs, {epochs:.2f} epochs "
                            f"of the {total:,} expected, over source {s.name!r}'s max_epochs {s.max_epochs:g}")
    return lines, problems


def reference_lines(recipe, flops_per_token: int, per_second: float) -> list[str]:
    """The dry run's lines on the reference pass: a preference run's (``reference_seconds``), none for
    another run (the planner calls this whatever the run, and asks nothing)."""
    return [reference_seconds(recipe, flops_per_token, per_second)] if recipe.preference.loss else []


def reference_seconds(recipe, flops_per_token: int, per_second: float) -> str:
    """The reference pass's line: its pairs' forward FLOPs at ``per_second`` FLOP/s (all GPUs), or why none."""
    if not NEEDS_REFERENCE[recipe.preference.loss]:
        return f"reference pass: none ({recipe.preference.loss} needs no reference)"
    pairs = sum(s.expected_pairs or 0 for s in recipe.data.sources)
    if not pairs:
        return "reference pass: one forward over every pair before step 1 (pairs unknown: set expected_pairs)"
    tokens = 2 * pairs * recipe.training.seq_len
    if not per_second:
        return f"reference pass: one forward over {pairs:,} pairs ({tokens:,} tokens) before step 1"
    seconds = tokens * flops_per_token / 3 / per_second
    return (f"reference pass: one forward over {pairs:,} pairs ({tokens:,} tokens) before step 1: "
            f"{seconds / 3600:.1f} h at the same MFU")
