"""Tokenize a text corpus into datatrove token shards plus manifest.json, locally or on SLURM.

    python -m data.tokenize --input <hub id | dir | glob of jsonl/parquet> --text-key text \
        --tokenizer assets/tokenizer/tokenizer.model --out <dir> [--tasks N --workers N]
        [--subset C --split S --revision SHA --exclude COLUMN=VALUE ... --held-out FRACTION|COUNT]
        [--min-doc-tokens N] [--concat-by REPO_COLUMN --concat-order PATH_COLUMN]
        [--slurm --partition P --time 12:00:00 --cpus 2 --mem-per-cpu 2 --qos ""]
    python -m train.data tokenize --recipe phase1 --source web-high [...]   # a recipe's source

One run tokenizes one source into one directory (read by data.shards /
data.mixture). The pipeline is datatrove's: a reader matched to the input
(JsonlReader / ParquetReader split the files across tasks;
HuggingFaceDatasetReader for a hub id), then datatrove's DocumentTokenizer with the
`tokenizers` twin of the SentencePiece model (data.hf_tokenizer) and the framing
``<s> text </s>`` (data.tokenizer). Documents are not shuffled here: the mixture
loader permutes documents itself, per epoch.

Conversations: ``--chat-key messages`` reads ``[{"role", "content"}]`` lists
instead of text, renders them with the chat template (data.chat) and also
writes a loss mask per shard (``.ds.loss``, see data.chat_tokenize); refused
conversations are counted in the manifest, never written. ``--pairs`` reads
preference pairs (``prompt``/``chosen``/``rejected``, see data.pairs) the same
way: two documents a row, chosen then rejected, rows refused (and those over
``--seq-len``) counted in the manifest's ``pairs`` entry. ``--exclude
COLUMN=VALUE`` drops the rows whose column holds that value (e.g. a mixture's
hard-coded identity conversations); the manifest records the rule and the
count. A Hub dataset (or a local copy made by data.download, read through its
card the same way) is described in the manifest by hub id, subset, split and
revision.

Long documents, for a long-context phase: ``--min-doc-tokens N`` keeps only
documents of at least N tokens (framing included), the others counted in the
manifest (``min_doc_tokens``). ``--concat-by COLUMN --concat-order PATH`` makes one
document of each repository of a code source, as ProLong (arXiv 2410.02660) trains
on code (its ``thestackv1_concat_by_repo`` data, princeton-nlp/prolong-data-64K;
The Stack's columns are ``max_stars_repo_name`` and ``max_stars_repo_path``): the
rows with one value of COLUMN, sorted by PATH, each after a line with its path
(DeepSeek-Coder, arXiv 2401.14196 section 2.2, adds the path the same way), a blank
line between files. A repository's files can sit anywhere in the input, so this
runs in two stages of ``--tasks`` tasks: the rows go to one bucket per task by a
hash of their repository (``<out>/logs/repositories``: a copy of the rows, kept so
that a rerun task reads them again), then each task joins the repositories of its
bucket in memory (about the source's size / tasks) and tokenizes them. Rows
without COLUMN are counted, not written. Every manifest counts its documents of at
least 4k to 32k tokens (data.shards).

Reruns are cheap and safe: the datatrove logging dir is <out>/logs, so finished
tasks are skipped; never change --tasks between reruns. With --slurm the
manifest is written by a 1-task job that depends on the tokenization array;
locally it is written at the end. ``--manifest-only`` rebuilds it from shards.
``--held-out`` then moves a hashed choice of documents into ``<out>/held_out`` (data.held_out).
"""

from __future__ import annotations

import argparse
import glob as globlib
import hashlib
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.tokens.tokenizer import DocumentTokenizer, TokenizedFile
from datatrove.utils.batching import batched

from data import decontaminate as decont
from data.hf_tokenizer import PROBE_TEXTS, build_fast_tokenizer, document_post_processor
from data.held_out import HeldOutError, add_held_out_flag, describe, split
from data.pairs import MANIFEST_KEY as PAIRS
from data.shards import LOGS_DIR, describe_long_documents, load_manifest, write_manifest
from data.tokenizer import Tokenizer
from rundir import REPO

