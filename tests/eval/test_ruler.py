"""RULER through lm-eval 0.4.13's own ``ruler`` tasks, offline, by ``eval.run --lm-eval``.

RULER's synthetic tasks make their samples at run time (lm_eval/tasks/ruler/niah_utils.py,
fwe_utils.py), sized with ``AutoTokenizer.from_pretrained(metadata["tokenizer"])``
(common_utils.py:44-55) to each of ``metadata["max_seq_lengths"]``. Here they run on the tiny
random model of test_eval_harness.py: ``eval.run`` on its DCP checkpoint must give the numbers,
the prompts and the generated text of lm-eval's own HFLM on its export; a model that scores 0
makes equal numbers cheap, so the responses are compared too, and an oracle that reads the
needle shows that the scores are not 0 by construction.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from tests.requires import require

require("wonderwords", "RULER's tasks need lm-eval's ruler extra (lm-eval[ruler]: wonderwords, nltk)")

import eval.lm_harness as harness  # noqa: E402
from eval.lm_harness import LaneformerLM, load_task_file, run_lm_eval  # noqa: E402
from rundir import REPO  # noqa: E402
from tests.eval.test_eval_harness import exported  # noqa: F401, E402  (the fixture: a tiny model, DCP and export)

TOKENIZER = REPO / "assets" / "tokenizer"
TASKS = ["niah_single_1", "ruler_fwe"]  # a needle task (repeat haystack) and another synthetic one
LENGTHS = [256, 512]  # ruler_vt needs >= 1024 (vt_utils.py:175-194 loops forever below that), cwe ~2048


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def ruler_dir() -> str:
    import lm_eval.tasks

    return str(Path(lm_eval.tasks.__file__).parent / "ruler")


def write_ruler(tmp_path: Path, lengths: list[int], tasks: list[str] = TASKS) -> Path:
    path = tmp_path / "ruler.yaml"
    path.write_text(json.dumps({"tasks": tasks, "metadata": {"max_seq_lengths": lengths}}))  # JSON is YAML
    return path


def hflm_reference(hf_dir: Path, tasks: list[str], lengths: list[int], limit: int) -> tuple[dict, dict]:
    """What lm-eval's own CLI does per length, ``lm_eval --model hf --model_args pretrained=HF_DIR,
    trust_remote_code=True,dtype=float32,max_length=1024,batch_size=1 --tasks ... --metadata
    '{"max_seq_lengths": [L]}' --limit N`` (the CLI merges model_args into the metadata, evaluator.py:292-299,
    so RULER sizes with ``pretrained``); the task index narrowed to RULER's folder."""
    require("accelerate", "lm-eval's HFLM needs lm-eval's hf extra (lm-eval[hf]: accelerate)")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), trust_remote_code=True, dtype="float32", device="cpu", batch_size=1,
              max_length=1024)
    results, samples = {}, {}
    for length in lengths:
        meta = {"pretrained": str(hf_dir), "max_seq_lengths": [length]}
        out = simple_evaluate(model=lm, tasks=tasks, limit=limit, bootstrap_iters=0, log_samples=True,
                              task_manager=TaskManager(include_defaults=False, include_path=ruler_dir(), metadata=meta))
        for task in tasks:
            results[(task, length)] = out["results"][task][f"{length},none"]
            samples.setdefault(task, []).extend(out["samples"][task])
    return results, samples


def seen(samples: dict) -> dict:
    """Per task, what each sample was and got: its document, the request, the raw and filtered responses."""
    return {task: [(s["doc"]["max_length"], s["doc"]["input"], s["doc"]["outputs"], s["arguments"], s["resps"],
                    s["filtered_resps"]) for s in logged] for task, logged in samples.items()}


