"""Decontamination (data.decontaminate) on a corpus with planted HumanEval+ and MBPP+ text, against the
small EvalPlus dataset of tests/eval (tests/eval/evalplus_cases.py, in EvalPlus's release format).

Planted: a HumanEval+ prompt with its canonical solution, the solution alone, a copy with its local
variables renamed (caught by its prompt's n-grams), a function too short for its prompt or solution
alone to hold a 12-gram, an MBPP+ canonical solution, MBPP+ test inputs.
Kept: clean prose and code (common idioms, a prime check sharing 10 words with an MBPP+ solution, a
config list of repeated numbers, a CSV table), and the renamed solution without its prompt, which no
12-gram can catch (asserted, with why).
The standalone report over the same corpus tokenized without decontamination counts the same
documents and changes no byte or mtime of the source. Chat and pair sources are matched on their
messages' text, not on their JSON; a pair on its prompt and both answers, each planted alone.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from data import decontaminate as D
from data import tokenize
from data.pairs import pairs_of
from data.shards import open_source
from data.tokenizer import TINY_TOKENIZER, Tokenizer
from tests.eval.evalplus_cases import HUMANEVAL, MBPP, write_release
from train.preference.loss import LOSSES

FIND_ZERO = HUMANEVAL[3]  # HumanEval/32: the longest prompt and solution of the test dataset
DIV_SUM = MBPP[2]  # Mbpp/164
SIMILAR = MBPP[0]  # Mbpp/2
RENAMES = {"begin": "lo", "end": "hi", "center": "mid"}  # every local variable of find_zero's solution


def renamed(code: str) -> str:
    return re.sub(r"\b(" + "|".join(RENAMES) + r")\b", lambda m: RENAMES[m.group(1)], code)


PLANTED = {  # id -> (text, the benchmark it must be counted under)
    "he-prompt-and-solution": ("Here is how I solved it:\n\n" + FIND_ZERO["prompt"] + FIND_ZERO["canonical_solution"],
                               "humaneval"),
    "he-solution": (FIND_ZERO["canonical_solution"], "humaneval"),
    "he-renamed": (FIND_ZERO["prompt"] + renamed(FIND_ZERO["canonical_solution"]), "humaneval"),
    # 10 words of prompt, 3 of solution: only the n-grams across the two hold it
    "he-short-function": (HUMANEVAL[0]["prompt"] + HUMANEVAL[0]["canonical_solution"], "humaneval"),
    "mbpp-solution": (DIV_SUM["canonical_solution"], "mbpp"),
    "mbpp-test-inputs": ("cases = " + json.dumps(SIMILAR["base_input"]) + "\nfor a, b in cases:\n    print(a, b)\n",
                         "mbpp"),
}
CLEAN = {
    "prose": "The committee met on Tuesday to discuss the budget. After a long debate about the new library, "
             "the members agreed to postpone the vote until the spring, when the figures would be final.",
    "code-idioms": "def total(values):\n    result = 0\n    for i in range(len(values)):\n        if values[i] > 0:\n"
                   "            result += values[i]\n    return result\n\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n",
    "config-repeats": "dropouts = [" + ", ".join(["0.001"] * 16) + "]\nzeros = [" + ", ".join(["0"] * 30) + "]\n",
    "csv-table": "step,loss,lr\n" + "".join(f"{s},{2.5 - s / 100:.3f},0.001\n" for s in range(1, 40)),
    # A textbook function sharing 10 words in a row with Mbpp/295's solution: kept by 12-grams, not by 8-grams.
    "code-prime-check": "def is_prime(number):\n    for i in range(2, number):\n        if (number % i)==0:\n"
                        "            return False\n    return True\n",
    "he-renamed-solution-only": renamed(FIND_ZERO["canonical_solution"]),  # see test_no_n_gram_size_...
}


def write_corpus(folder, docs: dict[str, str]):
    folder.mkdir(parents=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    return folder


@pytest.fixture(scope="module")
def evalplus_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("evalplus_data")
    write_release(out / "HumanEvalPlus.jsonl", HUMANEVAL)
    write_release(out / "MbppPlus.jsonl", MBPP)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "in",
                        {**{k: t for k, (t, _) in PLANTED.items()}, **CLEAN})


@pytest.fixture(scope="module")
def decontaminated(corpus, evalplus_data, tmp_path_factory):
    """The corpus tokenized with --decontaminate humaneval,mbpp, through the command line."""
    out = tmp_path_factory.mktemp("decont") / "out"
    tokenize.main(["--input", str(corpus), "--out", str(out), "--tokenizer", str(TINY_TOKENIZER),
                   "--decontaminate", "humaneval,mbpp", "--evalplus-data", str(evalplus_data)])
    return out


def decoded_documents(directory) -> list[str]:
    sp = Tokenizer(TINY_TOKENIZER)
    return [sp.decode(shard.document(i)) for shard in open_source(directory).shards
            for i in range(shard.num_documents)]


def test_every_planted_document_is_dropped_and_counted_per_benchmark(decontaminated):
    manifest = json.loads((decontaminated / "manifest.json").read_text())
    entry = manifest["decontamination"]
    expected = {b: sorted(k for k, (_, bench) in PLANTED.items() if bench == b) for b in ("humaneval", "mbpp")}
    assert entry["dropped"] == {b: len(ids) for b, ids in expected.items()} == {"humaneval": 4, "mbpp": 2}
    assert {b: sorted(ids) for b, ids in entry["examples"].items()} == expected
    assert entry["n_grams"] == D.NGRAM == 12 and entry["normalization"]["norm_numbers"] is False
    assert entry["benchmarks"] == ["humaneval", "mbpp"]
    # Clean documents kept, every one, word for word: no false positive among them.
    assert manifest["num_documents"] == len(CLEAN)
    kept = decoded_documents(decontaminated)
    sp = Tokenizer(TINY_TOKENIZER)
    assert kept == [sp.decode(sp.encode(text)) for text in CLEAN.values()]


def longest_shared_run(text: str, reference: str) -> int:
    """The most consecutive words (after the filter's normalization) of ``text`` found together in ``reference``."""
    def words(t):
        return D.WORDS.word_tokenize(D.simplify_text(t, D.CONFIG.norm_config))

    a, b = words(text), " " + " ".join(words(reference)) + " "
    return max(n for n in range(len(a) + 1) for i in range(len(a) - n + 1) if f" {' '.join(a[i:i + n])} " in b)


def test_no_n_gram_size_catches_a_renamed_solution_and_keeps_common_code():
    """Why the solution with every local variable renamed, without its prompt, is kept: its longest run of
    words found in the canonical solution is 5 (a renamed identifier every few words), so only n <= 5
    would catch it; a textbook prime check shares 10 words in a row with Mbpp/295's solution, so n <= 10
    drops clean code. The README states both numbers."""
    assert longest_shared_run(CLEAN["he-renamed-solution-only"], FIND_ZERO["canonical_solution"]) == 5
    assert longest_shared_run(CLEAN["code-prime-check"], MBPP[3]["canonical_solution"]) == 10 < D.NGRAM


def test_the_report_counts_the_same_documents_and_changes_nothing(corpus, evalplus_data, decontaminated,
                                                                  tmp_path, capsys):
    plain = tmp_path / "plain"
    tokenize.run(str(corpus), plain, TINY_TOKENIZER)
    before = {p: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
              for p in sorted(plain.rglob("*")) if p.is_file()}
    assert D.main(["report", str(plain), "--benchmarks", "humaneval,mbpp", "--evalplus-data", str(evalplus_data)]) == 0
    out = capsys.readouterr().out
    dropped = json.loads((decontaminated / "manifest.json").read_text())["decontamination"]["dropped"]
    assert f"{plain}: {len(PLANTED) + len(CLEAN)} documents" in out
    for benchmark, n in dropped.items():
        assert re.search(rf"^  {benchmark}: {n} overlapping \(", out, re.M), out
    after = {p: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
             for p in sorted(plain.rglob("*")) if p.is_file()}
    assert after == before


def test_conversations_are_matched_on_their_messages(evalplus_data, tmp_path):
    """A chat source: the MBPP+ solution as an assistant answer (to a question in other words) is dropped:
    matched in the JSON text, its escaped newlines would cut it into lines shorter than an n-gram."""
    rows = [{"id": "clean", "messages": [{"role": "user", "content": "Say hi."},
                                         {"role": "assistant", "content": "Hi!"}]},
            {"id": "planted", "messages": [{"role": "user", "content": "Do two numbers have equal divisor sums?"},
                                           {"role": "assistant", "content": DIV_SUM["canonical_solution"]}]}]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = tokenize.run(str(tmp_path / "in"), tmp_path / "out", TINY_TOKENIZER, chat_key="messages",
                            decontaminate=["humaneval", "mbpp"], evalplus_data=str(evalplus_data))
    assert manifest["decontamination"]["examples"] == {"humaneval": [], "mbpp": ["planted"]}
    assert manifest["num_documents"] == 1


def test_bad_input_is_named(corpus, evalplus_data, tmp_path, capsys):
    def fails(*args) -> str:
        with pytest.raises(SystemExit) as e:
            tokenize.main(["--input", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", str(TINY_TOKENIZER),
                           *args])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "expected distinct names among ['humaneval', 'mbpp', 'core']" in fails("--decontaminate", "humaneval,gsm8k")
    assert "--decontaminate humaneval needs --evalplus-data" in fails("--decontaminate", "humaneval")
    assert f"{tmp_path}: --evalplus-data: no MbppPlus.jsonl.gz or MbppPlus.jsonl for mbpp" in \
        fails("--decontaminate", "mbpp", "--evalplus-data", str(tmp_path))
    assert "--decontaminate core needs --core-bundle" in fails("--decontaminate", "core")
    assert not (tmp_path / "out" / "manifest.json").exists()
    # A tokenization kept with one decontamination is not continued with another, or without.
    tokenize.run(str(corpus), tmp_path / "out", TINY_TOKENIZER, decontaminate=["mbpp"], evalplus_data=str(evalplus_data))
    with pytest.raises(D.DecontaminationError, match="was tokenized with decontamination"):
        tokenize.run(str(corpus), tmp_path / "out", TINY_TOKENIZER, decontaminate=["humaneval", "mbpp"],
                     evalplus_data=str(evalplus_data))
    with pytest.raises(D.DecontaminationError, match="was tokenized with --decontaminate mbpp"):
        tokenize.run(str(corpus), tmp_path / "out", TINY_TOKENIZER)
    tokenize.run(str(corpus), tmp_path / "plain", TINY_TOKENIZER)
    with pytest.raises(D.DecontaminationError, match="tasks tokenized without decontamination"):
        tokenize.run(str(corpus), tmp_path / "plain", TINY_TOKENIZER, decontaminate=["mbpp"],
                     evalplus_data=str(evalplus_data))


def test_core_items_are_indexed(tmp_path):
    """Every string of a CORE item (here a multiple-choice query and its choices) drops a document holding it."""
    task = tmp_path / "bundle" / "eval_data" / "world_knowledge" / "quiz.jsonl"
    task.parent.mkdir(parents=True)
    query = "Which river flows through the ancient city that served as the capital of the Assyrian empire?"
    task.write_text(json.dumps({"query": query, "choices": ["Tigris", "Nile"], "gold": 0}) + "\n")
    corpus = write_corpus(tmp_path / "in", {"quiz-copy": f"Trivia night! {query} Answer: Tigris.",
                                            "clean": CLEAN["prose"]})
    manifest = tokenize.run(str(corpus), tmp_path / "out", TINY_TOKENIZER, decontaminate=["core"],
                            core_bundle=str(tmp_path / "bundle"))
    assert manifest["decontamination"]["examples"] == {"core": ["quiz-copy"]}


def test_a_recipe_source_with_decontaminate_is_tokenized_with_it(corpus, evalplus_data, tmp_path, capsys):
    """``decontaminate = [...]`` in a recipe's source reaches data.tokenize through ``train.data tokenize``;
    the EvalPlus files come from --evalplus-data (else the recipe's [eval] evalplus_data)."""
    from tests.train.test_data_commands import recipe_with
    from train.data import main

    block = (f'[[data.sources]]\nname = "code"\ninput = "{corpus}"\npath = "{tmp_path / "code"}"\nweight = 1.0\n'
             'decontaminate = ["humaneval", "mbpp"]\n')
    recipe = str(recipe_with(tmp_path, block))
    assert main(["tokenize", "--recipe", recipe, "--source", "code"]) == 2
    assert "--decontaminate humaneval,mbpp needs --evalplus-data" in capsys.readouterr().err
    assert main(["tokenize", "--recipe", recipe, "--source", "code", "--evalplus-data", str(evalplus_data)]) == 0
    assert "dropped as benchmark overlap (12-grams): {'humaneval': 4, 'mbpp': 2}" in capsys.readouterr().out
    block = block.replace(str(tmp_path / "code"), str(tmp_path / "code-from-eval"))
    assert main(["tokenize", "--recipe", str(recipe_with(tmp_path, block)), "--source", "code",
                 "--set", f'eval.evalplus_data="{evalplus_data}"']) == 0  # the recipe's own [eval] files
    assert "dropped as benchmark overlap (12-grams): {'humaneval': 4, 'mbpp': 2}" in capsys.readouterr().out
    bad = recipe_with(tmp_path, block.replace('"mbpp"', '"gsm8k"'))
    assert main(["tokenize", "--recipe", str(bad), "--source", "code"]) == 2
    assert "decontaminate: ['humaneval', 'gsm8k']: expected distinct names" in capsys.readouterr().err


def lines_with_a_whole_n_gram(text: str) -> list[str]:
    """The lines of ``text`` holding NGRAM words on their own (after the filter's normalization)."""
    return [line for line in text.splitlines()
            if len(D.WORDS.word_tokenize(D.simplify_text(line, D.CONFIG.norm_config))) >= D.NGRAM]


POLY = FIND_ZERO["prompt"].split("    return")[0]  # find_zero's prompt to poly's docstring: 17 words on 5 lines
BISECTION = "".join(FIND_ZERO["canonical_solution"].splitlines(keepends=True)[:3])  # its first 3 solution lines
PAIRS = [  # (row, the benchmark it is dropped under, or None: kept)
    ({"id": "clean", "prompt": [{"role": "user", "content": "Name a pet."}],
      "chosen": [{"role": "assistant", "content": "Dog."}],
      "rejected": [{"role": "assistant", "content": "I would rather not say."}]}, None),
    ({"id": "prompt-planted", "prompt": [{"role": "user", "content": "Finish this module:\n\n" + POLY}],
      "chosen": [{"role": "assistant", "content": "Done."}],
      "rejected": [{"role": "assistant", "content": "No."}]}, "humaneval"),
    ({"id": "answer-planted",  # the implicit form: the prompt is the conversation's shared head
      "chosen": [{"role": "user", "content": "How do I bracket a root?"},
                 {"role": "assistant", "content": "Double the interval until the signs differ:\n\n" + BISECTION}],
      "rejected": [{"role": "user", "content": "How do I bracket a root?"},
                   {"role": "assistant", "content": "Guess."}]}, "humaneval"),
    ({"id": "rejected-planted",  # a pair trains on its rejected answer too: the benchmark's text is seen
      "prompt": [{"role": "user", "content": "Do two numbers have equal divisor sums?"}],
      "chosen": [{"role": "assistant", "content": "Sum each one's divisors and compare the sums."}],
      "rejected": [{"role": "assistant", "content": DIV_SUM["canonical_solution"]}]}, "mbpp"),
]


def test_pairs_are_matched_on_their_prompt_and_both_answers(evalplus_data, tmp_path):
    """A pair source: a HumanEval+ prompt planted in one pair's prompt, solution lines in another's
    chosen answer and an MBPP+ solution in a third's rejected answer alone are dropped and counted; the
    clean pair is written. No line of the HumanEval+ texts holds 12 words on its own, so only n-grams
    across lines catch them, which the pair's JSON text (its newlines escaped to ``\\n``, a word of its
    own) would never hold."""
    assert not lines_with_a_whole_n_gram(POLY) and not lines_with_a_whole_n_gram(BISECTION)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in PAIRS))
    manifest = tokenize.run(str(tmp_path / "in"), tmp_path / "out", TINY_TOKENIZER, pairs=True,
                            decontaminate=["humaneval", "mbpp"], evalplus_data=str(evalplus_data))
    planted = {b: [row["id"] for row, bench in PAIRS if bench == b] for b in ("humaneval", "mbpp")}
    assert manifest["decontamination"]["examples"] == planted == {"humaneval": ["prompt-planted", "answer-planted"],
                                                                  "mbpp": ["rejected-planted"]}
    assert manifest["decontamination"]["dropped"] == {"humaneval": 2, "mbpp": 1}
    assert manifest["pairs"]["pairs"] == 1 and manifest["num_documents"] == 2
    (chosen, mask, _, _), = pairs_of(tmp_path / "out")
    assert Tokenizer(TINY_TOKENIZER).decode(chosen[mask == 1]).strip() == "Dog."