BATCH_SIZE = 500  # 10,000 (datatrove's default) peaked at 3.2 GB RSS; SLURM often gives 2 GB/CPU
REPOSITORIES = "repositories"  # --concat-by's first stage, under LOGS_DIR: its logs and its buckets of rows
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst")


def _shown(path: Path) -> str:
    """Repo-relative when inside the repo, so committed manifests hold no machine paths."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def tokenizer_info(sp: Tokenizer) -> dict:
    """The manifest's ``tokenizer`` entry."""
    return {"path": _shown(sp.path), "fingerprint": sp.fingerprint, "vocab_size": sp.vocab_size,
            "bos_id": sp.bos_id, "eos_id": sp.eos_id}


def describe_input(spec: str, split: str = "train", subset: str | None = None) -> dict:
    """Classify --input: local/remote files (folder + glob + format) or a Hub dataset id."""
    if globlib.has_magic(spec):
        parts = spec.split("/")
        cut = next(i for i, p in enumerate(parts) if globlib.has_magic(p))
        folder, pattern = "/".join(parts[:cut]) or ".", "/".join(parts[cut:])
    elif Path(spec).is_file():
        folder, pattern = str(Path(spec).parent), Path(spec).name
    elif Path(spec).is_dir() or "://" in spec:
        folder, pattern = spec, None
    elif spec.startswith(("/", ".", "~")) or spec.count("/") != 1:
        raise FileNotFoundError(f"--input {spec!r}: no such file or directory (and not a hub id 'org/name')")
    else:
        return {"kind": "hub", "dataset": spec, "split": split, "subset": subset}
    if "://" not in folder:
        folder = str(Path(folder).resolve())
    if pattern is None:
        names = [p.name for p in Path(folder).rglob("*") if p.is_file()] if Path(folder).is_dir() else []
        has_parquet = any(n.endswith(".parquet") for n in names)
        has_jsonl = any(n.endswith(_JSONL) for n in names)
        if has_parquet and has_jsonl:
            raise ValueError(f"{folder} holds both parquet and jsonl files: pass a glob")
        pattern = "**/*.parquet" if has_parquet else "**/*.jsonl*"
    fmt = "parquet" if pattern.endswith(".parquet") else "jsonl"
    return {"kind": fmt, "folder": folder, "glob": pattern}


def make_reader(desc: dict, text_key: str, limit: int = -1, streaming: bool = False, adapter=None):
    from datatrove.pipeline.readers import HuggingFaceDatasetReader, JsonlReader, ParquetReader

    if desc["kind"] == "hub":
        options = {"split": desc["split"], **({"name": desc["subset"]} if desc["subset"] else {}),
                   **({"revision": desc["revision"]} if desc.get("revision") else {})}
        return HuggingFaceDatasetReader(desc["dataset"], dataset_options=options, streaming=streaming,
                                        text_key=text_key, limit=limit, batch_size=BATCH_SIZE, adapter=adapter)
    cls = ParquetReader if desc["kind"] == "parquet" else JsonlReader
    kwargs = {"batch_size": BATCH_SIZE} if cls is ParquetReader else {}
    return cls(desc["folder"], glob_pattern=desc["glob"], text_key=text_key, limit=limit, adapter=adapter, **kwargs)


def prepare_tokenizer(model_path: Path | None, out: Path) -> tuple[Tokenizer, Path]:
    """Build the tokenizer.json datatrove uses from the .model (the fingerprinted source of truth),
    check it against SentencePiece on PROBE_TEXTS, and save it under <out>/logs.

    A tokenizer.json lying next to the model is ignored on purpose: a stock Llama-2 one
    turns literal "</s>" into EOS (see data.hf_tokenizer).
    """
    sp = Tokenizer(model_path)
    fast = build_fast_tokenizer(sp.path)
    bad = [t for t in PROBE_TEXTS if fast.encode(t).ids != sp.encode(t, bos=True)]
    if bad:
        raise RuntimeError(f"tokenizer.json converted from {sp.path} disagrees with SentencePiece on {bad!r}")
    path = out / LOGS_DIR / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    fast.save(str(path))
    return sp, path


