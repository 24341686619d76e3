"""rundir.table: the sweep's tables as the README quotes them, the planner's with numbers to the right;
cells are printed as the caller formatted them."""

from __future__ import annotations

from rundir import REPO
from rundir.table import text_table


def test_the_sweep_summary_is_laid_out_as_the_readme_quotes_it():
    header = ["variant", "n", "mean", "std", "delta", "sigmas", "verdict"]  # report.sweep.summary_lines
    rows = [["delay=0", "2", "5.6521", "0.0915", "+0.0000", "", "baseline"],
            ["delay=2", "2", "5.6291", "0.0953", "-0.0230", "-0.2", "within seed noise"]]
    quoted = "\n".join(f"    {line}" for line in text_table(header, rows))
    assert quoted in (REPO / "README.md").read_text()


def test_numbers_go_right_under_a_rule_and_cells_stay_as_written():
    assert text_table(["kind", "ms", "share"], [["matmul", "0.049", "1.0%"], ["layer total", 12, "+0.0000"]],
                      numbers=True) == [
        "kind            ms    share",
        "-----------  -----  -------",
        "matmul       0.049     1.0%",
        "layer total     12  +0.0000",
    ]
    assert text_table(["a", "b"], [["x", ""], ["", ""]]) == ["a  b", "x", ""]  # a last empty row is kept