def test_decontaminated_pairs_are_one_tokenization_whatever_the_loss_type(evalplus_data, tmp_path, capsys):
    """The "decontaminated pairs" row of the combinations table (tests/test_combinations.py), which marks it
    as a row the loss type plays no part in: that is what is checked, and the tokenization runs once.
    ``train.data tokenize`` makes the tokenization's arguments (``train.data.tokenize_kwargs``) from the source's fields, ``[data]``
    tokenizer and template, ``[training] seq_len`` and ``[eval]``'s benchmark files, before any training;
    ``[preference] loss`` is read by training alone, from the pairs written. So the arguments are the same
    for every loss type, and the one tokenization they make drops the planted pairs and keeps the clean one."""
    from train import recipe as R
    from train.data import main as data_main
    from train.data import tokenize_kwargs

    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in PAIRS))
    recipe = tmp_path / "dpo.toml"
    recipe.write_text(f"""
[run]
name = "t"
output_dir = "{tmp_path / 'run'}"
[model]
flavor = "tiny"
[data]
tokenizer = "{TINY_TOKENIZER}"
[[data.sources]]
name = "prefs"
input = "{tmp_path / 'pairs.jsonl'}"
pairs = true
path = "{tmp_path / 'tok'}"
weight = 1.0
decontaminate = ["humaneval", "mbpp"]
[preference]
loss = "dpo"
[eval]
evalplus_data = "{evalplus_data}"
[optimizer]
lr = 1e-3
[training]
seq_len = 128
global_batch = 2
micro_batch = 2
steps = 1
""")
    loaded = {loss: R.load(str(recipe), [f'preference.loss="{loss}"']) for loss in LOSSES}
    assert {loss: r.preference.loss for loss, r in loaded.items()} == {loss: loss for loss in LOSSES}
    first, *others = (tokenize_kwargs(r, r.data.sources[0]) for r in loaded.values())
    assert first["decontaminate"] == ["humaneval", "mbpp"] and first["pairs"] and all(k == first for k in others)
    assert data_main(["tokenize", "--recipe", str(recipe), "--source", "prefs"]) == 0
    assert "dropped as benchmark overlap (12-grams): {'humaneval': 2, 'mbpp': 1}" in capsys.readouterr().out
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["pairs"]["pairs"] == 1