class TextTokenizer(DocumentTokenizer):
    """datatrove's DocumentTokenizer (unshuffled, indexed) writing only documents of at least ``min_doc_tokens``
    tokens; the others are counted in its stats (``short_documents``, ``short_tokens``)."""

    name = "✍️ Text tokenizer"

    def __init__(self, out: str, tokenizer_json: str, sp: Tokenizer, min_doc_tokens: int = 0):
        super().__init__(out, tokenizer_name_or_path=tokenizer_json, batch_size=BATCH_SIZE, shuffle_documents=False,
                         save_index=True, save_final_metadata=True)
        # The base class applies post_processor in place of its EOS-only template: <s> text </s>.
        self.post_processor = document_post_processor(bos_id=sp.bos_id, eos_id=sp.eos_id)
        self.min_doc_tokens = min_doc_tokens

    def write_unshuffled(self, data, filename: str):
        out = TokenizedFile(self.output_folder, filename, save_index=True, upload_block_size=self.upload_block_size,
                            tokenizer_name_or_path=self.tokenizer_name_or_path,
                            save_final_metadata=self.save_final_metadata, token_size=self.token_size)
        for batch in batched(data, self.batch_size):
            with self.track_time(unit="batch"):
                for encoded in self.tokenizer.encode_batch([document.text for document in batch]):
                    if len(encoded.ids) < self.min_doc_tokens:
                        self.stat_update("short_documents")
                        self.stat_update("short_tokens", value=len(encoded.ids))
                        continue
                    out.write(encoded.ids, None)
                    self.stat_update("tokens", value=len(encoded.ids))
        out.close()
        return out


def repository_bucket(repository: str, buckets: int) -> int:
    """The bucket of a repository: a hash that every task and every rerun computes alike (not ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repository.encode(), digest_size=8).digest(), "little") % buckets


class BucketRepositories(PipelineStep):
    """--concat-by, stage 1: each row to the bucket of its repository, ``<folder>/<bucket>/<task>.jsonl.gz``
    (a rerun of a task rewrites its own files); rows without the column are counted (``without_column``)."""

    name = "🗂️ Bucket repositories"
    type = "📝 - WRITER"

    def __init__(self, folder: str, column: str, buckets: int):
        super().__init__()
        self.folder, self.column, self.buckets = folder, column, buckets

    def run(self, data, rank: int = 0, world_size: int = 1):
        from datatrove.pipeline.writers import JsonlWriter

        with JsonlWriter(self.folder, output_filename="${bucket}/${rank}.jsonl.gz") as writer:
            for document in data:
                repository = document.metadata.get(self.column)
                if repository is None:
                    self.stat_update("without_column")
                    continue
                document.metadata["bucket"] = f"{repository_bucket(str(repository), self.buckets):05d}"
                writer.write(document, rank)
                self.stat_update("files")
        return iter(())


class ConcatRepositories(PipelineStep):
    """--concat-by, stage 2: task ``r`` reads bucket ``r`` and yields one document per repository, its files
    sorted by the ``order`` column (then by row id: the same input gives the same documents)."""

    name = "🔗 Concatenate repositories"
    type = "🔻 - READER"

    def __init__(self, folder: str, column: str, order: str):
        super().__init__()
        self.folder, self.column, self.order = folder, column, order

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        from datatrove.io import get_datafolder
        from datatrove.pipeline.readers import JsonlReader

        bucket = f"{rank:05d}"
        files = defaultdict(list)
        if get_datafolder(self.folder).isdir(bucket):
            for document in JsonlReader(f"{self.folder}/{bucket}", glob_pattern="*.jsonl.gz").run():
                path = str(document.metadata.get(self.order, ""))
                files[str(document.metadata[self.column])].append((path, document.id, document.text))
        for repository in sorted(files):
            text = "\n\n".join(f"{path}\n{text}" for path, _, text in sorted(files[repository]))
            self.stat_update("repositories")
            yield Document(text=text, id=repository, metadata={self.column: repository})


class ExcludeRows(BaseFilter):
    """Drop documents whose metadata column holds one of the listed values (``{column: [values]}``)."""

    name = "🚫 exclude rows"

    def __init__(self, exclude: dict[str, list[str]]):
        super().__init__()
        self.exclude = {column: set(values) for column, values in exclude.items()}

    def filter(self, doc) -> bool:
        return not any(doc.metadata.get(column) in values for column, values in self.exclude.items())


def step_stats(out: Path, step: type[PipelineStep]) -> Counter:
    """A pipeline step's counters summed over the tasks' datatrove stats (both stages of --concat-by)."""
    total: Counter = Counter()
    for path in (out / LOGS_DIR).glob("**/stats/*.json"):
        for entry in json.loads(path.read_text()):
            if entry.get("name", "").endswith(step.name):
                total.update({k: v["total"] if isinstance(v, dict) else v for k, v in entry.get("stats", {}).items()})
    return total


def excluded_rows(out: Path) -> int:
    """Rows ExcludeRows dropped, summed over the tasks' datatrove stats."""
    stats = step_stats(out, ExcludeRows)
    return int(stats["total"] - stats["forwarded"])


