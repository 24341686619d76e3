"""A small dataset in EvalPlus's release format, and completions that exercise each of its rules.

HumanEval+-like and MBPP+-like tasks (task ids, entry points and canonical solutions
chosen so that EvalPlus's per-task rules apply: Mbpp/2 is compared as a set, Mbpp/787 by
``is not None``, Mbpp/164 and Mbpp/295 have their own oracles, HumanEval/32 is
find_zero), with ``base_input``/``plus_input``/``atol`` as the releases hold them.
Each completion is the raw text a model would give (before EvalPlus's sanitizer) and
the (base, plus) verdict EvalPlus 0.3.1 gives it; tests/eval/test_evalplus.py checks
both against the package's own evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path

HUMANEVAL = [
    {"task_id": "HumanEval/0", "entry_point": "add",
     "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
     "canonical_solution": "    return a + b\n",
     "base_input": [[1, 2], [3, 4]], "plus_input": [[-5, 2], [0, 0], [10**20, -1]], "atol": 0},
    {"task_id": "HumanEval/1", "entry_point": "mean",
     "prompt": 'def mean(xs: list) -> float:\n    """Arithmetic mean."""\n',
     "canonical_solution": "    return sum(xs) / len(xs)\n",
     "base_input": [[[1.0, 2.0]], [[0.1, 0.2, 0.3]]], "plus_input": [[[1e-3] * 1000], [[3.0]]], "atol": 0},
    {"task_id": "HumanEval/2", "entry_point": "scale",
     "prompt": 'def scale(xs: list, k: float) -> list:\n    """Every x times k."""\n',
     "canonical_solution": "    return [x * k for x in xs]\n",
     "base_input": [[[1.0, 2.5], 2.0]], "plus_input": [[[], 3.0], [[0.1, 0.2], 3.0]], "atol": 0},
    {"task_id": "HumanEval/32", "entry_point": "find_zero",
     "prompt": ('import math\n\n\ndef poly(xs: list, x: float):\n    """xs[0] + xs[1] * x + ... + xs[n] * x^n"""\n'
                '    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])\n\n\n'
                'def find_zero(xs: list):\n    """A zero of the polynomial xs (even length, largest coefficient '
                'non-zero)."""\n'),
     "canonical_solution": ("    begin, end = -1., 1.\n    while poly(xs, begin) * poly(xs, end) > 0:\n"
                            "        begin *= 2.0\n        end *= 2.0\n    while end - begin > 1e-10:\n"
                            "        center = (begin + end) / 2.0\n        if poly(xs, center) * poly(xs, begin) > 0:\n"
                            "            begin = center\n        else:\n            end = center\n    return begin\n"),
     "base_input": [[[1, 2]], [[-6, 11, -6, 1]]], "plus_input": [[[5, -3, 0, 2]], [[-10, 1]]], "atol": 1e-6},
]

MBPP = [
    {"task_id": "Mbpp/2", "entry_point": "similar_elements",
     "prompt": '"""\nWrite a function to find the shared elements from the given two lists.\n'
               'assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n"""\n',
     "canonical_solution": "def similar_elements(test_tup1, test_tup2):\n"
                           "  return tuple(set(test_tup1) & set(test_tup2))\n",
     "base_input": [[[3, 4, 5, 6], [5, 7, 4, 10]], [[11, 12, 14, 13], [17, 15, 14, 13]]],
     "plus_input": [[[1, 2, 3], [3, 2, 1]], [[], [1]]], "atol": 0},
    {"task_id": "Mbpp/787", "entry_point": "text_match_three",
     "prompt": '"""\nWrite a function that matches a string that has an a followed by three \'b\'.\n'
               'assert not text_match_three("ac")\n"""\n',
     "canonical_solution": "import re\ndef text_match_three(text):\n        patterns = 'ab{3}?'\n"
                           "        return re.search(patterns,  text)\n",
     "base_input": [["ac"], ["dc"], ["abbbba"]], "plus_input": [["caacabbbba"], [""], ["abbb"]], "atol": 0},
    {"task_id": "Mbpp/164", "entry_point": "are_equivalent",
     "prompt": '"""\nWrite a function to determine if the sum of the divisors of two integers are the same.\n'
               'assert are_equivalent(36, 57) == False\n"""\n',
     "canonical_solution": "import math\ndef div_sum(n):\n  total = 1\n  i = 2\n  while i * i <= n:\n"
                           "    if (n % i == 0):\n      total = (total + i + math.floor(n / i))\n    i += 1\n"
                           "  return total\ndef are_equivalent(num1, num2):\n"
                           "    return div_sum(num1) == div_sum(num2)\n",
     "base_input": [[36, 57], [2, 4], [23, 47]], "plus_input": [[10, 10]], "atol": 0},
    {"task_id": "Mbpp/295", "entry_point": "sum_div",
     "prompt": '"""\nWrite a function to return the sum of all divisors of a number.\n'
               'assert sum_div(8)==7\n"""\n',
     "canonical_solution": "def sum_div(number):\n    divisors = [1]\n    for i in range(2, number):\n"
                           "        if (number % i)==0:\n            divisors.append(i)\n    return sum(divisors)\n",
     "base_input": [[8], [12], [7]], "plus_input": [[1], [100]], "atol": 0},
]

