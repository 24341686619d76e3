"""Build the bundled RL task set for recipes/tiny-rl.toml: assets/rl/tasks.jsonl.

    python -m data.make_rl_tasks [--out assets/rl]

Short code prompts a tiny model can sometimes pass: a one-line function's signature and docstring, to be
completed with its body (``return a + b``), each with a few ``assert`` tests (eval.rewards runs each on its
own: the reward is the fraction passed). Each operation is asked under several function names, so that the
held-out tasks (data.held_out's rule on the prompt's ids, ``[rl] held_out``) ask operations seen in training
under another name. No randomness: the same file byte for byte on every run
(tests/data/test_rl_tasks.py::test_bundled_assets_are_what_the_script_makes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (name stem, parameters, docstring, body, tests as (arguments, expected))
OPERATIONS = [
    ("add", "a, b", "Return the sum of a and b.", "a + b", [("1, 2", "3"), ("0, 0", "0"), ("-4, 10", "6")]),
    ("sub", "a, b", "Return a minus b.", "a - b", [("5, 3", "2"), ("0, 7", "-7"), ("10, 10", "0")]),
    ("mul", "a, b", "Return the product of a and b.", "a * b", [("2, 3", "6"), ("0, 9", "0"), ("-2, 4", "-8")]),
    ("identity", "x", "Return x unchanged.", "x", [("3", "3"), ("'a'", "'a'"), ("None", "None")]),
    ("double", "x", "Return two times x.", "2 * x", [("2", "4"), ("0", "0"), ("-5", "-10")]),
    ("square", "x", "Return x squared.", "x * x", [("3", "9"), ("0", "0"), ("-4", "16")]),
    ("negate", "x", "Return minus x.", "-x", [("3", "-3"), ("0", "0"), ("-2", "2")]),
    ("increment", "x", "Return x plus one.", "x + 1", [("1", "2"), ("0", "1"), ("-1", "0")]),
    ("decrement", "x", "Return x minus one.", "x - 1", [("1", "0"), ("5", "4"), ("0", "-1")]),
    ("is_even", "n", "Return True if n is even.", "n % 2 == 0", [("2", "True"), ("3", "False"), ("0", "True")]),
    ("first", "items", "Return the first item of the list.", "items[0]", [("[1, 2]", "1"), ("['x']", "'x'"),
                                                                         ("[0, 5, 6]", "0")]),
    ("last", "items", "Return the last item of the list.", "items[-1]", [("[1, 2]", "2"), ("['x']", "'x'"),
                                                                        ("[0, 5, 6]", "6")]),
    ("length", "items", "Return the number of items.", "len(items)", [("[1, 2]", "2"), ("[]", "0"),
                                                                      ("'abc'", "3")]),
    ("maximum", "a, b", "Return the larger of a and b.", "max(a, b)", [("1, 2", "2"), ("5, 3", "5"),
                                                                      ("-1, -2", "-1")]),
    ("minimum", "a, b", "Return the smaller of a and b.", "min(a, b)", [("1, 2", "1"), ("5, 3", "3"),
                                                                       ("-1, -2", "-2")]),
    ("absolute", "x", "Return the absolute value of x.", "abs(x)", [("-3", "3"), ("0", "0"), ("4", "4")]),
    ("upper", "s", "Return s in upper case.", "s.upper()", [("'ab'", "'AB'"), ("''", "''"), ("'A1'", "'A1'")]),
    ("total", "items", "Return the sum of the items.", "sum(items)", [("[1, 2]", "3"), ("[]", "0"),
                                                                     ("[5, -5, 1]", "1")]),
]
PREFIXES = ["", "get_", "compute_", "my_", "do_"]


def tasks() -> list[dict]:
    out = []
    for stem, params, doc, body, tests in OPERATIONS:
        for prefix in PREFIXES:
            name = prefix + stem
            prompt = f'def {name}({params}):\n    """{doc}"""\n'
            out.append({"id": name, "prompt": prompt, "solution": f"    return {body}\n",
                        "tests": [f"assert {name}({args}) == {want}" for args, want in tests]})
    return out


def build(out: str | Path) -> Path:
    path = Path(out) / "tasks.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks()))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="assets/rl")
    print(build(p.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