class WriteManifest(PipelineStep):
    """Final 1-task step (SLURM): write manifest.json once every tokenization task finished."""

    name = "manifest"
    type = "📝 - WRITER"

    def __init__(self, out: str, tokenizer: dict, description: dict, tasks: int, held_out: float | int | None = None):
        super().__init__()
        self.out, self.tokenizer, self.description, self.tasks = out, tokenizer, description, tasks
        self.held_out = held_out

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        finish(Path(self.out), self.tokenizer, self.description, self.tasks, self.held_out)
        return iter(())


class EmptyTokenization(ValueError):
    """Every task finished and no document came out: the key or the filter matched nothing."""


def input_columns(description: dict) -> list[str] | None:
    """The columns of the input's first row (local or remote jsonl/parquet; None for a Hub dataset,
    whose card lists them), to say which key to pass when the chosen one matched nothing."""
    if description.get("kind") not in ("jsonl", "parquet"):
        return None
    from datatrove.io import get_datafolder

    folder = get_datafolder(description["folder"])
    files = folder.list_files(glob_pattern=description["glob"])
    if not files:
        return None
    if description["kind"] == "parquet":
        import pyarrow.parquet as pq

        with folder.open(files[0], "rb") as f:
            return pq.read_schema(f).names
    with folder.open(files[0], "rt", compression="infer") as f:
        first = next((line for line in f if line.strip()), None)
    return list(json.loads(first)) if first else None


def empty_tokenization(out: Path, description: dict) -> EmptyTokenization:
    """The error for a tokenization that wrote no document, naming the key and the input's columns.
    Its task completions are cleared, so the corrected command tokenizes again instead of skipping."""
    for done in (out / LOGS_DIR).glob("**/completions/*"):  # --concat-by's first stage too
        done.unlink()
    key = ("--chat-key", description["chat_key"]) if description.get("chat_key") else \
        ("--text-key", description.get("text_key", "text"))
    columns = input_columns(description)
    has = f"its rows have the columns {columns}" if columns else "see the dataset's card for its columns"
    reasons = {"exclude": "--exclude dropped every row",
               "concat_by": f"no row has --concat-by's column {description.get('concat_by')!r}",
               "min_doc_tokens": f"no document has {description.get('min_doc_tokens')} tokens"}
    causes = [why for option, why in reasons.items() if description.get(option)]
    excluded = f" (or {'; or '.join(causes)})" if causes else ""
    if description.get("pairs"):  # every row refused: say why, by reason
        from data.chat_tokenize import logged

        refused = dict(logged(out, PAIRS)[1])
        return EmptyTokenization(f"{description.get('spec', out)}: no pairs: rows refused: {refused or 'none'}"
                                 f"{excluded}; --pairs reads chosen/rejected message lists (and a prompt list or "
                                 f"string); {has}. Nothing was written to {out}/manifest.json")
    return EmptyTokenization(f"{description.get('spec', out)}: no documents: {key[0]} {key[1]!r} matched no "
                             f"text{excluded}; {has}. Nothing was written to {out}/manifest.json")


