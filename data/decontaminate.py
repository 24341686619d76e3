"""Decontamination against the benchmarks, with datatrove's own n-gram steps (``datatrove.pipeline.decont``).

    python -m data.tokenize ... --decontaminate humaneval,mbpp[,core] --evalplus-data DIR [--core-bundle DIR]
    python -m data.decontaminate report SOURCE_DIR ... --benchmarks humaneval,mbpp --evalplus-data DIR

Every n-gram of a benchmark's text goes into datatrove's index (``NGramsDecontIndexer``'s
``<benchmark>.index.hashes``: its hash of each n-gram, as its ``compute_hashes`` makes it); a
training document holding any of them is dropped by ``NGramsDecontFilter`` (its first matching
n-gram decides the benchmark it is counted under). The texts:

- HumanEval+ and MBPP+ (EvalPlus's release files, read as text: no Hub, no evalplus import): the
  prompt is the query and the canonical solution the label, so the index holds the prompt's
  n-grams, the solution's, and those across the two (``find_query_ngrams``, ``find_overlap_ngrams``);
  the tests as EvalPlus stores them (``base_input``, ``plus_input`` as JSON text, and ``test``
  where a release has it) are labels of their own, without their n-grams of fewer than
  ``MIN_DISTINCT`` distinct words (``[0] * 1000`` would otherwise drop every document with
  twelve zeros in a row);
- CORE (``--core-bundle``, where given): every string of every item of its ``eval_data/**.jsonl``.

A chat source's conversation is matched on its messages' contents, a pair source's row on its prompt's and
both answers' (``DOCUMENT_TEXT``), a message a line: not on the JSON text the reader hands on, whose
escaped newlines would cut every n-gram spanning two lines of code.

n-gram size and normalization: datatrove's defaults, 12 words after its ``simplify_text``
(lowercase, punctuation to spaces, whitespace collapsed, diacritics folded), except that numbers
are kept (``norm_numbers=False``): test inputs are mostly numbers, and with every number read as
"0" any twelve numbers in a row would match them. Words are split on whitespace (``Words``), since
``simplify_text`` has already turned punctuation into spaces; datatrove's English word tokenizer
would need spaCy for the same split. Why 12 and what it cannot catch: see the README's
"Decontamination".

Where a tokenization keeps its decontamination (``DECONT_DIR`` under its logs dir): ``config.json``
(what was asked, which files), ``index/`` (datatrove's index), ``dropped/`` (datatrove's exclusion
writer: every dropped document with the n-gram and benchmark that matched). ``summary`` turns the
latter into the manifest's ``decontamination`` entry.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter, NGramsDecontIndexer
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig, ngrams, simplify_text
from datatrove.utils.word_tokenizers import WordTokenizer

from data.chat import BadConversation
from data.pairs import split_pair
from data.shards import LOGS_DIR, load_manifest, open_source
from data.tokenizer import Tokenizer

BENCHMARKS = ("humaneval", "mbpp", "core")
EVALPLUS_RELEASES = {"humaneval": "HumanEvalPlus", "mbpp": "MbppPlus"}  # EvalPlus's release file names
NGRAM = 12  # datatrove's NGramsDecontConfig default
MIN_DISTINCT = NGRAM // 2  # distinct words a test-input n-gram needs to be indexed
EXAMPLES = 5  # dropped document ids the manifest lists per benchmark
DECONT_DIR = "decont"  # under a tokenized source's LOGS_DIR
CONFIG_FILE = "config.json"
INDEX_DIR = "index"
DROPPED_DIR = "dropped"

# sha1, datatrove's other hash: its xxhash64 passes str, which xxhash >= 4 (installed: 4.1) refuses.
CONFIG = NGramsDecontConfig(n_grams=NGRAM, find_query_ngrams=True, find_overlap_ngrams=True,
                            norm_config=TextNormConfig(norm_numbers=False), hash_config=HashConfig(hash_fc="sha1"))


class DecontaminationError(ValueError):
    """A benchmark name, file or field that decontamination cannot use."""


class Words(WordTokenizer):
    """Whitespace words: ``simplify_text`` has removed punctuation already (datatrove takes a
    ``WordTokenizer`` instance wherever it takes a language)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


WORDS = Words()


