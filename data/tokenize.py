"""Tokenize a text corpus into datatrove token shards plus manifest.json, locally or on SLURM.

    python -m data.tokenize --input <hub id | dir | glob of jsonl/parquet> --text-key text \
        --tokenizer assets/tokenizer/tokenizer.model --out <dir> [--tasks N --workers N]
        [--subset C --split S --revision SHA --exclude COLUMN=VALUE ... --holdout FRACTION|COUNT]
        [--slurm --partition P --time 12:00:00 --cpus 2 --mem-per-cpu 2 --qos ""]
    python -m train.data tokenize --recipe phase1 --source web-high [...]   # a recipe's source

One run tokenizes one source into one directory (read by data.shards /
data.mixture). The pipeline is datatrove's: a reader matched to the input
(JsonlReader / ParquetReader split the files across tasks;
HuggingFaceDatasetReader for a hub id), then DocumentTokenizer with the
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

Reruns are cheap and safe: the datatrove logging dir is <out>/logs, so finished
tasks are skipped; never change --tasks between reruns. With --slurm the
manifest is written by a 1-task job that depends on the tokenization array;
locally it is written at the end. ``--manifest-only`` rebuilds it from shards.
``--holdout`` then moves a hashed choice of documents into ``<out>/heldout`` (data.holdout).
"""

from __future__ import annotations

import argparse
import glob as globlib
import json
import sys
from pathlib import Path

from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter

from data import decontaminate as decont
from data.hf_tokenizer import PROBE_TEXTS, build_fast_tokenizer, document_post_processor
from data.holdout import HoldoutError, describe, parse_holdout, split
from data.pairs import MANIFEST_KEY as PAIRS
from data.shards import LOGS_DIR, load_manifest, write_manifest
from data.tokenizer import Tokenizer
from rundir import REPO

BATCH_SIZE = 500  # 10,000 (datatrove's default) peaked at 3.2 GB RSS; SLURM often gives 2 GB/CPU
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


def tokenizer_step(tokenizer_json: Path, out: Path, sp: Tokenizer):
    from datatrove.pipeline.tokens import DocumentTokenizer

    step = DocumentTokenizer(str(out), tokenizer_name_or_path=str(tokenizer_json), batch_size=BATCH_SIZE,
                             shuffle_documents=False, save_index=True, save_final_metadata=True)
    # The base class applies post_processor in place of its EOS-only template: <s> text </s>.
    step.post_processor = document_post_processor(bos_id=sp.bos_id, eos_id=sp.eos_id)
    return step


class ExcludeRows(BaseFilter):
    """Drop documents whose metadata column holds one of the listed values (``{column: [values]}``)."""

    name = "🚫 exclude rows"

    def __init__(self, exclude: dict[str, list[str]]):
        super().__init__()
        self.exclude = {column: set(values) for column, values in exclude.items()}

    def filter(self, doc) -> bool:
        return not any(doc.metadata.get(column) in values for column, values in self.exclude.items())


def excluded_rows(out: Path) -> int:
    """Rows ExcludeRows dropped, summed over the tasks' datatrove stats."""
    dropped = 0
    for path in (out / LOGS_DIR / "stats").glob("*.json"):
        for step in json.loads(path.read_text()):
            if step.get("name", "").endswith(ExcludeRows.name):
                stats = step.get("stats", {})
                dropped += int(stats.get("total", 0)) - int(stats.get("forwarded", 0))
    return dropped


class WriteManifest(PipelineStep):
    """Final 1-task step (SLURM): write manifest.json once every tokenization task finished."""

    name = "manifest"
    type = "📝 - WRITER"

    def __init__(self, out: str, tokenizer: dict, description: dict, tasks: int, holdout: float | int | None = None):
        super().__init__()
        self.out, self.tokenizer, self.description, self.tasks = out, tokenizer, description, tasks
        self.holdout = holdout

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        finish(Path(self.out), self.tokenizer, self.description, self.tasks, self.holdout)
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
    for done in (out / LOGS_DIR / "completions").glob("*"):
        done.unlink()
    key = ("--chat-key", description["chat_key"]) if description.get("chat_key") else \
        ("--text-key", description.get("text_key", "text"))
    columns = input_columns(description)
    has = f"its rows have the columns {columns}" if columns else "see the dataset's card for its columns"
    excluded = " (or --exclude dropped every row)" if description.get("exclude") else ""
    if description.get("pairs"):  # every row refused: say why, by reason
        from data.chat_tokenize import logged

        refused = dict(logged(out, PAIRS)[1])
        return EmptyTokenization(f"{description.get('spec', out)}: no pairs: rows refused: {refused or 'none'}"
                                 f"{excluded}; --pairs reads chosen/rejected message lists (and a prompt list or "
                                 f"string); {has}. Nothing was written to {out}/manifest.json")
    return EmptyTokenization(f"{description.get('spec', out)}: no documents: {key[0]} {key[1]!r} matched no "
                             f"text{excluded}; {has}. Nothing was written to {out}/manifest.json")


