"""``python -m data.inspect --recipe X [--run DIR]``: planned vs available tokens per source.

For each source of the recipe's mixture: its share, the tokens the run will
read from it, the tokens it has, and how many epochs that is (a recipe that
needs more epochs than a source's ``max_epochs`` is refused here as it is
before training). With a run dir (default: the recipe's), also the realized
mix: tokens consumed per source so far, from the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def planned(recipe) -> str:
    from train.build import check_data, model_config, source_specs

    specs = source_specs(recipe)
    missing = [s["path"] for s in specs if not os.path.exists(s["path"])]
    total = recipe.training.total_tokens
    if not missing:
        return check_data(recipe, model_config(recipe)).describe()
    weights = {s["name"]: s["weight"] for s in specs if s["weight"] is not None}
    norm = sum(weights.values()) or 1.0
    lines = [f"mixture: {total:,} tokens planned; not on this machine: {', '.join(missing)}"]
    for s in specs:
        share = (s["weight"] / norm) if s["weight"] is not None else s["tokens"] / total
        lines.append(f"  {s['name']}: share {share:.4f}, plan {share * total:,.0f} tokens, "
                     f"max_epochs {s['max_epochs']} ({s['path']})")
    return "\n".join(lines)


def realized(run_dir: Path, weights: dict[str, float]) -> str:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return f"realized mix: no metrics yet in {run_dir}"
    consumed, step = {}, 0
    for line in path.read_text().splitlines():
        row = json.loads(line)
        tokens = {k.removeprefix("data/tokens/"): v for k, v in row.items() if k.startswith("data/tokens/")}
        if tokens:
            consumed, step = tokens, row["step"]
    total = sum(consumed.values()) or 1
    norm = sum(weights.values()) or 1.0
    lines = [f"realized mix at step {step} ({run_dir}):"]
    lines += [f"  {name}: {n:,} tokens, share {n / total:.4f} (weight {weights.get(name, 0) / norm:.4f})"
              for name, n in consumed.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    from train import recipe as R

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE")
    p.add_argument("--run", type=Path, help="run dir (default: the recipe's output_dir)")
    args = p.parse_args(argv)
    try:
        recipe = R.load(args.recipe, args.set)
        print(planned(recipe))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run = args.run or recipe.output_dir
    weights = {s.name: s.weight or 0.0 for s in recipe.data.sources}
    print(realized(run, weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