def finish(out: Path, tokenizer: dict, description: dict, tasks: int, held_out: float | int | None = None) -> dict:
    """Check every task finished, write manifest.json and, with ``held_out``, split off the held-out
    documents (data.held_out: after writing, by a hash of each document's ids)."""
    done = {p.name for p in (out / LOGS_DIR / "completions").glob("*")}
    missing = [r for r in range(tasks) if f"{r:05d}" not in done]
    if missing:
        raise RuntimeError(f"{out}: tokenization tasks {missing[:10]} did not finish; rerun the same command")
    if not any(n for f in out.glob("*.ds.index") if (n := f.stat().st_size)):  # no document in any shard
        raise empty_tokenization(out, description)
    from importlib.metadata import version

    extra = {"tasks": tasks, "datatrove_version": version("datatrove")}
    if description.get("exclude"):
        extra["excluded_rows"] = excluded_rows(out)
    if description.get("concat_by"):
        rows, joined = step_stats(out, BucketRepositories), step_stats(out, ConcatRepositories)
        extra["concat"] = {"by": description["concat_by"], "order": description["concat_order"],
                           "files": int(rows["files"]), "rows_without_column": int(rows["without_column"]),
                           "repositories": int(joined["repositories"])}
    if description.get("min_doc_tokens"):
        short = step_stats(out, TextTokenizer)
        extra["min_doc_tokens"] = {"min": description["min_doc_tokens"],
                                   "dropped_documents": int(short["short_documents"]),
                                   "dropped_tokens": int(short["short_tokens"])}
    if description.get("chat_key"):  # conversations: template and refused ones (data.chat_tokenize)
        from data.chat_tokenize import chat_summary

        extra["chat"] = chat_summary(out, description.get("chat_template"), description["chat_key"])
    if description.get("pairs"):  # preference pairs: formats, template, refused rows (data.pairs_tokenize)
        from data.pairs_tokenize import pair_summary

        extra[PAIRS] = pair_summary(out, description.get("chat_template"), description.get("seq_len"))
    if decontamination := decont.summary(out):
        extra["decontamination"] = decontamination
    manifest = write_manifest(out, tokenizer, description, extra)
    if held_out:
        split(out, held_out)
        manifest = load_manifest(out)
    return manifest


