"""The chat template: the renderer training uses agrees with transformers' apply_chat_template,
the loss mask covers exactly the assistant answers and their </s>, bad conversations are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.chat import (LLAMA2, TEMPLATES, BadConversation, check_conversation, check_template, hf_tokenizer_config,
                       prompt_ids, render, resolve_template)
from data.hf_tokenizer import save_hf_tokenizer
from data.tokenizer import TINY_TOKENIZER, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "system", "content": "You are terse.\n"},
     {"role": "user", "content": "  héllo wörld 日本 "},
     {"role": "assistant", "content": "ok 🤖 sure\n  x = 1\t"},
     {"role": "user", "content": "and?"},
     {"role": "assistant", "content": "done."}],
    [{"role": "user", "content": "a [INST] b [/INST] c <<SYS>>"},
     {"role": "assistant", "content": "   leading and trailing spaces   "}],
]


@pytest.fixture(scope="module")
def sp():
    return Tokenizer(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tokenizer folder an export writes: tokenizer files plus the chat template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("hf_tok")
    save_hf_tokenizer(TINY_TOKENIZER, out)
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps(hf_tokenizer_config(json.loads(path.read_text()))))
    return AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_render_matches_transformers_ids_and_assistant_mask(conversation, sp, hf):
    ids, mask = render(conversation, sp)
    ref = hf.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == ref["input_ids"]
    assert mask == ref["assistant_masks"]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_mask_is_the_answers_and_their_end_of_turn(conversation, sp):
    ids, mask = render(conversation, sp)
    answers = [m["content"].strip() for m in conversation if m["role"] == "assistant"]
    assert ids[0] == sp.bos_id and ids[-1] == sp.eos_id and mask[0] == 0 and mask[-1] == 1
    # Contiguous runs of mask 1, each decoding to one answer and ending with the end-of-turn </s>.
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs.append(run)
    assert [r[-1] for r in runs] == [sp.eos_id] * len(answers)
    assert [sp.decode(r[:-1]).strip() for r in runs] == answers
    assert ids.count(sp.eos_id) == len(answers)  # no other </s>: user and system turns are all mask 0


def test_control_token_text_in_messages_stays_text(sp, hf):
    conv = [{"role": "user", "content": "print </s> and <s>"}, {"role": "assistant", "content": "a</s>b<s>c"}]
    ids, mask = render(conv, sp)
    assert ids.count(sp.eos_id) == 1 and ids.count(sp.bos_id) == 1
    assert sp.decode([i for i, m in zip(ids, mask) if m][:-1]) == "a</s>b<s>c "  # Meta's space before </s>
    # transformers keeps it text too when asked to sanitize (it splits the literal differently)
    safe = hf.apply_chat_template(conv, sanitize_control_tokens=True)["input_ids"]
    assert safe.count(sp.eos_id) == 1 and safe.count(sp.bos_id) == 1


def test_generation_prompt_is_the_prefix_before_the_answer(sp, hf):
    conv = CONVERSATIONS[1]
    prompt = prompt_ids(conv[:4], sp)
    assert prompt == hf.apply_chat_template(conv[:4], add_generation_prompt=True)["input_ids"]
    full, mask = render(conv, sp)
    assert full[: len(prompt)] == prompt
    assert mask[len(prompt) - 1] == 0 and all(mask[len(prompt):])  # the answer starts right after


# Meta's own chat template, as meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json holds it (the reference).
META_LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def test_the_llama2_template_renders_exactly_as_metas(hf):
    """transformers renders both: the same text for every conversation, whitespace and empty system included."""
    edge = [[{"role": "system", "content": "  pad \n"}, {"role": "user", "content": "\n q  "},
             {"role": "assistant", "content": " a "}],
            [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    for conv in CONVERSATIONS + edge:
        ours = hf.apply_chat_template(conv, chat_template=LLAMA2, tokenize=False)
        assert ours == hf.apply_chat_template(conv, chat_template=META_LLAMA2, tokenize=False)
    assert hf.apply_chat_template(CONVERSATIONS[0], chat_template=LLAMA2, tokenize=False) == (
        "<s>[INST] Write a function that adds two numbers. [/INST] def add(a, b):\n    return a + b </s>")


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_bundled_template_passes_the_check_a_recipe_file_gets(name):
    """A recipe naming a bundled template does not render it at load (train.recipe.chat_template): here it is."""
    check_template(name)


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}], "unknown role"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}], "empty assistant turn"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
     "roles do not alternate user/assistant"),
    ([{"role": "assistant", "content": "first"}], "roles do not alternate user/assistant"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
     "ends with a user turn"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"}],
     "system message not first"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}], "malformed message"),
    ([], "not a list of messages"),
])
def test_bad_conversations_are_refused_with_a_reason(messages, reason, sp):
    with pytest.raises(BadConversation) as e:
        render(messages, sp)
    assert e.value.reason == reason
    with pytest.raises(BadConversation):
        check_conversation(messages)


def test_template_from_a_release_folder(tmp_path, sp):
    """A folder's tokenizer_config.json chat_template is used; without {% generation %} blocks the
    answers are found by rendering prefixes, which gives the same mask for the same format."""
    plain = LLAMA2.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": plain}))
    assert resolve_template(tmp_path)[1] == plain
    for conv in CONVERSATIONS:
        assert render(conv, sp, str(tmp_path)) == render(conv, sp)
    (tmp_path / "odd.jinja").write_text("{% for m in messages %}{% if loop.last %}LAST:{% endif %}"
                                        "{{ m['content'] + eos_token }}{% endfor %}")
    with pytest.raises(ValueError, match="prefix"):
        render(CONVERSATIONS[0], sp, str(tmp_path / "odd.jinja"))
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_template("nope")


def test_tokenized_chat_shards_hold_transformers_ids_and_masks(tmp_path, sp, hf):
    """data.tokenize --chat-key: shards + .ds.loss equal apply_chat_template's ids and assistant masks;
    bad conversations are counted in the manifest and not written; the mixture masks prompt labels."""
    from data import tokenize
    from data.mixture import IGNORE_INDEX, Mixture, SourceSpec
    from data.shards import open_source

    bad = [{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
           {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
           {"messages": [{"role": "user", "content": "only a question"}]},
           {"messages": []}, {"other": 1}]
    good = [{"messages": c} for c in CONVERSATIONS]
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "chat.jsonl", "w") as f:
        for record in [good[0], bad[0], good[1], bad[1], bad[2], good[2], bad[3], bad[4]]:
            f.write(json.dumps(record) + "\n")
    manifest = tokenize.run(str(raw), tmp_path / "tok", TINY_TOKENIZER, chat_key="messages")
    assert manifest["loss_mask"] is True and manifest["num_documents"] == 3
    assert manifest["chat"]["rejected"] == {"empty assistant turn": 1, "no assistant turn": 1,
                                            "not a list of messages": 2, "unknown role": 1}
    source = open_source(tmp_path / "tok")
    (shard,) = source.shards
    for d, conv in enumerate(CONVERSATIONS):
        ref = hf.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        start = int(shard.doc_ends[d - 1]) if d else 0
        assert shard.document(d).tolist() == ref["input_ids"]
        assert shard.loss[start : int(shard.doc_ends[d])].tolist() == ref["assistant_masks"]

    # A chat source mixed with a text source (no mask): only the chat source's prompt labels are ignored.
    mix = Mixture([SourceSpec("chat", tmp_path / "tok", weight=0.5, max_epochs=100),
                   SourceSpec("code", "assets/sample_data/code", weight=0.5)], seq_len=32)
    batch = mix.batch(range(8))
    chat_rows, text_rows = batch["source"] == 0, batch["source"] == 1
    assert chat_rows.any() and text_rows.any()
    assert (batch["labels"][text_rows] != IGNORE_INDEX).all()
    ignored = batch["labels"][chat_rows] == IGNORE_INDEX
    assert ignored.any() and not ignored.all()
    # Reference: the chat stream rebuilt from the shard's documents in the loader's epoch order.
    stream = mix.streams[0]
    docs = [(shard.document(d), np.asarray(shard.loss[(int(shard.doc_ends[d - 1]) if d else 0):int(shard.doc_ends[d])]))
            for d in range(shard.num_documents)]
    order = [int(d) for e in range(4) for d in stream.epoch(e)[0]]
    tokens = np.concatenate([docs[d][0] for d in order]).astype(np.int64)
    masks = np.concatenate([docs[d][1] for d in order])
    for row, k in zip(np.flatnonzero(chat_rows), mix.locate(np.arange(8))[1][chat_rows]):
        window = slice(int(k) * 32 + 1, int(k) * 32 + 33)
        assert batch["labels"][row].tolist() == np.where(masks[window] == 1, tokens[window], IGNORE_INDEX).tolist()


def test_a_recipe_template_travels_from_the_shards_to_the_export(tmp_path, capsys):
    """A recipe's own .jinja template: the chat source is tokenized with it (train.data tokenize --recipe
    --source, no extra flags), the run's recipe.toml records it, and ``convert to-hf`` of the run
    writes it into tokenizer_config.json, where transformers' apply_chat_template gives the shard ids."""
    from transformers import AutoTokenizer

    from data.shards import open_source
    from eval.evalplus import chat_prompt_ids
    from data.tokenizer import HFTokenizer
    from models.laneformer import write_native_config
    from models.laneformer.convert import main as convert_main
    from models.laneformer.hf.checkpoint_io import save_dcp
    from rundir import RECIPE_FILE
    from tests.conftest import tiny_random_model
    from train import recipe as R
    from train.build import callbacks
    from train.callbacks.export import Export
    from train.data import main as data_main

    template = LLAMA2.replace("'[INST] '", "'### User:\\n'").replace("' [/INST]'", "'\\n### Assistant:'")
    (tmp_path / "mine.jinja").write_text(template)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    recipe = tmp_path / "sft.toml"
    recipe.write_text(f"""
[run]
name = "t"
output_dir = "{tmp_path / 'run'}"
[model]
flavor = "tiny"
[data]
tokenizer = "{TINY_TOKENIZER}"
chat_template = "{tmp_path / 'mine.jinja'}"
[[data.sources]]
name = "chat"
input = "{tmp_path / 'raw'}"
chat_key = "messages"
path = "{tmp_path / 'tok'}"
weight = 1.0
[optimizer]
lr = 1e-3
[training]
seq_len = 64
global_batch = 2
steps = 1
[checkpoint]
export_hf = true
""")
    assert data_main(["tokenize", "--recipe", str(recipe), "--source", "chat"]) == 0
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert manifest["chat"]["template"] == str(tmp_path / "mine.jinja") and manifest["loss_mask"] is True

    # A finished run of that recipe: its resolved recipe, model config and one checkpoint.
    r = R.load(str(recipe))
    (export,) = [c for c in callbacks(r) if isinstance(c, Export.Config)]
    assert export.chat_template == str(tmp_path / "mine.jinja")
    run = tmp_path / "run"
    run.mkdir()
    (run / RECIPE_FILE).write_text(R.to_toml(r))
    model = tiny_random_model()
    write_native_config(model.config, run)
    save_dcp(model.state_dict(), run / "checkpoints" / "step-1")
    convert_main(["to-hf", str(run), str(tmp_path / "hf")])
    assert f"chat template: {tmp_path / 'mine.jinja'} (from the checkpoint)" in capsys.readouterr().out

    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == template
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    (shard,) = open_source(tmp_path / "tok").shards
    for d, conv in enumerate(CONVERSATIONS):
        ref = hf.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True)
        assert shard.document(d).tolist() == ref["input_ids"]
        start = int(shard.doc_ends[d - 1]) if d else 0
        assert shard.loss[start : int(shard.doc_ends[d])].tolist() == ref["assistant_masks"]
    assert hf.apply_chat_template(CONVERSATIONS[0])["input_ids"] != render(CONVERSATIONS[0], Tokenizer(TINY_TOKENIZER))[0]

    # EvalPlus instruct prompts: in the loop (native tokenizer, the run's template) as eval.run on the export.
    task = {"prompt": 'def add(a, b):\n    """Return a + b."""\n'}
    in_loop = chat_prompt_ids(task, Tokenizer(TINY_TOKENIZER), r.data.chat_template)
    assert in_loop == chat_prompt_ids(task, HFTokenizer(hf)) != chat_prompt_ids(task, Tokenizer(TINY_TOKENIZER))


