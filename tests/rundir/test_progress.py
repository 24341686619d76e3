"""Progress on stderr for long commands (rundir.progress): a bar on a terminal, a line every few
percent in a log; and the commands that use it: CORE and lm-eval items, safetensors tensors,
Hub uploads."""

from __future__ import annotations

import io
import re

import huggingface_hub
import torch

from eval.core import score_task
from eval.core_data import CoreTask
from eval.lm_harness import LaneformerLM
from models.laneformer.hf.safetensors_io import read_weights, write_weights
from models.laneformer.push import push
from rundir.progress import progress
from tests.eval.conftest import PROBS, TOY, WORDS, Bigram, WordTokenizer

LINE = re.compile(r"(?P<desc>.*): +(?P<pct>\d+)% (?P<n>\d+)/(?P<total>\d+) \[")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(text: str) -> list[dict]:
    return [m.groupdict() for m in map(LINE.match, text.splitlines()) if m]


def test_a_log_gets_a_line_every_five_percent_with_counts_and_eta():
    log = io.StringIO()
    with progress(total=200, desc="items", unit="item", file=log) as bar:
        for _ in range(200):
            bar.update()
    got = lines(log.getvalue())
    assert "\r" not in log.getvalue()
    assert [int(g["n"]) for g in got] == list(range(10, 201, 10))  # 5% of 200, each line once
    assert got[-1] == {"desc": "items", "pct": "100", "n": "200", "total": "200"}
    assert all("<" in line for line in log.getvalue().splitlines())  # tqdm's elapsed<remaining


def test_an_iterable_counts_itself_and_an_early_end_still_reports():
    log = io.StringIO()
    assert list(progress(range(7), desc="seven", file=log)) == list(range(7))
    assert lines(log.getvalue())[-1]["n"] == "7"
    log = io.StringIO()
    with progress(total=1000, desc="cut", file=log) as bar:
        bar.update(3)  # under 5%: no line until the end
        assert log.getvalue() == ""
    assert lines(log.getvalue()) == [{"desc": "cut", "pct": "0", "n": "3", "total": "1000"}]


def test_a_terminal_gets_tqdms_bar_and_disabled_shows_nothing():
    tty = Terminal()
    with progress(total=4, desc="bar", file=tty) as bar:
        bar.update(4)
    assert "\r" in tty.getvalue() and "4/4" in tty.getvalue()
    quiet = io.StringIO()
    with progress(total=4, desc="off", file=quiet, disable=True) as bar:
        bar.update(4)
    assert quiet.getvalue() == ""


def test_core_reports_items_of_each_task(capsys):
    tok = WordTokenizer(WORDS)
    task = CoreTask(label="toy", type="multiple_choice", shots=0, delimiter=" ", file="toy.jsonl",
                    baselines={"v1": 0.25, "v2": 0.5})
    items = TOY["multiple_choice"]
    score_task(Bigram(tok, PROBS), tok, task, items, max_seq_len=None, show="CORE toy")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert lines(captured.err)[-1] == {"desc": "CORE toy", "pct": "100", "n": str(len(items)),
                                       "total": str(len(items))}
    score_task(Bigram(tok, PROBS), tok, task, items, max_seq_len=None)  # no label: silent (other ranks)
    assert capsys.readouterr().err == ""


def test_lm_eval_reports_requests(capsys):
    from lm_eval.api.instance import Instance

    tok = WordTokenizer(WORDS)
    lm = LaneformerLM(Bigram(tok, PROBS), tok, max_seq_len=16, batch_size=2)
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("the sky is", w), idx=0)
            for w in (" blue", " red", " dark red")]
    lm.loglikelihood(reqs)
    assert lines(capsys.readouterr().err)[-1] == {"desc": "lm-eval loglikelihood", "pct": "100", "n": "3",
                                                  "total": "3"}


def test_safetensors_report_tensors_written_and_read(tmp_path, capsys):
    tensors = {f"w{i}": torch.full((4, 4), float(i)) for i in range(6)}
    write_weights(tensors, tmp_path, max_shard_bytes=3 * 64)  # 64 bytes each: two shards of three
    err = capsys.readouterr().err
    assert [(g["desc"], g["n"]) for g in lines(err)] == [("tensors written", "3"), ("tensors written", "6")]
    back, _ = read_weights(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert [(g["desc"], g["n"]) for g in lines(capsys.readouterr().err)] == [("tensors read", "3"),
                                                                             ("tensors read", "6")]


def test_push_reports_files_uploaded(tmp_path, monkeypatch, capsys):
    class Api:  # stands in for the Hub
        def __init__(self, token=None):
            pass

        def create_repo(self, *a, **k):
            pass

        def upload_file(self, **k):
            pass

    for name in ("model.safetensors", "README.md", "config.json"):
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    push(tmp_path, "org/name")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert lines(captured.err)[-1] == {"desc": "files uploaded", "pct": "100", "n": "3", "total": "3"}