def run(input_spec: str, out: str | Path, tokenizer: str | Path | None = None, text_key: str = "text",
        tasks: int = 1, workers: int = -1, split: str = "train", subset: str | None = None,
        limit: int = -1, streaming: bool = False, slurm: dict | None = None, manifest_only: bool = False,
        description: dict | None = None, chat_key: str | None = None,
        chat_template: str | None = None, hub: bool = False, revision: str | None = None,
        exclude: dict[str, list[str]] | None = None, pairs: bool = False, seq_len: int | None = None,
        held_out: float | int | None = None, decontaminate: list[str] | None = None,
        evalplus_data: str | None = None, core_bundle: str | None = None, min_doc_tokens: int | None = None,
        concat_by: str | None = None, concat_order: str | None = None) -> dict | None:
    """Tokenize input_spec into out; returns the manifest (None when submitted to SLURM).
    ``held_out``: a fraction or a document count held out into ``out/held_out`` (data.held_out).
    ``hub``: input_spec is a ``datasets.load_dataset`` name (a Hub id, or a local dataset dir);
    ``description``: what the manifest records as the input (default: what was read);
    ``pairs``: preference pairs (data.pairs), refusing a pair with a side over ``seq_len`` tokens;
    ``decontaminate``: benchmarks whose n-grams drop documents (data.decontaminate);
    ``min_doc_tokens``, ``concat_by`` and ``concat_order``: long documents (the module docstring)."""
    if pairs and chat_key:
        raise ValueError("give --pairs or --chat-key, not both (pairs are read from prompt/chosen/rejected)")
    if (min_doc_tokens or concat_by) and (pairs or chat_key):
        raise ValueError("--min-doc-tokens and --concat-by are for text sources, not --chat-key or --pairs")
    if (concat_by is None) != (concat_order is None):
        raise ValueError("give --concat-by and --concat-order together (a repository's files need an order)")
    out = Path(out).resolve()
    source = {"kind": "hub", "dataset": input_spec, "split": split, "subset": subset, "revision": revision} \
        if hub or revision else describe_input(input_spec, split, subset)
    desc = description or {**source, "text_key": text_key, "spec": input_spec}
    if chat_key:
        desc = {**desc, "chat_key": chat_key, "chat_template": chat_template}
    if pairs:
        desc = {**desc, "pairs": True, "chat_template": chat_template, "seq_len": seq_len}
    if exclude:
        desc = {**desc, "exclude": exclude}
    if min_doc_tokens:
        desc = {**desc, "min_doc_tokens": min_doc_tokens}
    if concat_by:
        desc = {**desc, "concat_by": concat_by, "concat_order": concat_order}
    if manifest_only:
        return finish(out, tokenizer_info(Tokenizer(tokenizer)), desc, tasks, held_out)
    out.mkdir(parents=True, exist_ok=True)
    sp, tok_json = prepare_tokenizer(Path(tokenizer) if tokenizer else None, out)
    tok_info = tokenizer_info(sp)
    if chat_key:  # conversations: rendered by data.chat, with a loss mask
        from data.chat_tokenize import ChatTokenizer, chat_adapter

        pipeline = [make_reader(source, chat_key, limit, streaming, adapter=chat_adapter),
                    ChatTokenizer(str(out), str(tok_json), str(sp.path), chat_template, BATCH_SIZE)]
    elif pairs:  # preference pairs: two documents a row (data.pairs_tokenize)
        from data.pairs_tokenize import PairTokenizer, pair_adapter

        pipeline = [make_reader(source, "chosen", limit, streaming, adapter=pair_adapter),
                    PairTokenizer(str(out), str(tok_json), str(sp.path), chat_template, BATCH_SIZE, seq_len)]
    else:
        pipeline = [make_reader(source, text_key, limit, streaming),
                    TextTokenizer(str(out), str(tok_json), sp, min_doc_tokens or 0)]
    # (steps, logging dir) run one after the other; with --concat-by, rows are bucketed by repository first
    stages = [(pipeline, out / LOGS_DIR)]
    if concat_by:
        buckets = str(out / LOGS_DIR / REPOSITORIES / "rows")
        stages = [([pipeline[0], BucketRepositories(buckets, concat_by, tasks)], out / LOGS_DIR / REPOSITORIES),
                  ([ConcatRepositories(buckets, concat_by, concat_order), pipeline[1]], out / LOGS_DIR)]
    rows = stages[0][0]  # the steps that see the input's rows
    if exclude:
        rows.insert(1, ExcludeRows(exclude))
    if decontaminate:  # after the reader (and --exclude): datatrove's n-gram filter, drops counted per benchmark
        kind = "chat" if chat_key else "pairs" if pairs else None  # JSON documents: matched on their messages
        rows.insert(-1, decont.prepare(out, decontaminate, evalplus_data, core_bundle, kind))
    else:
        decont.check_rerun(out)
    if slurm is None:
        from datatrove.executor import LocalPipelineExecutor

        for steps, logs in stages:
            LocalPipelineExecutor(steps, tasks=tasks, workers=workers, logging_dir=str(logs)).run()
        return finish(out, tok_info, desc, tasks, held_out)
    from datatrove.executor import SlurmPipelineExecutor

    # sbatch exports the environment: make the venv's tools and this repo importable on the nodes.
    env = f"export PATH={Path(sys.executable).parent}:$PATH PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}"
    common = dict(partition=slurm["partition"], time=slurm["time"], qos=slurm.get("qos", ""), env_command=env,
                  mem_per_cpu_gb=slurm.get("mem_per_cpu", 2), sbatch_args=slurm.get("sbatch_args") or {})
    tok_exec = None
    for steps, logs in stages:
        tok_exec = SlurmPipelineExecutor(steps, tasks=tasks, workers=workers, logging_dir=str(logs), depends=tok_exec,
                                         cpus_per_task=slurm.get("cpus", 1), job_name=f"tok_{out.name}", **common)
    SlurmPipelineExecutor([WriteManifest(str(out), tok_info, desc, tasks, held_out)], tasks=1, depends=tok_exec,
                          logging_dir=str(out / "logs_manifest"), job_name=f"manifest_{out.name}", **common).run()
    return None