def test_ruler_by_eval_run_equals_hflm_on_the_export(exported, tmp_path, monkeypatch):  # noqa: F811
    from eval.run import main

    _, step, hf_dir = exported
    logged: dict = {}  # the samples of the very run eval.run makes (suite.run_evals -> run_lm_eval)
    monkeypatch.setattr(harness, "run_lm_eval", functools.partial(run_lm_eval, samples=logged))
    out = main(["--checkpoint", str(step.parent.parent), "--tokenizer", str(TOKENIZER),
                "--lm-eval", str(write_ruler(tmp_path, LENGTHS)), "--limit", "2"])
    ours = {k: v for k, v in out["metrics"].items() if k.startswith("lm_eval/")}
    assert {f"lm_eval/{t}/{n}" for t in TASKS for n in LENGTHS} <= set(ours)
    assert not any(k.endswith("/4096") for k in ours)  # RULER's -1 for "no sample at 4096" is not a score

    theirs, reference = hflm_reference(hf_dir, TASKS, LENGTHS, limit=2)
    assert {(t, n): ours[f"lm_eval/{t}/{n}"] for (t, n) in theirs} == theirs
    mine, ref = seen(logged), seen(reference)
    assert [len(mine[t]) for t in TASKS] == [2 * len(LENGTHS)] * len(TASKS)
    for task in TASKS:
        assert sorted({s[0] for s in mine[task]}) == LENGTHS  # each length got its own samples
        for sample in mine[task]:
            length, prompt, answers, (request,), (raw,), filtered = sample
            assert all(a in prompt for a in answers)  # RULER's own sample: its answers are in the text
            assert request[0].startswith(prompt) and len(raw[0]) > 0  # it generated something
        assert mine[task] == ref[task]  # the same prompts, the same generated text, token for token


class Oracle(LaneformerLM):
    """Answers a needle question from the prompt (or, ``wrong``, with nothing): RULER's scoring, run by
    run_lm_eval, must give 1 and 0, so the equality above is not one of zeros by construction."""

    def __init__(self, tokenizer, max_seq_len: int, wrong: bool = False):
        super().__init__(None, tokenizer, max_seq_len=max_seq_len)
        self.wrong = wrong

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context = req.args[0]
            key = re.search(r"The special magic \w+ for (.+?) mentioned in the provided text is$", context)[1]
            out.append("" if self.wrong else " " + re.search(rf"for {re.escape(key)} is: (\S+)\.", context)[1])
        return out


@pytest.mark.parametrize("alone", [False, True], ids=["with-hf-files", "tokenizer.model-alone"])
def test_ruler_scores_by_length_and_sizes_with_the_checkpoints_tokenizer(tmp_path, alone):
    """The tokenizer's folder, when it holds Hugging Face tokenizer files (an export's, assets/tokenizer), else
    (a run's tokenizer.model fetched alone) the files data.hf_tokenizer makes of it."""
    import shutil

    from data.tokenizer import open_tokenizer
    from eval.lm_harness import task_metadata

    if alone:
        (tmp_path / "tok").mkdir()
        shutil.copy(TOKENIZER / "tokenizer.model", tmp_path / "tok")
    tokenizer = open_tokenizer(tmp_path / "tok" if alone else TOKENIZER)
    tasks = load_task_file(write_ruler(tmp_path, LENGTHS, ["niah_single_1"]))
    sizing = Path(task_metadata(tasks, 1024, tokenizer)["tokenizer"])
    assert (sizing == TOKENIZER) != alone and (sizing / "tokenizer.json").is_file()
    samples: dict = {}
    results = run_lm_eval(Oracle(tokenizer, 1024), tasks, limit=3, samples=samples)["niah_single_1"]
    assert {k: v for k, v in results.items() if k[0].isdigit()} == {
        "256,none": 1.0, "256_stderr,none": "N/A", "512,none": 1.0, "512_stderr,none": "N/A"}
    assert results["sample_len"] == 6
    for s in samples["niah_single_1"]:  # sized by the checkpoint's own tokenizer (the metadata's default), with
        doc = s["doc"]  # 128 tokens left for the answer (prepare_niah.py:317-318)
        assert doc["length"] == len(tokenizer.encode(doc["input"], bos=True)) + 128 <= doc["max_length"]
    wrong = run_lm_eval(Oracle(tokenizer, 1024, wrong=True), tasks, limit=3)["niah_single_1"]
    assert (wrong["256,none"], wrong["512,none"]) == (0.0, 0.0)


