"""Build the bundled preference pairs for tiny DPO recipes: assets/preference/{pairs.jsonl,train,held_out}.

    python -m data.make_sample_pairs [--out assets/preference]

Pairs a ~2M-parameter model can learn to tell apart in a few CPU minutes: the
prompt asks to repeat a word or to add two small numbers; the chosen answer
does it (the word, or the sum), the rejected answer is one of a few fixed
refusals. Answers are a few tokens, so the preference signal is most of each
answer. Some prompts have a system message. Three deliberately bad pairs (the
same answer on both sides, an empty answer, a prompt over SEQ_LEN tokens) are
kept in the training file, so its manifest shows them counted and refused.
``pairs.jsonl`` is the raw source, one ``{"prompt", "chosen", "rejected"}``
line each (TRL's explicit form, ``data.tokenize --pairs``); every 10th pair
goes to ``held_out`` (the in-loop preference accuracy) instead of ``train``.
Tokenized with the tiny tokenizer and the llama2 template through
data.tokenize, like assets/chat; byte-identical when regenerated (nothing
here depends on the machine).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

from data.make_sample_data import tokenize_into_assets

SEQ_LEN = 128  # a side over this many tokens is refused; tiny DPO recipes train at this seq_len
WORDS = ["apple", "river", "stone", "cloud", "table", "green", "house", "light", "music", "ocean", "paper", "plant",
         "queen", "radio", "sugar", "tiger", "water", "bread", "chair", "dream", "earth", "field", "glass", "heart",
         "horse", "juice", "knife", "lemon", "money", "night", "onion", "piano", "robot", "sheep", "train", "uncle",
         "voice", "whale", "youth", "zebra", "candle", "forest", "garden", "island", "jacket", "kitten", "letter",
         "mirror", "number", "orange", "pencil", "rabbit", "silver", "ticket", "window", "yellow", "bottle", "castle",
         "doctor", "engine"]
ECHO = ["Repeat the word '{w}'.", "Say '{w}' and nothing else.", "Echo this word: {w}", "Please write {w}."]
SUM = "What is {a} + {b}?"
REFUSALS = ["I cannot say.", "No.", "I do not know."]  # the rejected answers: a fixed wrong pattern
SYSTEM = "Answer with one word or number."


def _turn(role: str, content: str) -> list[dict]:
    return [{"role": role, "content": content}]


def pairs() -> list[dict]:
    """Good pairs in a fixed, shuffled order (seeded): echo and sum prompts mixed."""
    asks = [(t.format(w=w), w) for w in WORDS for t in ECHO]
    asks += [(SUM.format(a=a, b=b), str(a + b)) for a in range(30) for b in range(30)]
    random.Random(0).shuffle(asks)
    out = []
    for i, (question, answer) in enumerate(asks):
        prompt = (_turn("system", SYSTEM) if i % 4 == 0 else []) + _turn("user", question)
        out.append({"prompt": prompt, "chosen": _turn("assistant", answer),
                    "rejected": _turn("assistant", REFUSALS[i % len(REFUSALS)])})
    return out


BAD = [
    {"prompt": _turn("user", "Repeat the word 'same'."), "chosen": _turn("assistant", "same"),
     "rejected": _turn("assistant", "same")},
    {"prompt": _turn("user", "Repeat the word 'empty'."), "chosen": _turn("assistant", "empty"),
     "rejected": _turn("assistant", "")},
    {"prompt": _turn("user", "Repeat these words: " + " ".join(WORDS * 2)), "chosen": _turn("assistant", "apple"),
     "rejected": _turn("assistant", "No.")},
]


def build(out: Path) -> dict:
    good = pairs()
    splits = {"train": [p for i, p in enumerate(good) if i % 10] + BAD, "held_out": good[::10]}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pairs.jsonl", "w") as f:
        for p in good + BAD:
            f.write(json.dumps(p) + "\n")
    manifests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, items in splits.items():
            raw = Path(tmp) / name
            raw.mkdir()
            with open(raw / "part0.jsonl", "w") as f:
                for i, p in enumerate(items):
                    f.write(json.dumps({"id": f"{name}/{i}", **p}) + "\n")
            dest = out / name
            shutil.rmtree(dest, ignore_errors=True)
            desc = {"kind": "sample_pairs", "source": name, "documents": len(items),
                    "contents": "repeat-a-word and add-two-numbers prompts; chosen: the answer, rejected: a refusal"
                                + ("; 3 deliberately bad pairs" if name == "train" else ""),
                    "regenerate": "python -m data.make_sample_pairs"}
            manifests[name] = tokenize_into_assets(raw, dest, desc, pairs=True, seq_len=SEQ_LEN)
    return manifests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("assets/preference"))
    a = p.parse_args()
    for name, m in build(a.out).items():
        print(f"{a.out / name}: {m['pairs']['pairs']} pairs, {m['num_tokens']:,} tokens, "
              f"refused: {m['pairs']['rejected'] or 'none'}")


if __name__ == "__main__":
    main()