def add_run_options(p: argparse.ArgumentParser) -> None:
    """How to run a tokenization (shared by ``--input`` and ``train.data tokenize --recipe``)."""
    p.add_argument("--tasks", type=int, default=1, help="output shards; never change between reruns")
    p.add_argument("--workers", type=int, default=-1, help="tasks run at once (-1: all)")
    p.add_argument("--streaming", action="store_true", help="hub datasets: stream instead of download")
    p.add_argument("--limit", type=int, default=-1, help="documents per task (debugging)")
    p.add_argument("--manifest-only", action="store_true", help="rewrite manifest.json from finished shards")
    p.add_argument("--evalplus-data", help="decontamination: folder with HumanEvalPlus.jsonl(.gz) and "
                   "MbppPlus.jsonl(.gz), or FILE,FILE")
    p.add_argument("--core-bundle", help="decontamination: a CORE bundle folder (its eval_data/)")
    s = p.add_argument_group("SLURM")
    s.add_argument("--slurm", action="store_true")
    s.add_argument("--partition")
    s.add_argument("--time", default="12:00:00")
    s.add_argument("--cpus", type=int, default=1, help="CPUs per task")
    s.add_argument("--mem-per-cpu", type=int, default=2, help="GB")
    s.add_argument("--qos", default="", help='"" emits no --qos')
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra #SBATCH lines, e.g. signal=USR1@120 (requeue on preemption), account=x")


def slurm_options(a: argparse.Namespace, p: argparse.ArgumentParser) -> dict | None:
    if not a.slurm:
        return None
    if not a.partition:
        p.error("--slurm needs --partition")
    return {"partition": a.partition, "time": a.time, "cpus": a.cpus, "mem_per_cpu": a.mem_per_cpu,
            "qos": a.qos, "sbatch_args": dict(kv.split("=", 1) for kv in a.sbatch_arg)}


def parse_exclude(items: list[str], p: argparse.ArgumentParser) -> dict[str, list[str]]:
    exclude: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            p.error(f"--exclude {item!r}: expected COLUMN=VALUE")
        column, value = item.split("=", 1)
        exclude.setdefault(column, []).append(value)
    return exclude


