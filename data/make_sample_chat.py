"""Build the bundled chat source for tiny SFT recipes: assets/chat/{conversations.jsonl,train,held_out}.

    python -m data.make_sample_chat [--out assets/chat]

Conversations made from what every machine has (no Hub): questions about
functions of the running interpreter's standard library, answered with their
documentation's first paragraph or, for pure-Python ones, their source code;
and requests to explain a Python documentation topic (pydoc_data). Some have
a system prompt, some a second turn. A few deliberately bad conversations
(an unknown role, an empty answer, no answer) are kept in the training file,
so its manifest shows them counted and refused. ``conversations.jsonl`` is
the raw source (``--chat-key messages``); every 10th conversation goes to
``held_out`` (validation loss) instead of ``train``. Tokenized with the tiny
tokenizer through data.tokenize, like assets/sample_data; byte-identical
when regenerated with the same Python version, in a fresh process: importing
torch (torch.package) replaces ``inspect.getfile``, which would drop its
conversation (tests/data/test_chat.py checks the bundled copy this way).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import shutil
import tempfile
from pathlib import Path

from data.make_sample_data import tokenize_into_assets

MODULES = ["ast", "base64", "bisect", "calendar", "codecs", "colorsys", "copy", "dataclasses", "difflib", "fnmatch",
           "fractions", "glob", "heapq", "inspect", "ipaddress", "json", "locale", "mimetypes", "quopri", "shutil",
           "html", "keyword", "posixpath", "shlex", "statistics", "string", "textwrap", "urllib.parse"]
SYSTEM = "You are a concise assistant for Python programmers."
BAD = [
    [{"role": "user", "content": "Hello?"}, {"role": "robot", "content": "Beep."}],
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": ""}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Nobody answers this one."}],
]


def _first_paragraph(doc: str) -> str:
    return inspect.cleandoc(doc).split("\n\n")[0].strip()


def conversations() -> list[list[dict]]:
    """Good conversations in a fixed order."""
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            fn = getattr(module, attr)
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__ or not fn.__doc__:
                continue
            q = f"What does `{name}.{attr}` do?"
            turns = [{"role": "user", "content": q}, {"role": "assistant", "content": _first_paragraph(fn.__doc__)}]
            try:
                source = inspect.getsource(fn)
            except OSError:  # defined by exec (e.g. namedtuple helpers)
                source = ""
            if 0 < len(source) < 1500:
                turns += [{"role": "user", "content": "Show me its source code."},
                          {"role": "assistant", "content": f"```python\n{source.rstrip()}\n```"}]
            if len(out) % 3 == 0:
                turns.insert(0, {"role": "system", "content": SYSTEM})
            out.append(turns)
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        text = _first_paragraph(topics[topic])
        if 40 < len(text) < 1500:
            out.append([{"role": "user", "content": f"Explain the Python documentation topic '{topic}'."},
                        {"role": "assistant", "content": text}])
    return out


def build(out: Path) -> dict:
    convs = conversations()
    splits = {"train": [c for i, c in enumerate(convs) if i % 10], "held_out": convs[::10]}
    splits["train"] += BAD
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "conversations.jsonl", "w") as f:
        for i, c in enumerate(convs + BAD):
            f.write(json.dumps({"id": f"sample_chat/{i}", "messages": c}) + "\n")
    manifests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, items in splits.items():
            raw = Path(tmp) / name
            raw.mkdir()
            with open(raw / "part0.jsonl", "w") as f:
                for i, c in enumerate(items):
                    f.write(json.dumps({"id": f"{name}/{i}", "messages": c}) + "\n")
            dest = out / name
            shutil.rmtree(dest, ignore_errors=True)
            desc = {"kind": "sample_chat", "source": name, "documents": len(items),
                    "contents": "stdlib function docs and sources, pydoc topics, as conversations"
                                + ("; 3 deliberately bad ones" if name == "train" else ""),
                    "chat_key": "messages", "chat_template": None, "regenerate": "python -m data.make_sample_chat"}
            manifests[name] = tokenize_into_assets(raw, dest, desc, chat_key="messages")
    return manifests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("assets/chat"))
    a = p.parse_args()
    for name, m in build(a.out).items():
        print(f"{a.out / name}: {m['num_documents']} conversations, {m['num_tokens']:,} tokens, "
              f"refused: {m['chat']['rejected'] or 'none'}")


if __name__ == "__main__":
    main()
