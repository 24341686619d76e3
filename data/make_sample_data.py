"""Build the bundled sample dataset for tiny CPU recipes: assets/sample_data/{prose,code} (and their held_out/).

    python -m data.make_sample_data [--out assets/sample_data] [--code-bytes 1500000]

Two sources from data.sample_corpus (prose: license texts and Python doc
topics; code: CPython stdlib modules), tokenized with the tiny tokenizer
through the same datatrove pipeline as real data (data.tokenize, 2 tasks each), each
holding out ``HELD_OUT`` of its documents into ``held_out/`` (data.held_out), as the tiny
recipes' ``[data] held_out`` says. About 1.5 MB in all. The datatrove logs are removed afterwards: they hold
machine-specific paths and timestamps and are not needed to read the shards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from data import tokenize
from data.shards import LOGS_DIR
from data.sample_corpus import code_documents, prose_documents
from data.tokenizer import TINY_TOKENIZER

CODE_BYTES = 1_500_000  # of stdlib text in the code source (--code-bytes); data.make_passkey's long source starts after
MAX_FILE_BYTES = 40_000  # a stdlib file of more text is skipped
SOURCES = {
    "prose": ("license texts (/usr/share/common-licenses) and pydoc_data topics", lambda a: prose_documents()),
    "code": ("CPython standard library modules, sorted by path",
             lambda a: code_documents(a.code_bytes, max_file_bytes=MAX_FILE_BYTES)),
}
HELD_OUT = 0.1  # of each source's documents: ~9 of prose's 93, ~15 of code's 140 (recipes/tiny*.toml's [data] held_out)


def write_jsonl(folder: Path, rows: list[dict], tasks: int) -> None:
    """``rows`` into ``folder/part<i>.jsonl``, one file per data.tokenize task (JsonlReader splits by file)."""
    folder.mkdir()
    for part in range(tasks):
        with open(folder / f"part{part}.jsonl", "w") as f:
            for row in rows[part::tasks]:
                f.write(json.dumps(row) + "\n")


def build(out: Path, code_bytes: int = CODE_BYTES, tasks: int = 2) -> dict:
    manifests = {}
    args = argparse.Namespace(code_bytes=code_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (what, documents) in SOURCES.items():
            docs = documents(args)
            raw = Path(tmp) / name
            write_jsonl(raw, [{"id": doc_id, "text": text} for doc_id, text in docs], tasks)
            dest = out / name
            shutil.rmtree(dest, ignore_errors=True)
            desc = {"kind": "sample_corpus", "source": name, "contents": what, "documents": len(docs),
                    "regenerate": "python -m data.make_sample_data"}
            manifests[name] = tokenize_into_assets(raw, dest, desc, tasks=tasks, held_out=HELD_OUT)
    return manifests


def tokenize_into_assets(raw: Path, dest: Path, description: dict, **kwargs) -> dict:
    """``data.tokenize`` into a bundled folder: no logs, and metadata naming the bundled tokenizer.json."""
    manifest = tokenize.run(str(raw), dest, TINY_TOKENIZER, description=description, **kwargs)
    shutil.rmtree(dest / LOGS_DIR)
    for meta in dest.rglob("*.ds.metadata"):  # first line names the (deleted) logs/tokenizer.json
        lines = meta.read_text().split("\n")
        meta.write_text("\n".join(["assets/tokenizer/tokenizer.json|" + lines[0].rsplit("|", 1)[1]] + lines[1:]))
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("assets/sample_data"))
    p.add_argument("--code-bytes", type=int, default=CODE_BYTES)
    a = p.parse_args()
    for name, m in build(a.out, a.code_bytes).items():
        print(f"{a.out / name}: {m['num_documents']} documents, {m['num_tokens']:,} tokens; held out: "
              f"{m['held_out']['documents']} documents, {m['held_out']['tokens']:,} tokens")


if __name__ == "__main__":
    main()
