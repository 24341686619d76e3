"""One spelling of held-out in code (issue 45): ``held_out`` (``HeldOut``, ``--held-out``, prose
"held-out"). The pre-0.2 names (``holdout``, ``heldout``) appear only where they are defined as the
old names that are read, with a message, until the next release."""

from __future__ import annotations

import re
from pathlib import Path

from rundir import REPO

SPELLINGS = re.compile(r"holdout|heldout", re.IGNORECASE)
WHERE_OLD_NAMES_ARE_DEFINED = {  # file: the lines that name the old spellings
    "data/held_out.py": ['OLD_DIR, OLD_KEY = "heldout", "holdout"'],
    "train/recipe/schema.py": ['RENAMED = {"data": {"holdout": "held_out"}, "data.sources": {"holdout": "held_out"},',
                               '"preference": {"heldout": "held_out"}}'],
    "train/preference/reference.py": ['OLD_ROLE = "heldout"  # the held-out role\'s name in run dirs written before '
                                      'laneformer 0.2'],
}


def old_spellings(root: Path) -> dict[str, list[str]]:
    """Every line of a product ``.py`` file or a recipe that spells held-out otherwise, by file."""
    found: dict[str, list[str]] = {}
    files = [p for p in root.rglob("*.py") if not {"tests", ".venv", "runs"} & set(p.relative_to(root).parts)]
    for path in files + sorted((root / "recipes").rglob("*.toml")):
        hits = [line.strip() for line in path.read_text().splitlines() if SPELLINGS.search(line.replace("HeldOut", ""))]
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


def test_held_out_has_one_spelling_in_code_and_recipes():
    assert old_spellings(REPO) == WHERE_OLD_NAMES_ARE_DEFINED


def test_the_check_finds_an_old_spelling(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.toml").write_text("[data]\nholdout = 0.1\n")
    (tmp_path / "m.py").write_text("class HeldOutError: ...\nheld_out = HOLDOUT = 1  # held-out\nx.heldout_pairs\n")
    assert old_spellings(tmp_path) == {"recipes/r.toml": ["holdout = 0.1"], "m.py": ["held_out = HOLDOUT = 1  # held-out",
                                                                                    "x.heldout_pairs"]}