def parse_benchmarks(spec: str | list[str] | None) -> list[str]:
    """``"humaneval,mbpp"`` (or a list) -> ["humaneval", "mbpp"], checked."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec or [])
    bad = [n for n in names if n not in BENCHMARKS]
    if bad or len(set(names)) != len(names):
        raise DecontaminationError(f"decontaminate: {spec!r}: expected distinct names among {list(BENCHMARKS)}")
    return names


def evalplus_files(benchmarks: list[str], spec: str | None) -> dict[str, Path]:
    """The release file of each EvalPlus benchmark: ``spec`` is a folder holding them under EvalPlus's
    names (HumanEvalPlus.jsonl(.gz), MbppPlus.jsonl(.gz)) or one file per benchmark, comma-separated, in
    order (as eval.run's --evalplus-data)."""
    wanted = [b for b in benchmarks if b in EVALPLUS_RELEASES]
    if not wanted:
        return {}
    if spec is None:
        raise DecontaminationError(f"--decontaminate {','.join(wanted)} needs --evalplus-data (a folder with "
                                   f"{', '.join(EVALPLUS_RELEASES[b] + '.jsonl.gz' for b in wanted)})")
    if Path(spec).is_dir():
        files = {}
        for b in wanted:
            found = [Path(spec) / f"{EVALPLUS_RELEASES[b]}.jsonl{ext}" for ext in (".gz", "")]
            found = [f for f in found if f.is_file()]
            if not found:
                raise DecontaminationError(f"{spec}: --evalplus-data: no {EVALPLUS_RELEASES[b]}.jsonl.gz or "
                                           f"{EVALPLUS_RELEASES[b]}.jsonl for {b}")
            files[b] = found[0]
        return files
    paths = [Path(f) for f in spec.split(",")]
    if len(paths) != len(wanted):
        raise DecontaminationError(f"--evalplus-data {spec}: {len(paths)} file(s) for {','.join(wanted)}")
    for path in paths:
        if not path.is_file():
            raise DecontaminationError(f"--evalplus-data: {path}: no such file")
    return dict(zip(wanted, paths))


def _jsonl(path: Path):
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DecontaminationError(f"{path}: line {n}: not JSON ({e})") from None


def evalplus_texts(benchmark: str, path: Path):
    """(query, label) pairs of a release file: (prompt, canonical solution), then (None, test) for each test text."""
    for n, task in _jsonl(path):
        missing = [k for k in ("prompt", "canonical_solution", "base_input", "plus_input") if k not in task]
        if missing:
            raise DecontaminationError(f"{path}: line {n}: missing {missing}")
        yield task["prompt"], task["canonical_solution"]
        for key in ("base_input", "plus_input"):
            yield None, json.dumps(task[key])
        if isinstance(task.get("test"), str):
            yield None, task["test"]


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list | dict):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _strings(v)


def core_texts(bundle: str | Path):
    """(None, text) for every string of every item of a CORE bundle's eval_data/ (whatever the task type)."""
    files = sorted((Path(bundle) / "eval_data").rglob("*.jsonl"))
    if not files:
        raise DecontaminationError(f"--core-bundle {bundle}: no eval_data/**/*.jsonl")
    for path in files:
        for _, item in _jsonl(path):
            for text in _strings(item):
                yield None, text