def test_lengths_default_and_bad_input(exported, tmp_path, capsys):  # noqa: F811
    from eval.lm_harness import check_lengths, task_metadata
    from eval.run import main

    _, _, hf_dir = exported
    names = load_task_file("niah_single_1,ruler_fwe")  # a comma list in place of a file
    assert list(names) == TASKS and names.metadata == {}
    from data.tokenizer import open_tokenizer

    assert task_metadata(names, 1024, open_tokenizer(hf_dir)) == {"max_seq_lengths": [1024], "tokenizer": str(hf_dir)}
    assert check_lengths(load_task_file(write_ruler(tmp_path, [512, 2048])), 1024) != []
    with pytest.raises(SystemExit) as e:  # a length beyond the model: exit 2, named
        main(["--checkpoint", str(hf_dir), "--lm-eval", str(write_ruler(tmp_path, [512, 2048]))])
    assert e.value.code == 2 and "[2048] exceed the checkpoint's max_seq_len 1024" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a task lm-eval does not have: exit 2 before the model loads
        main(["--checkpoint", str(hf_dir), "--lm-eval", "niah_single_9"])
    assert e.value.code == 2 and "niah_single_9" in capsys.readouterr().err


# --- RULER's downloads, read from local copies (metadata ruler_files) ---

QUESTIONS = 500  # RULER's QA tasks make 500 samples of the first 500 questions (qa_utils.get_dataset)


def write_downloads(folder: Path) -> dict[str, str]:
    """Small stand-ins, in the published formats, for what RULER downloads: SQuAD 2.0's dev-v2.0.json,
    HotpotQA's hotpot_dev_distractor_v1.json, the Paul Graham essays (their ``text`` column, as jsonl)."""
    folder.mkdir()
    squad = {"data": [{"paragraphs": [{"context": f"The secret code of item {k} is C{k:04d}.", "qas": [
        {"question": f"What is the secret code of item {k}?", "answers": [{"text": f"C{k:04d}"}],
         "is_impossible": False}]}]} for k in range(QUESTIONS)]}
    hotpot = [{"question": f"Which town keeps archive {k}?", "answer": f"Town{k}",
               "context": [[f"Archive {k}", [f"Archive {k} is kept ", f"in Town{k}."]], [f"Filler {k}", ["Nothing."]]]}
              for k in range(QUESTIONS)]
    essays = [{"text": " ".join(f"Essay {e} sentence {i} tells of the quiet river." for i in range(300))}
              for e in range(3)]
    (folder / "dev-v2.0.json").write_text(json.dumps(squad))
    (folder / "hotpot_dev_distractor_v1.json").write_text(json.dumps(hotpot))
    (folder / "essays.jsonl").write_text("\n".join(map(json.dumps, essays)))
    return {"squad": "dev-v2.0.json", "hotpotqa": "hotpot_dev_distractor_v1.json", "essays": "essays.jsonl"}


class QAOracle(LaneformerLM):
    """Answers the question of a RULER QA prompt with the answer of the local file that asked it (or with
    nothing, ``wrong``): a score of 1 says that the samples were made of those files."""

    def __init__(self, tokenizer, answers: dict[str, str], wrong: bool = False):
        super().__init__(None, tokenizer, max_seq_len=1024)
        self.answers, self.wrong = answers, wrong

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        questions = [re.search(r"Question: (.+?)\s*Answer:\s*$", r.args[0], re.S)[1] for r in requests]
        return ["" if self.wrong else " " + self.answers[q] for q in questions]