def run_and_report(a: argparse.Namespace, p: argparse.ArgumentParser, **kwargs) -> None:
    """``run`` with the run options of ``a``, then one line on what was written."""
    manifest = run(out=a.out, tasks=a.tasks, workers=a.workers, limit=a.limit, streaming=a.streaming,
                   slurm=slurm_options(a, p), manifest_only=a.manifest_only,
                   **{**kwargs, **{k: v for k, v in (("evalplus_data", a.evalplus_data),
                                                     ("core_bundle", a.core_bundle)) if v}})
    if manifest:
        print(f"{a.out}: {manifest['num_documents']} documents, {manifest['num_tokens']} tokens "
              f"in {len(manifest['shards'])} shards")
        if "chat" in manifest:
            print(f"conversations refused (not trained on): {manifest['chat']['rejected'] or 'none'}")
        if PAIRS in manifest:
            print(f"{manifest[PAIRS]['pairs']} pairs {manifest[PAIRS]['format']}; rows refused (not trained on): "
                  f"{manifest[PAIRS]['rejected'] or 'none'}")
        if "excluded_rows" in manifest:
            print(f"rows excluded by {manifest['input']['exclude']}: {manifest['excluded_rows']}")
        if "concat" in manifest:
            c = manifest["concat"]
            print(f"{c['files']} files joined into {c['repositories']} repositories by {c['by']!r} in {c['order']!r} "
                  f"order; rows without {c['by']!r}: {c['rows_without_column']}")
        if "min_doc_tokens" in manifest:
            m = manifest["min_doc_tokens"]
            print(f"documents under {m['min']} tokens dropped: {m['dropped_documents']} ({m['dropped_tokens']} tokens)")
        print(describe_long_documents(manifest))
        if "held_out" in manifest:
            print(describe(Path(a.out), manifest["held_out"]))
        if "decontamination" in manifest:
            print(f"dropped as benchmark overlap ({manifest['decontamination']['n_grams']}-grams): "
                  f"{manifest['decontamination']['dropped']}")
    else:
        print(f"submitted; {Path(a.out) / 'manifest.json'} appears when the jobs finish")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="hub dataset id, local/remote dir, or glob of jsonl/parquet")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="the tokenizer.model the run will train with (no default: "
                   "shards made with another tokenizer cost a re-run)")
    p.add_argument("--text-key", default="text")
    p.add_argument("--chat-key", help="conversations: the key of the [{role, content}] list (writes a loss mask)")
    p.add_argument("--chat-template", help="data.chat template name, .jinja file or HF folder (default: llama2)")
    p.add_argument("--pairs", action="store_true", help="preference pairs: prompt/chosen/rejected (data.pairs)")
    p.add_argument("--seq-len", type=int, help="--pairs: refuse a pair with a side longer than this many tokens")
    p.add_argument("--split", default="train", help="hub datasets: split")
    p.add_argument("--subset", default=None, help="hub datasets: config name")
    p.add_argument("--revision", default=None, help="hub datasets: a commit to read (recorded in the manifest)")
    p.add_argument("--exclude", action="append", default=[], metavar="COLUMN=VALUE",
                   help="drop rows whose COLUMN holds VALUE (repeatable)")
    add_held_out_flag(p, "hold out a fraction (0.001) or a number (2000) of the documents into OUT/held_out, chosen "
                      "by a hash of each document (data.held_out)")
    p.add_argument("--decontaminate", metavar="humaneval,mbpp[,core]",
                   help="drop documents sharing an n-gram with these benchmarks (data.decontaminate)")
    p.add_argument("--min-doc-tokens", type=int, help="keep only documents of at least this many tokens "
                   "(framing included); the others are counted in the manifest")
    p.add_argument("--concat-by", metavar="COLUMN", help="one document per value of COLUMN (a code source's "
                   "repository), its rows in --concat-order order")
    p.add_argument("--concat-order", metavar="COLUMN", help="with --concat-by: the column (file path) that orders "
                   "a repository's rows")
    add_run_options(p)
    a = p.parse_args(argv)
    if a.pairs and a.chat_key:
        p.error("give --pairs or --chat-key, not both (pairs are read from prompt/chosen/rejected)")
    if a.seq_len is not None and not a.pairs:
        p.error("--seq-len is for --pairs")
    if (a.min_doc_tokens or a.concat_by) and (a.pairs or a.chat_key):
        p.error("--min-doc-tokens and --concat-by are for text sources, not --chat-key or --pairs")
    if (a.concat_by is None) != (a.concat_order is None):
        p.error("give --concat-by and --concat-order together (a repository's files need an order)")
    try:
        run_and_report(a, p, input_spec=a.input, tokenizer=a.tokenizer, text_key=a.text_key, split=a.split,
                       subset=a.subset, revision=a.revision, chat_key=a.chat_key, chat_template=a.chat_template,
                       exclude=parse_exclude(a.exclude, p), pairs=a.pairs, seq_len=a.seq_len, held_out=a.held_out,
                       decontaminate=decont.parse_benchmarks(a.decontaminate) if a.decontaminate else None,
                       min_doc_tokens=a.min_doc_tokens, concat_by=a.concat_by, concat_order=a.concat_order)
    except (EmptyTokenization, FileNotFoundError, HeldOutError, decont.DecontaminationError) as e:
        p.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    # Re-import under the package name so WriteManifest pickles as data.tokenize.WriteManifest
    # (SLURM nodes import it), not as a __main__ class.
    from data.tokenize import main as _main

    _main()
