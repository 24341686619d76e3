"""The text tables commands print (the planner's, a sweep's grid, plan and comparison), in one place.

tabulate lays them out; cells arrive formatted by the caller (``+0.0000``, ``61.7%``, ``1,234``),
so tabulate's number parsing is off: it would print ``+0.0000`` as ``0``. In rundir, the lowest
layer, because launch, plan and report all print them.
"""

from __future__ import annotations

from tabulate import tabulate


def text_table(header: list[str], rows: list[list], numbers: bool = False) -> list[str]:
    """The table's lines. Plain: every column left-aligned, two spaces apart, no rule (a sweep's tables,
    which the README quotes and tests read by line). ``numbers``: a rule under the header and every column
    after the first right-aligned (the planner's tables of figures)."""
    rows = [[str(c) for c in row] for row in rows]
    if numbers:
        text = tabulate(rows, header, tablefmt="simple", disable_numparse=True,
                        colalign=("left", *["right"] * (len(header) - 1)))
    else:  # the header as a row: tabulate widens a header's column by two more
        text = tabulate([header, *rows], tablefmt="plain", disable_numparse=True, stralign="left")
    return text.split("\n")  # not splitlines(): it drops a last row of empty cells