class BenchmarkIndexer(NGramsDecontIndexer):
    """datatrove's indexer fed with (benchmark, query, label) texts read here instead of through
    lighteval from the Hub: its ``compute_hashes`` and its index files, nothing else of its own.

    Its ``run`` reads lighteval tasks, and PipelineStep.__new__ requires lighteval for every subclass;
    neither part is used here, so both are replaced."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def informative_hashes(self, text: str) -> set[int]:
        """The hashes ``compute_hashes(text)`` makes, less those of n-grams with fewer than MIN_DISTINCT words."""
        words = self.tokenizer.word_tokenize(simplify_text(text, self.config.norm_config))
        return {self.hash_func(" ".join(g)) for g in ngrams(words, self.config.n_grams) if len(set(g)) >= MIN_DISTINCT}

    def run(self, data, rank: int = 0, world_size: int = 1):
        hashes = defaultdict(set)
        for benchmark, query, label in data:
            hashes[benchmark].update(self.compute_hashes(label, query) if query is not None
                                     else self.informative_hashes(label))
        for benchmark, found in hashes.items():  # as NGramsDecontIndexer.run writes them
            with self.output_folder.open(f"{benchmark}.index.hashes", mode="wb") as f:
                np.array(sorted(found), dtype=self.config.hash_config.np_descr).tofile(f)
        return {b: len(h) for b, h in hashes.items()}


def benchmark_files(benchmarks: list[str], evalplus_data: str | None = None,
                    core_bundle: str | None = None) -> dict[str, str]:
    """benchmark -> the file (EvalPlus) or folder (CORE) its text is read from, checked to exist."""
    files = {b: str(Path(p).resolve()) for b, p in evalplus_files(benchmarks, evalplus_data).items()}
    if "core" in benchmarks:
        if not core_bundle:
            raise DecontaminationError("--decontaminate core needs --core-bundle (a CORE bundle folder)")
        files["core"] = str(Path(core_bundle).resolve())
    return files


def build_index(folder: str | Path, files: dict[str, str]) -> dict[str, int]:
    """Write datatrove's index of the benchmarks in ``files`` (benchmark_files) into ``folder``;
    returns the n-grams indexed per benchmark."""
    def texts():
        for b, path in files.items():
            pairs = core_texts(path) if b == "core" else evalplus_texts(b, Path(path))
            yield from ((b, query, label) for query, label in pairs)

    return BenchmarkIndexer(str(folder), config=CONFIG, language=WORDS).run(texts())


def messages_text(messages) -> str:
    """The contents of a message list, a message a line ("" for anything else)."""
    return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict)) \
        if isinstance(messages, list) else ""


def conversation_text(text: str) -> str:
    """A conversation document (data.chat_tokenize.chat_adapter's JSON) as the text of its messages."""
    return messages_text(json.loads(text))


def pair_text(text: str) -> str:
    """A pair document (data.pairs_tokenize.pair_adapter's JSON) as the text of the messages a pair trains on:
    its prompt's, then both answers', as data.pairs reads them in every format; "" for a row data.pairs
    cannot read (the pair tokenizer refuses it and counts it)."""
    try:
        _, prompt, chosen, rejected = split_pair(json.loads(text))
    except BadConversation:
        return ""
    return messages_text([*prompt, chosen, rejected])


DOCUMENT_TEXT = {"chat": conversation_text, "pairs": pair_text}  # a document kind's JSON -> the text matched


class BenchmarkFilter(NGramsDecontFilter):
    """datatrove's NGramsDecontFilter with this module's config and words. ``kind`` (a DOCUMENT_TEXT key): the
    document's text is JSON, matched on its messages' contents; in the JSON text, escaped newlines would
    become words of their own (``\\n`` -> "n"), so no n-gram spanning two lines could match."""

    def __init__(self, index_folder: str | Path, kind: str | None = None, dropped_folder: str | Path | None = None):
        from datatrove.pipeline.writers import JsonlWriter

        writer = JsonlWriter(str(dropped_folder)) if dropped_folder else None
        super().__init__(str(index_folder), config=CONFIG, exclusion_writer=writer, language=WORDS)
        self.kind = kind

    def filter(self, doc: Document):
        if self.kind is None:
            return super().filter(doc)
        text = doc.text
        doc.text = DOCUMENT_TEXT[self.kind](text)
        try:
            return super().filter(doc)
        finally:
            doc.text = text


def decont_dir(out: Path) -> Path:
    return Path(out) / LOGS_DIR / DECONT_DIR


def prepare(out: Path, benchmarks: list[str], evalplus_data: str | None, core_bundle: str | None,
            kind: str | None) -> BenchmarkFilter:
    """Index the benchmarks for a tokenization into ``out`` and return its filter step (``kind``: "chat" or
    "pairs" for JSON documents, see BenchmarkFilter). A rerun must ask for the same decontamination as the
    run whose finished tasks it keeps."""
    folder = decont_dir(out)
    files = benchmark_files(benchmarks, evalplus_data, core_bundle)
    config = {"n_grams": NGRAM, "normalization": asdict(CONFIG.norm_config), "min_distinct_test_words": MIN_DISTINCT,
              "words": "whitespace", "benchmarks": benchmarks, "files": files}
    path = folder / CONFIG_FILE
    if not path.is_file() and any((Path(out) / LOGS_DIR / "completions").glob("*")):
        raise DecontaminationError(f"{out} holds tasks tokenized without decontamination (its {LOGS_DIR}/completions); "
                                   f"tokenize into a new --out")
    if path.is_file():
        before = json.loads(path.read_text())
        if {k: before.get(k) for k in ("benchmarks", "files")} != {k: config[k] for k in ("benchmarks", "files")}:
            raise DecontaminationError(f"{path}: {out} was tokenized with decontamination {before['benchmarks']} "
                                       f"from {before['files']}; rerun with the same, or into a new --out")
    config["index_ngrams"] = build_index(folder / INDEX_DIR, files)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return BenchmarkFilter(folder / INDEX_DIR, kind, dropped_folder=folder / DROPPED_DIR)


def check_rerun(out: Path) -> None:
    """A rerun without --decontaminate of a decontaminated tokenization is refused (its tasks would mix)."""
    path = decont_dir(out) / CONFIG_FILE
    if path.is_file():
        raise DecontaminationError(f"{out} was tokenized with --decontaminate "
                                   f"{','.join(json.loads(path.read_text())['benchmarks'])} ({path}); rerun with it")


def summary(out: Path) -> dict | None:
    """The manifest's ``decontamination`` entry (None: not decontaminated): n-gram size, normalization,
    files, and per benchmark the documents dropped and the first EXAMPLES of their ids."""
    folder = decont_dir(out)
    if not (folder / CONFIG_FILE).is_file():
        return None
    config = json.loads((folder / CONFIG_FILE).read_text())
    dropped, examples = Counter(), defaultdict(list)
    for path in sorted((folder / DROPPED_DIR).glob("*.jsonl*")):
        for _, doc in _jsonl(path):
            benchmark = doc["metadata"]["contaminated_task"]
            dropped[benchmark] += 1
            if len(examples[benchmark]) < EXAMPLES:
                examples[benchmark].append(doc["id"])
    return {**config, "dropped": {b: dropped[b] for b in config["benchmarks"]},
            "examples": {b: examples[b] for b in config["benchmarks"]}}


# ---------------------------------------------------------------- report on tokenized shards

def overlap(directory: str | Path, index_folder: str | Path) -> dict:
    """Per benchmark, the documents of a tokenized source that the filter would drop, and a few ids
    (``<shard>#<document>``); decoded with the source's own tokenizer. Reads, never writes."""
    manifest = load_manifest(directory)
    sp = Tokenizer(manifest["tokenizer"]["path"])
    source = open_source(directory, expected_fingerprint=sp.fingerprint, check_docs=False)
    step = BenchmarkFilter(index_folder)
    dropped, examples, total = Counter(), defaultdict(list), 0
    for shard in source.shards:
        for i in range(shard.num_documents):
            total += 1
            doc = Document(text=sp.decode(shard.document(i)), id=f"{shard.path.name}#{i}")
            if step.filter(doc) is not True:
                benchmark = doc.metadata["contaminated_task"]
                dropped[benchmark] += 1
                if len(examples[benchmark]) < EXAMPLES:
                    examples[benchmark].append(doc.id)
    return {"documents": total, "dropped": dict(dropped), "examples": dict(examples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.decontaminate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="the overlap of tokenized sources with the benchmarks (changes nothing)")
    r.add_argument("dirs", nargs="+", type=Path)
    r.add_argument("--benchmarks", required=True, help=f"comma list of {','.join(BENCHMARKS)}")
    r.add_argument("--evalplus-data", help="folder with HumanEvalPlus.jsonl(.gz)/MbppPlus.jsonl(.gz), or FILE,FILE")
    r.add_argument("--core-bundle", help="a CORE bundle folder (eval_data/)")
    a = p.parse_args(argv)
    try:
        benchmarks = parse_benchmarks(a.benchmarks)
        with tempfile.TemporaryDirectory() as tmp:
            build_index(tmp, benchmark_files(benchmarks, a.evalplus_data, a.core_bundle))
            for d in a.dirs:
                found = overlap(d, tmp)
                print(f"{d}: {found['documents']} documents; n-gram {NGRAM}")
                for b in benchmarks:
                    ids = ", ".join(found["examples"].get(b, []))
                    print(f"  {b}: {found['dropped'].get(b, 0)} overlapping" + (f" ({ids})" if ids else ""))
    except (ValueError, OSError) as e:  # DecontaminationError, ShardError, a missing file
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