FIND_ZERO_RIGHT = "    begin, end = -10.0, 10.0\n" + HUMANEVAL[3]["canonical_solution"].split("\n", 1)[1]

# (task id, what it exercises, raw completion, (base, plus) under EvalPlus 0.3.1)
COMPLETIONS = [
    ("HumanEval/0", "right, in a markdown answer",
     "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds.", (True, True)),
    ("HumanEval/0", "base only", HUMANEVAL[0]["prompt"] + "    return abs(a) + abs(b)\n", (True, False)),
    ("HumanEval/0", "wrong", HUMANEVAL[0]["prompt"] + "    return a - b\n", (False, False)),
    ("HumanEval/0", "wrong type: a string of the right number", "def add(a, b):\n    return str(a + b)\n",
     (False, False)),
    ("HumanEval/0", "a stub, then the real definition",
     "def add(a, b):\n    pass\n\n\ndef add(a, b):\n    return a + b\n", (True, True)),
    ("HumanEval/0", "decorated: the sanitizer drops it",
     "import functools\n\n@functools.lru_cache(maxsize=None)\ndef add(a, b):\n    return a + b\n", (False, False)),
    ("HumanEval/0", "open() is disabled",
     "def add(a, b):\n    with open('note.txt', 'w') as f:\n        f.write('hi')\n    return a + b\n", (False, False)),
    ("HumanEval/0", "a __main__ block is not run",
     "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    raise SystemExit(add(1, 1) == 3)\n",
     (True, True)),
    ("HumanEval/0", "timeout on a plus input",
     "def add(a, b):\n    while a < 0:\n        pass\n    return a + b\n", (True, False)),
    ("HumanEval/0", "crash: an exception", "def add(a, b):\n    return a + b + 1 / (a - a)\n", (False, False)),
    ("HumanEval/0", "crash: the process dies",
     "def add(a, b):\n    import ctypes\n    return ctypes.string_at(0)\n", (False, False)),
    ("HumanEval/1", "close enough (atol 1e-6 for floats)",
     "import math\ndef mean(xs):\n    return math.fsum(xs) / len(xs)\n", (True, True)),
    ("HumanEval/1", "wrong type: a 1-tuple where a float is expected (allclose would take it)",
     "def mean(xs):\n    return (sum(xs) / len(xs),)\n", (False, False)),
    ("HumanEval/1", "numpy", "import numpy as np\ndef mean(xs):\n    return float(np.mean(xs))\n", (True, True)),
    ("HumanEval/2", "right", "def scale(xs, k):\n    return [k * x for x in xs]\n", (True, True)),
    ("HumanEval/2", "wrong type: a tuple where a list is expected",
     "def scale(xs, k):\n    return tuple(x * k for x in xs)\n", (False, False)),
    ("HumanEval/2", "a numpy array where a list is expected",
     "import numpy as np\ndef scale(xs, k):\n    return np.array(xs) * k\n", (False, False)),
    ("HumanEval/2", "() where [] is expected",
     "def scale(xs, k):\n    return [x * k for x in xs] if xs else ()\n", (True, False)),
    ("HumanEval/32", "find_zero, right", HUMANEVAL[3]["prompt"] + FIND_ZERO_RIGHT, (False, False)),
    ("HumanEval/32", "find_zero, wrong", HUMANEVAL[3]["prompt"] + "    return 0.5\n", (False, False)),
    ("Mbpp/2", "set-compared: another order, a list",
     "def similar_elements(a, b):\n    return sorted(set(a) & set(b), reverse=True)\n", (True, True)),
    ("Mbpp/2", "set-compared: wrong elements",
     "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n", (False, False)),
    ("Mbpp/2", "its inputs are tuples",
     "def similar_elements(a, b):\n    assert type(a) is tuple and type(b) is tuple\n    return set(a) & set(b)\n",
     (True, True)),
    ("Mbpp/787", "regex: a match object or None",
     "import re\ndef text_match_three(text):\n    return re.search('abbb', text)\n", (True, True)),
    ("Mbpp/787", "regex: a bool", "import re\ndef text_match_three(text):\n    return 'abbb' in text\n",
     (True, True)),
    ("Mbpp/787", "regex: never None",
     "import re\ndef text_match_three(text):\n    return 'Found' if re.search('abbb', text) else 'Not found'\n",
     (False, False)),
    ("Mbpp/164", "any output is accepted", "def are_equivalent(a, b):\n    return 'whatever'\n", (True, True)),
    ("Mbpp/295", "0 is accepted for any input", "def sum_div(n):\n    return 0\n", (True, True)),
    ("Mbpp/295", "wrong: neither the sum nor 0", "def sum_div(n):\n    return n\n", (False, False)),
]

# find_zero with upstream's fix (evalplus 6eb1e19): the right solution passes.
FIXED = {"find_zero, right": (True, True)}


def write_release(path: Path, tasks: list[dict]) -> Path:
    """A release file as EvalPlus publishes them (``contract`` is part of its format; scoring ignores it)."""
    path.write_text("".join(json.dumps({"contract": "", **t}) + "\n" for t in tasks))
    return path