def finish(out: Path, tokenizer: dict, description: dict, tasks: int, holdout: float | int | None = None) -> dict:
    """Check every task finished, write manifest.json and, with ``holdout``, split off the held-out
    documents (data.holdout: after writing, by a hash of each document's ids)."""
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
    if description.get("chat_key"):  # conversations: template and refused ones (data.chat_tokenize)
        from data.chat_tokenize import chat_summary

        extra["chat"] = chat_summary(out, description.get("chat_template"), description["chat_key"])
    if description.get("pairs"):  # preference pairs: formats, template, refused rows (data.pairs_tokenize)
        from data.pairs_tokenize import pair_summary

        extra[PAIRS] = pair_summary(out, description.get("chat_template"), description.get("seq_len"))
    if decontamination := decont.summary(out):
        extra["decontamination"] = decontamination
    manifest = write_manifest(out, tokenizer, description, extra)
    if holdout:
        split(out, holdout)
        manifest = load_manifest(out)
    return manifest


def run(input_spec: str, out: str | Path, tokenizer: str | Path | None = None, text_key: str = "text",
        tasks: int = 1, workers: int = -1, split: str = "train", subset: str | None = None,
        limit: int = -1, streaming: bool = False, slurm: dict | None = None, manifest_only: bool = False,
        description: dict | None = None, chat_key: str | None = None,
        chat_template: str | None = None, hub: bool = False, revision: str | None = None,
        exclude: dict[str, list[str]] | None = None, pairs: bool = False, seq_len: int | None = None,
        holdout: float | int | None = None, decontaminate: list[str] | None = None,
        evalplus_data: str | None = None, core_bundle: str | None = None) -> dict | None:
    """Tokenize input_spec into out; returns the manifest (None when submitted to SLURM).
    ``holdout``: a fraction or a document count held out into ``out/heldout`` (data.holdout).
    ``hub``: input_spec is a ``datasets.load_dataset`` name (a Hub id, or a local dataset dir);
    ``description``: what the manifest records as the input (default: what was read);
    ``pairs``: preference pairs (data.pairs), refusing a pair with a side over ``seq_len`` tokens;
    ``decontaminate``: benchmarks whose n-grams drop documents (data.decontaminate)."""
    if pairs and chat_key:
        raise ValueError("give --pairs or --chat-key, not both (pairs are read from prompt/chosen/rejected)")
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
    if manifest_only:
        return finish(out, tokenizer_info(Tokenizer(tokenizer)), desc, tasks, holdout)
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
        pipeline = [make_reader(source, text_key, limit, streaming), tokenizer_step(tok_json, out, sp)]
    if exclude:
        pipeline.insert(1, ExcludeRows(exclude))
    if decontaminate:  # after the reader (and --exclude): datatrove's n-gram filter, drops counted per benchmark
        kind = "chat" if chat_key else "pairs" if pairs else None  # JSON documents: matched on their messages
        pipeline.insert(-1, decont.prepare(out, decontaminate, evalplus_data, core_bundle, kind))
    else:
        decont.check_rerun(out)
    if slurm is None:
        from datatrove.executor import LocalPipelineExecutor

        LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=str(out / LOGS_DIR)).run()
        return finish(out, tok_info, desc, tasks, holdout)
    from datatrove.executor import SlurmPipelineExecutor

    # sbatch exports the environment: make the venv's tools and this repo importable on the nodes.
    env = f"export PATH={Path(sys.executable).parent}:$PATH PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}"
    common = dict(partition=slurm["partition"], time=slurm["time"], qos=slurm.get("qos", ""), env_command=env,
                  mem_per_cpu_gb=slurm.get("mem_per_cpu", 2), sbatch_args=slurm.get("sbatch_args") or {})
    tok_exec = SlurmPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=str(out / LOGS_DIR),
                                     cpus_per_task=slurm.get("cpus", 1), job_name=f"tok_{out.name}", **common)
    SlurmPipelineExecutor([WriteManifest(str(out), tok_info, desc, tasks, holdout)], tasks=1, depends=tok_exec,
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
        if "holdout" in manifest:
            print(describe(Path(a.out), manifest["holdout"]))
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
    p.add_argument("--holdout", type=parse_holdout, help="hold out a fraction (0.001) or a number (2000) of the "
                   "documents into OUT/heldout, chosen by a hash of each document (data.holdout)")
    p.add_argument("--decontaminate", metavar="humaneval,mbpp[,core]",
                   help="drop documents sharing an n-gram with these benchmarks (data.decontaminate)")
    add_run_options(p)
    a = p.parse_args(argv)
    if a.pairs and a.chat_key:
        p.error("give --pairs or --chat-key, not both (pairs are read from prompt/chosen/rejected)")
    if a.seq_len is not None and not a.pairs:
        p.error("--seq-len is for --pairs")
    try:
        run_and_report(a, p, input_spec=a.input, tokenizer=a.tokenizer, text_key=a.text_key, split=a.split,
                       subset=a.subset, revision=a.revision, chat_key=a.chat_key, chat_template=a.chat_template,
                       exclude=parse_exclude(a.exclude, p), pairs=a.pairs, seq_len=a.seq_len, holdout=a.holdout,
                       decontaminate=decont.parse_benchmarks(a.decontaminate) if a.decontaminate else None)
    except (EmptyTokenization, FileNotFoundError, HoldoutError, decont.DecontaminationError) as e:
        p.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    # Re-import under the package name so WriteManifest pickles as data.tokenize.WriteManifest
    # (SLURM nodes import it), not as a __main__ class.
    from data.tokenize import main as _main

    _main()