def test_ruler_reads_local_copies_of_what_it_downloads(tmp_path, monkeypatch):
    """Offline (no Hub, no network), the seven RULER tasks that download run on the task file's
    ruler_files: SQuAD and HotpotQA for the QA tasks, the essays (split into sentences with NLTK's
    punkt_tab, here empty parameter files under NLTK_DATA's path) for the essay haystacks."""
    import nltk
    from lm_eval.tasks._yaml_loader import _load_module_with_cache

    from data.tokenizer import open_tokenizer

    punkt = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    punkt.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (punkt / name).write_text("")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data"), *nltk.data.path])
    files = write_downloads(tmp_path / "downloads")
    path = tmp_path / "ruler.json"
    path.write_text(json.dumps({"tasks": ["ruler_qa_squad", "ruler_qa_hotpot"],
                                "metadata": {"max_seq_lengths": [512], "ruler_files": {
                                    k: f"downloads/{v}" for k, v in files.items()}}}))  # relative to the task file
    tasks = load_task_file(path)
    assert tasks.metadata["ruler_files"]["squad"] == str(tmp_path / "downloads" / files["squad"])
    tokenizer = open_tokenizer(TOKENIZER)
    answers = {f"What is the secret code of item {k}?": f"C{k:04d}" for k in range(QUESTIONS)}
    answers |= {f"Which town keeps archive {k}?": f"Town{k}" for k in range(QUESTIONS)}
    samples: dict = {}
    right = run_lm_eval(QAOracle(tokenizer, answers), tasks, limit=2, samples=samples)
    assert {t: r["512,none"] for t, r in right.items()} == {"ruler_qa_squad": 1.0, "ruler_qa_hotpot": 1.0}
    assert all("The secret code of item" in s["doc"]["input"] for s in samples["ruler_qa_squad"])
    wrong = run_lm_eval(QAOracle(tokenizer, answers, wrong=True), tasks, limit=2)
    assert {t: r["512,none"] for t, r in wrong.items()} == {"ruler_qa_squad": 0.0, "ruler_qa_hotpot": 0.0}
    qa = _load_module_with_cache(Path(ruler_dir()) / "qa_utils.py")
    assert qa.download_json.__module__ == qa.__name__  # lm-eval's own again, once the run is over

    tasks = load_task_file(write_ruler(tmp_path, [2048], ["niah_single_2"]))  # essays come in 500 words
    tasks.metadata["ruler_files"] = {"essays": str(tmp_path / "downloads" / files["essays"])}
    samples = {}
    essay = run_lm_eval(Oracle(tokenizer, 2048), tasks, limit=2, samples=samples)["niah_single_2"]
    assert essay["2048,none"] == 1.0
    for s in samples["niah_single_2"]:  # the essays' sentences, as NLTK split them, around the needle
        assert s["doc"]["input"].count("tells of the quiet river.") > 20


def test_ruler_files_bad_input(tmp_path):
    path = tmp_path / "ruler.json"
    for files, message in [({"squad": "nope.json"}, f"ruler_files: no such file: squad: {tmp_path / 'nope.json'}"),
                           ({"wiki": "x.json"}, "ruler_files: expected a mapping of essays, squad, hotpotqa to files")]:
        path.write_text(json.dumps({"tasks": ["ruler_qa_squad"], "metadata": {"ruler_files": files}}))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_task_file(path)


def test_eval_run_takes_a_comma_list_at_the_checkpoint_s_length(exported, capsys):  # noqa: F811
    """``--lm-eval niah_single_1,ruler_fwe``, no task file: RULER at the checkpoint's max_seq_len (here a DCP
    checkpoint's, set to 256 by --set), sized with its tokenizer."""
    from eval.run import main

    _, step, _ = exported
    out = main(["--checkpoint", str(step), "--tokenizer", str(TOKENIZER), "--set", "max_seq_len=256",
                "--lm-eval", "niah_single_1,ruler_fwe", "--limit", "1"])
    assert {k for k in out["metrics"] if k[-1].isdigit()} == {"lm_eval/niah_single_1/256", "lm_eval/ruler_fwe/256"}
    assert out["lm_eval"]["niah_single_1"]["sample_len"] == 1
