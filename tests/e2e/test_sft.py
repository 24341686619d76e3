"""SFT end to end on CPU: tiny-sft.toml from an HF export, exported again with the chat template;
transformers' apply_chat_template gives the ids the training shards hold, generation stops at the
end-of-turn token; the in-loop eval runs a 2-task EvalPlus subset at its steps, and eval.run scores the
export on the same instruct prompts alike."""

from __future__ import annotations

import json
import tomllib

import pytest
import torch
import torch.nn.functional as F

from rundir import REPO
from tests.conftest import losses, metrics, tiny_random_model, train

pytestmark = pytest.mark.slow

CHAT = REPO / "assets" / "chat"


def train_split() -> list[list[dict]]:
    """The good conversations of assets/chat/train, in shard order (data.make_sample_chat's split)."""
    from data.chat import BadConversation, check_conversation

    rows = [json.loads(line)["messages"] for line in (CHAT / "conversations.jsonl").read_text().splitlines()]
    good = []
    for m in rows:
        try:
            check_conversation(m)
            good.append(m)
        except BadConversation:
            pass
    return [c for i, c in enumerate(good) if i % 10]


def test_tiny_sft_export_chat_template_generation_and_evalplus(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    from data.mixture import Mixture, SourceSpec
    from data.shards import open_source
    from data.tokenizer import TINY_TOKENIZER
    from eval import run as eval_run
    from models.laneformer.hf.export import export_hf

    # Start from an HF export (as from an imported release) of a random tiny model: one training run.
    base = tmp_path / "base"
    model = tiny_random_model()
    export_hf(model.state_dict(), model.config, base, tokenizer_dir=TINY_TOKENIZER.parent)
    hf = tmp_path / "hf"
    # A HumanEval+ release file of 2 tasks for the in-loop EvalPlus subset (instruct prompts) and eval.run.
    tasks = [{"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "entry_point": "add",
              "canonical_solution": "    return a + b\n", "base_input": [[1, 2]], "plus_input": [[-1, 5]], "atol": 0},
             {"task_id": "HumanEval/1", "prompt": 'def neg(x):\n    """Return -x."""\n', "entry_point": "neg",
              "canonical_solution": "    return -x\n", "base_input": [[3]], "plus_input": [[0.5]], "atol": 0}]
    data = tmp_path / "HumanEvalPlus.jsonl"
    data.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    result = train("tiny-sft.toml", f"run.output_dir={tmp_path / 'sft'}", "training.steps=6", "logging.interval=1",
                   "schedule.warmup_steps=1", "eval.every=3", f"checkpoint.init_from={base}",
                   "checkpoint.export_hf=true", f"checkpoint.export_dir={hf}", "checkpoint.interval=6",
                   "eval.evalplus=humaneval", f"eval.evalplus_data={data}", "eval.evalplus_limit=2",
                   "eval.evalplus_chat=true", "eval.evalplus_max_new_tokens=8")
    assert result.returncode == 0, result.stderr[-3000:]
    # [data] chat_template unset: the run took the template its initial checkpoint carries, and says so.
    assert tomllib.loads((tmp_path / "sft" / "recipe.toml").read_text())["data"]["chat_template"] == \
        str(base / "tokenizer_config.json")
    values = losses(tmp_path / "sft")
    # Step 1's loss is the base model's mean cross-entropy over the answers' tokens of the first batch
    # (the mixture as the recipe builds it), with the prompt and markup labels ignored.
    recipe = tomllib.loads((REPO / "recipes" / "tiny-sft.toml").read_text())
    mix = Mixture([SourceSpec(**{**x, "path": REPO / x["path"]}) for x in recipe["data"]["sources"]],
                  seq_len=128, seed=recipe["run"]["seed"])
    batch = mix.batch(range(16))
    with torch.no_grad():
        logits = model(torch.from_numpy(batch["input_ids"]), positions=torch.from_numpy(batch["positions"]))
    labels = torch.from_numpy(batch["labels"]).flatten()
    masked = F.cross_entropy(logits.flatten(0, 1).float(), labels).item()  # ignore_index -100: the masked labels
    assert (labels == -100).sum() > 100 and values[1] == pytest.approx(masked, rel=1e-4)
    assert sorted(values) == list(range(1, 7)) and all(v == v and v < 20 for v in values.values())
    # The in-loop eval at steps 3 and 6: validation loss and the EvalPlus subset, logged and written, no errors.
    logged = metrics(tmp_path / "sft")
    for step in (3, 6):
        written = json.loads((tmp_path / "sft" / "evals" / f"step-{step}.json").read_text())
        assert written["errors"] == [] and written["step"] == step
        for key in ("eval/val_loss", "humaneval/pass@1", "humaneval+/pass@1"):
            assert logged[step][key] == written["metrics"][key]
        # pass@1 over 2 tasks: 0, 1/2 or 1; plus passes only where base passes.
        assert written["metrics"]["humaneval/pass@1"] in (0.0, 0.5, 1.0)
        assert written["metrics"]["humaneval+/pass@1"] in (0.0, 0.5, 1.0)
        assert written["metrics"]["humaneval+/pass@1"] <= written["metrics"]["humaneval/pass@1"]

    # The export carries the template; transformers renders the training shards' ids.
    tok = AutoTokenizer.from_pretrained(str(hf))
    assert tok.chat_template
    (shard,) = open_source(CHAT / "train").shards
    for d, conv in enumerate(train_split()[:5]):
        assert tok.apply_chat_template(conv)["input_ids"] == shard.document(d).tolist()

    # Generation stops at the end-of-turn token that generation_config.json names (</s>).
    model = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True, dtype=torch.float32)
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What does `textwrap.dedent` do?"}],
                                     add_generation_prompt=True, return_tensors="pt")["input_ids"]

    class EndTurnAfter(LogitsProcessor):  # the model "answers" 3 tokens, then ends its turn
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - prompt.shape[1] == 3:
                scores = torch.full_like(scores, -torch.inf)
                scores[:, 2] = 0.0
            return scores

    out = model.generate(prompt, max_new_tokens=20, do_sample=False, logits_processor=[EndTurnAfter()])
    assert out.shape[1] == prompt.shape[1] + 4 and out[0, -1].item() == 2

    # eval.run --evalplus on the export, instruct prompts through its chat template: the same scores as the
    # in-loop eval after the last step (same weights, tasks, prompt ids and generation limit).
    report = eval_run.main(["--checkpoint", str(hf), "--evalplus", "humaneval", "--evalplus-data", str(data),
                            "--chat", "--limit", "2", "--max-new-tokens", "8", "--device", "cpu"])
    assert report["metrics"] == {k: logged[6][k] for k in ("humaneval/pass@1", "humaneval+/pass@1")}
    assert report["evalplus"]["chat"] is True and set(report["evalplus"]["solutions"]) == {"HumanEval/0", "HumanEval/1"}
    # The run's own checkpoint, as the loop scores it (native weights, tokenizer and the run's template):
    # the same scores, from the very same generated text as on the export (so not merely 0 == 0).
    native = eval_run.main(["--checkpoint", str(tmp_path / "sft"), "--evalplus", "humaneval", "--evalplus-data",
                            str(data), "--chat", "--limit", "2", "--max-new-tokens", "8", "--device", "cpu"])
    assert native["metrics"] == report["metrics"]
    assert native["evalplus"]["raw"] == report["evalplus"]["raw"]
    assert all(all(r) for r in report["evalplus"]["raw"].values())
