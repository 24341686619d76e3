"""What the eval tests share (also used by tests in rundir, train, models and e2e): the real CORE
bundle's location, CORE's toy tokenizer and bigram model with toy items, a CORE bundle in the real
format, lm-eval toy tasks and EvalPlus toy tasks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from data.tokenizer import Tokenizer
from rundir import REPO
from tests.eval import evalplus_cases

# --- CORE toys (tests/eval, tests/rundir, tests/e2e) ---

# The real CORE bundle: $LANEFORMER_CORE_BUNDLE, or ../shared/core_eval_bundle beside the repo
# (`python -m eval.core_data fetch DIR` gets it where a network exists).
BUNDLE = Path(os.environ.get("LANEFORMER_CORE_BUNDLE", REPO.parent / "shared" / "core_eval_bundle"))
needs_bundle = pytest.mark.skipif(
    not (BUNDLE / "tasks.csv").is_file(),
    reason=f"CORE bundle not found at {BUNDLE} (set LANEFORMER_CORE_BUNDLE)")


class WordTokenizer:
    """Whitespace-separated words; ids 0, 1, 2 are <unk>, <s>, </s>."""

    bos_id, eos_id = 1, 2

    def __init__(self, words: list[str]):
        self.vocab = ["<unk>", "<s>", "</s>", *dict.fromkeys(words)]
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + [self.ids[w] for w in text.split()] + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.vocab[i] for i in ids if i > 2)


class Bigram:
    """logits[t] = ln P(next | token t): the given probabilities, the rest of the mass spread evenly."""

    def __init__(self, tokenizer: WordTokenizer, probs: dict[str, dict[str, float]]):
        v = tokenizer.vocab_size
        self.table = torch.full((v, v), -math.log(v))
        for prev, nexts in probs.items():
            rest = (1 - sum(nexts.values())) / (v - len(nexts))
            row = torch.full((v,), math.log(rest))
            for word, p in nexts.items():
                row[tokenizer.ids[word]] = math.log(p)
            self.table[tokenizer.ids[prev]] = row
        self.calls = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.table[ids]


PROBS = {
    "is": {"blue": 0.5, "red": 0.2, "dark": 0.1},
    "dark": {"red": 0.9},
    "dog": {"barks": 0.6, "meows": 0.01, "sleeps": 0.3},
    "cat": {"barks": 0.05, "meows": 0.7, "sleeps": 0.1},
    "barks": {"loudly": 0.5},
    "two": {"three": 0.6},
    "three": {"four": 0.6, "five": 0.3},
    "five": {"six": 0.6},
}
MC_ITEMS = [
    # blue -ln .5 = 0.69 < red -ln .2 = 1.61: picks 0, correct
    {"query": "the sky is", "choices": ["blue", "red"], "gold": 0},
    # red 1.61; "dark red" mean(-ln .1, -ln .9) = (2.30 + 0.11) / 2 = 1.20: picks 1, wrong
    # (by the sum, 2.41 > 1.61, it would have been right: CORE uses the mean)
    {"query": "the rose is", "choices": ["red", "dark red"], "gold": 0},
    # red 1.61 > blue 0.69: picks 1, correct
    {"query": "the grass is", "choices": ["red", "blue"], "gold": 1},
]
SCHEMA_ITEMS = [
    # dog: mean(-ln .6, -ln .5) = 0.60; cat: mean(-ln .05, -ln .5) = 1.84: picks 1, correct
    {"context_options": ["the cat", "the dog"], "continuation": "barks loudly", "gold": 1},
    # dog -ln .01 = 4.61; cat -ln .7 = 0.36: picks 1, correct
    {"context_options": ["the dog", "the cat"], "continuation": "meows", "gold": 1},
    # cat -ln .1 = 2.30; dog -ln .3 = 1.20: picks 1, wrong
    {"context_options": ["the cat", "the dog"], "continuation": "sleeps", "gold": 0},
]
LM_ITEMS = [
    {"context": "one two", "continuation": "three four"},  # argmax: two->three, three->four: correct
    {"context": "one two", "continuation": "three five"},  # argmax after three is four, not five: wrong
    {"context": "four five ", "continuation": "six"},  # five->six: correct (context is stripped)
]
TOY = {"multiple_choice": MC_ITEMS, "schema": SCHEMA_ITEMS, "language_modeling": LM_ITEMS}
WORDS = sorted({w for items in TOY.values() for it in items for v in it.values()
                for w in (" ".join(v) if isinstance(v, list) else str(v)).split()} | {"Answer:"})


# --- a CORE bundle in the real format, with toy items (tests that need the format, not the data) ---

# label, type, shots, file, baseline v1 %, baseline v2 % (the real bundle's tasks.csv values)
CORE_ROWS = [
    ("hellaswag_zeroshot", "multiple_choice", 0, "language_understanding/hellaswag.jsonl", 25, 25),
    ("jeopardy", "language_modeling", 10, "world_knowledge/jeopardy_all.jsonl", 0, 0),
    ("bigbench_qa_wikidata", "language_modeling", 10, "world_knowledge/bigbench_qa_wikidata.jsonl", 0, 0),
    ("arc_easy", "multiple_choice", 10, "world_knowledge/arc_easy.jsonl", 25, 25),
    ("arc_challenge", "multiple_choice", 10, "world_knowledge/arc_challenge.jsonl", 25, 25),
    ("copa", "multiple_choice", 0, "commonsense_reasoning/copa.jsonl", 50, 50),
    ("commonsense_qa", "multiple_choice", 10, "commonsense_reasoning/commonsense_qa.jsonl", 20, 40.3),
    ("piqa", "multiple_choice", 10, "commonsense_reasoning/piqa.jsonl", 50, 50),
    ("openbook_qa", "multiple_choice", 0, "commonsense_reasoning/openbook_qa.jsonl", 25, 25),
    ("lambada_openai", "language_modeling", 0, "language_understanding/lambada_openai.jsonl", 0, 0),
    ("hellaswag", "multiple_choice", 10, "language_understanding/hellaswag.jsonl", 25, 25),
    ("winograd", "schema", 0, "language_understanding/winograd_wsc.jsonl", 50, 50),
    ("winogrande", "schema", 0, "language_understanding/winogrande.jsonl", 50, 50),
    ("bigbench_dyck_languages", "language_modeling", 10, "symbolic_problem_solving/bigbench_dyck_languages.jsonl", 0, 0),
    ("agi_eval_lsat_ar", "multiple_choice", 3, "symbolic_problem_solving/agi_eval_lsat_ar.jsonl", 20, 25),
    ("bigbench_cs_algorithms", "language_modeling", 10, "symbolic_problem_solving/bigbench_cs_algorithms.jsonl", 0, 0),
    ("bigbench_operators", "language_modeling", 10, "symbolic_problem_solving/bigbench_operators.jsonl", 0, 0),
    ("bigbench_repeat_copy_logic", "language_modeling", 10,
     "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl", 0, 0),
    ("squad", "language_modeling", 10, "reading_comprehension/squad.jsonl", 0, 0),
    ("coqa", "language_modeling", 0, "reading_comprehension/coqa.jsonl", 0, 0),
    ("boolq", "multiple_choice", 10, "reading_comprehension/boolq.jsonl", 62, 62),
    ("bigbench_language_identification", "multiple_choice", 10,
     "language_understanding/bigbench_language_identification.jsonl", 9.1, 25),
]


def write_toy_core_bundle(root: Path, skip: tuple[str, ...] = ()) -> Path:
    """A bundle folder (tasks.csv, delimiter " ", and the TOY items of each task's type) at ``root``;
    the task files of ``skip`` are left out (a partial CORE)."""
    import csv

    root.mkdir(parents=True, exist_ok=True)
    with open(root / "tasks.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "type", "shots", "continuation_delimiter", "file", "baseline_v1", "baseline_v2"])
        for label, kind, shots, file, v1, v2 in CORE_ROWS:
            writer.writerow([label, kind, shots, " ", file, v1, v2])
            path = root / "eval_data" / file
            if label in skip:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(it) + "\n" for it in TOY[kind]))
    return root


# --- lm-eval toys (tests/eval/test_eval_harness.py, tests/e2e/test_eval_two_ranks.py) ---

MC_DOCS = [
    {"query": "the sky is", "choices": ["blue", "red"], "gold": 0},  # ln .5 > ln .2: right
    {"query": "the rose is", "choices": ["red", "dark red"], "gold": 0},  # by the sum, ln .2 > ln .09: right
    {"query": "the grass is", "choices": ["red", "blue"], "gold": 1},  # right
    {"query": "the cat", "choices": ["barks", "meows"], "gold": 0},  # meows .7 > barks .05: wrong
    {"query": "the dog", "choices": ["meows", "sleeps"], "gold": 1},  # sleeps .3 > meows .01: right
]
GEN_DOCS = [
    {"context": "one two", "continuation": "three four"},  # right
    {"context": "one two", "continuation": "three five"},  # greedy says four: wrong
    {"context": "four five", "continuation": "six"},  # right
    {"context": "the dog", "continuation": "barks loudly"},  # cut at "loudly": wrong
    {"context": "the sky is", "continuation": "blue"},  # right
]


def write_tasks(root: Path) -> Path:
    """A task file with relative data_files, as a user would write one."""
    for name, docs in (("mc.jsonl", MC_DOCS), ("gen.jsonl", GEN_DOCS)):
        (root / name).write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "test_split": "test"}
    tasks = [
        {**common, "task": "toy_mc", "dataset_kwargs": {"data_files": {"test": "mc.jsonl"}},
         "output_type": "multiple_choice", "doc_to_text": "{{query}}", "doc_to_choice": "{{choices}}",
         "doc_to_target": "{{gold}}", "metric_list": [{"metric": "acc"}]},
        {**common, "task": "toy_gen", "dataset_kwargs": {"data_files": {"test": "gen.jsonl"}},
         "output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{continuation}}",
         "generation_kwargs": {"until": ["loudly"], "max_gen_toks": 3},
         "metric_list": [{"metric": "exact_match", "regexes_to_ignore": ["^\\s+|\\s+$"]}]},
    ]
    path = root / "tasks.json"
    path.write_text(json.dumps(tasks))
    return path


# --- EvalPlus toys (tests/eval/test_evalplus.py, tests/e2e/test_eval_two_ranks.py) ---

ADD = {
    "task_id": "HumanEval/0",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "canonical_solution": "    return a + b\n",
    "base_input": [[1, 2], [3, 4]],
    "plus_input": [[-5, 2], [0, 0], [10**20, -1]],
    "atol": 0,
    "contract": "", "test": "",
}
MEAN = {
    "task_id": "HumanEval/1",
    "prompt": 'def mean(xs: list) -> float:\n    """Arithmetic mean."""\n',
    "entry_point": "mean",
    "canonical_solution": "    return sum(xs) / len(xs)\n",
    "base_input": [[[1.0, 2.0]], [[0.1, 0.2, 0.3]]],
    "plus_input": [[[1e-3] * 1000], [[3.0]]],
    "atol": 0,
    "contract": "", "test": "",
}
# ADD's answer is right, MEAN's passes only the base tests, SUM's is wrong; with 3 tasks on 2 ranks,
# rank 1 has one task and pads rank 0's second generation with dummy forwards.
SUM = {**ADD, "task_id": "HumanEval/2", "prompt": 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'}
ANSWERS = {"HumanEval/0": "    return b + a\n", "HumanEval/1": "    return sum(xs) / len(xs) if len(xs) > 1 else 0.0\n",
           "HumanEval/2": "    return a - b\n"}


class ScriptedPerPrompt:
    """Scripted, with one target per task: a row follows the target it is a prefix of."""

    def __init__(self, targets: list[list[int]], vocab: int, eos: int):
        self.targets, self.vocab, self.eos = targets, vocab, eos

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, self.vocab)
        for row, seq in enumerate(ids.tolist()):
            target = next((t for t in self.targets if t[: len(seq)] == seq), None)
            for t in range(len(seq)) if target else ():
                logits[row, t, target[t + 1] if t + 1 < len(target) else self.eos] = 1.0
        return logits


def scripted_evalplus():
    """EvalPlus on [ADD, MEAN, SUM] with ANSWERS as the model's greedy completions."""
    from eval import evalplus

    tok = Tokenizer()
    tasks = [ADD, MEAN, SUM]
    targets = [tok.encode(evalplus.base_prompt(t) + ANSWERS[t["task_id"]], bos=True) for t in tasks]
    model = ScriptedPerPrompt(targets, tok.vocab_size, tok.eos_id)
    return evalplus.evaluate_evalplus(model, tok, "humaneval", max_seq_len=512, tasks=tasks, max_new_tokens=48)


# --- EvalPlus pass@N toys (tests/eval/test_evalplus_pass_at_n.py, tests/e2e/test_eval_two_ranks.py) ---

N = 10  # samples a task: EvalPlus prints pass@1 and pass@10
# Each task's answers (completions of its base prompt): the scripted model draws among them. Right,
# base-only and wrong ones, so that tasks pass some, all or none of their samples; HumanEval/2 has
# no answer passing its plus tests, so HumanEval+'s pass@10 is below 1.
SAMPLED_ANSWERS = {
    "HumanEval/0": ["    return a + b\n", "    return abs(a) + abs(b)\n", "    return a - b\n"],
    "HumanEval/1": ["    return sum(xs) / len(xs)\n", "    return (sum(xs) / len(xs),)\n"],
    "HumanEval/2": ["    return [x * k for x in xs] if xs else ()\n", "    return tuple(x * k for x in xs)\n"],
    "Mbpp/2": ["def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
               "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n"],
    "Mbpp/787": ["import re\ndef text_match_three(text):\n    return re.search('abbb', text)\n",
                 "import re\ndef text_match_three(text):\n    return 'Found' if re.search('abbb', text) else 'No'\n"],
    "Mbpp/164": ["def are_equivalent(a, b):\n    return False\n"],
    "Mbpp/295": ["def sum_div(n):\n    return 0\n", "def sum_div(n):\n    return n\n"],
}
# not find_zero: the project scores it with upstream's fix, evalplus 0.3.1 as released
HUMANEVAL_TASKS = evalplus_cases.HUMANEVAL[:3]


class Branching:
    """A scripted sampler: the next token of every answer the row is still a prefix of (EOS at an answer's
    end) gets the same high logit, so sampling draws among the answers. Every position of a row holds
    the logits after its last real token (before the EOS padding): the only position generation reads."""

    def __init__(self, answers: list[list[int]], vocab: int, eos: int):
        self.answers, self.vocab, self.eos = answers, vocab, eos

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(ids.shape[0], 1, self.vocab)
        for row, seq in enumerate(ids.tolist()):
            while seq and seq[-1] == self.eos:
                seq.pop()
            for answer in (a for a in self.answers if a[: len(seq)] == seq):
                logits[row, 0, answer[len(seq)] if len(seq) < len(answer) else self.eos] = 30.0
        return logits.expand(-1, ids.shape[1], -1)


def sampled_evalplus(dataset: str = "humaneval", tasks: list[dict] | None = None, seed: int = 0):
    """EvalPlus pass@N on ``tasks`` (default: HUMANEVAL_TASKS) with Branching drawing among their SAMPLED_ANSWERS."""
    from eval import evalplus

    tasks = HUMANEVAL_TASKS if tasks is None else tasks
    tok = Tokenizer()
    answers = []
    for task in tasks:
        prompt = tok.encode(evalplus.base_prompt(task), bos=True)
        for text in SAMPLED_ANSWERS[task["task_id"]]:
            ids = tok.encode(evalplus.base_prompt(task) + text, bos=True)
            assert ids[: len(prompt)] == prompt  # the answer continues the prompt's very ids
            answers.append(ids)
    return evalplus.evaluate_evalplus(Branching(answers, tok.vocab_size, tok.eos_id), tok, dataset, max_seq_len=512,
                                      tasks=tasks, max_new_tokens=64, samples=N, temperature=1.0, seed=seed)