def test_a_folder_template_is_found_as_transformers_finds_it_and_folded_on_export(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's entry (transformers' order); add_to_hf_folder
    keeps a folder's own template unless told otherwise and leaves one place for it."""
    from transformers import AutoTokenizer

    from data.chat import TEMPLATE_FILE, add_to_hf_folder, folder_template

    other = LLAMA2.replace("'[INST] '", "'Q: '")
    save_hf_tokenizer(TINY_TOKENIZER, tmp_path)
    assert folder_template(tmp_path) is None
    add_to_hf_folder(tmp_path)  # none of its own: the project default
    assert resolve_template(tmp_path)[1] == LLAMA2
    (tmp_path / TEMPLATE_FILE).write_text(other)
    assert resolve_template(tmp_path)[1] == other == AutoTokenizer.from_pretrained(str(tmp_path)).chat_template
    add_to_hf_folder(tmp_path)  # its own is kept, folded into tokenizer_config.json
    assert not (tmp_path / TEMPLATE_FILE).exists() and folder_template(tmp_path).name == "tokenizer_config.json"
    assert AutoTokenizer.from_pretrained(str(tmp_path)).chat_template == other
    add_to_hf_folder(tmp_path, "llama2")  # an explicit one replaces it
    assert AutoTokenizer.from_pretrained(str(tmp_path)).chat_template == LLAMA2


def test_bundled_chat_source_regenerates_byte_identical(tmp_path):
    """assets/chat is what `python -m data.make_sample_chat` writes: the same files, byte for byte
    (raw conversations, manifests with their shard checksums, token, index, loss-mask and metadata files).
    A fresh process, as documented: torch (imported by this test session) replaces inspect.getfile."""
    import subprocess
    import sys

    from data.shards import verify_checksums
    from rundir import REPO

    bundled = REPO / "assets" / "chat"
    subprocess.run([sys.executable, "-m", "data.make_sample_chat", "--out", str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True)
    files = sorted(p.relative_to(bundled) for p in bundled.rglob("*") if p.is_file() and ".index" not in p.parts)
    assert files == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for name in ("train", "held_out"):
        verify_checksums(tmp_path / name)  # the regenerated files match the checksums their manifest lists
    stale = [str(f) for f in files if (tmp_path / f).read_bytes() != (bundled / f).read_bytes()]
    assert not stale, f"assets/chat differs from a fresh `python -m data.make_sample_chat`: {stale}"
