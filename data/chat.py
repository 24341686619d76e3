"""The project's chat template: one Jinja string for transformers, and the renderer training uses.

Template (``llama2``): Llama-2-chat's own ``[INST]`` form, exactly as Meta's template renders it,

    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST] {assistant} </s>

with </s> (EOS) as the end-of-turn token. Why this one: the Llama-2 vocabulary
has no spare control tokens (only <unk>, <s>, </s>), so a template with new
role tokens would change the vocabulary and the embedding shapes of the
released model; ``[INST]`` markup is ordinary text (a few pieces), and ending
each answer with EOS means generation stops at the id every tool already
stops at (``eos_token_id`` in generation_config.json), with no new id. It is
the format Llama-2-chat was trained on with this very vocabulary, and the
string is Meta's own (tests render both with transformers and compare), so
every tool that knows Llama-2-chat prompts this model the same way.

``render`` gives the ids and the loss mask of a conversation exactly as
``tokenizer.apply_chat_template`` computes ids from the same Jinja string: the
template is rendered by transformers' own renderer, with BOS/EOS passed as
sentinel characters, then split at the sentinels (control ids) and each text
piece between them encoded by SentencePiece, which is what a Hugging Face
fast tokenizer does around special tokens. Control-token text inside a
message ("</s>") stays text, as with ``apply_chat_template(...,
sanitize_control_tokens=True)``. The mask is 1 on every token overlapping a
``{% generation %}`` span (assistant content and its </s>), 0 elsewhere (the
spans transformers' ``return_assistant_tokens_mask`` uses). A template without such blocks (a
release's own, kept by an import) works too when it renders each conversation
as a prefix of its continuation: an answer then spans from the end of the
conversation before it, with the generation prompt, to the end of the
conversation through it.

Conversations that must not be trained on (unknown role, empty assistant turn,
no assistant turn, ...) raise ``BadConversation`` with a short reason, which
tokenization counts and reports.

Which template a run uses, first match wins (``train.recipe`` resolves it once
and records it in the run's ``recipe.toml``; tokenization, the in-loop EvalPlus
prompts and the end-of-run export all take that one):

1. the recipe's ``[data] chat_template``: a name in ``TEMPLATES``, a .jinja file,
   or a Hugging Face folder / tokenizer_config.json;
2. the template the initial checkpoint carries (``checkpoint_template`` of
   ``[checkpoint] init_from``): an HF folder's own, a ``convert from-hf`` import's
   (the release's tokenizer files are kept beside the weights), or the template
   recorded in the run dir's ``recipe.toml``;
3. ``DEFAULT`` (``llama2``).

``convert to-hf`` follows the same order (``--chat-template``, then the
checkpoint's own), and the preflight refuses a chat source whose manifest
records another template than the run's (``template_sha256``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError

import rundir

ROLES = ("system", "user", "assistant")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Meta's Llama-2-chat template (meta-llama/Llama-2-7b-chat-hf, tokenizer_config.json), character for
# character, with transformers' {% generation %} markers around each answer (they render as nothing).
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' }}{% generation %}{{ content.strip() + ' ' + eos_token }}"
    "{% endgeneration %}{% endif %}{% endfor %}"
)
TEMPLATES = {"llama2": LLAMA2}
DEFAULT = "llama2"
TEMPLATE_FILE = "chat_template.jinja"  # transformers' own file; it wins over tokenizer_config.json's

# Private-use characters stand in for BOS/EOS while rendering (see the module docstring).
_BOS, _EOS = "\ue000", "\ue001"


class BadConversation(ValueError):
    """A conversation that is not trained on; ``reason`` is a short category for counting."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def resolve_template(spec: str | Path | None = None) -> tuple[str, str]:
    """(name, Jinja) of a template: a name in TEMPLATES, a .jinja file, or a folder or
    tokenizer_config.json whose template is used (a release keeps its own)."""
    spec = DEFAULT if spec is None else str(spec)
    if spec in TEMPLATES:
        return spec, TEMPLATES[spec]
    path = Path(spec)
    if path.is_dir():
        path = folder_template(path) or path / "tokenizer_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"chat template {spec!r}: not one of {sorted(TEMPLATES)} and no such file")
    if path.suffix == ".json":
        jinja = json.loads(path.read_text()).get("chat_template")
        if not isinstance(jinja, str):
            raise ValueError(f"{path}: chat_template: missing or not a single Jinja string")
    else:
        jinja = path.read_text()
    return str(path), jinja


def folder_template(folder: str | Path) -> Path | None:
    """The file holding a Hugging Face folder's own template, looked up as transformers does
    (chat_template.jinja, else tokenizer_config.json's ``chat_template``); None if it has none."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return folder / TEMPLATE_FILE
    config = folder / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("chat_template"):
        return config
    return None


def checkpoint_template(path: str | Path) -> str | None:
    """The template a checkpoint carries, as a ``resolve_template`` spec, or None.

    ``path``: an HF folder or an imported checkpoint (its own template file), a run
    dir or one of its ``checkpoints/step-N`` (the run's ``recipe.toml``
    ``[data] chat_template``, the template it trained with).
    """
    path = Path(path)
    if not path.is_dir():
        return None
    own = folder_template(path)
    if own is not None:
        return str(own)
    recipe = rundir.recorded_recipe(rundir.run_of(path) or path) or {}
    spec = recipe.get("data", {}).get("chat_template")
    return spec if spec is None or spec in TEMPLATES else str(rundir.in_repo(spec))


SAMPLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
          {"role": "assistant", "content": "Bye."}]


def check_template(spec: str | Path | None = None) -> None:
    """Render a sample conversation with the template, as training and export will: a Jinja
    syntax error, or a template that cannot mark the answers, fails here (at recipe load)
    instead of at the end-of-run export. ValueError saying why."""
    _, jinja = resolve_template(spec)
    try:
        _render_text(SAMPLE, jinja, add_generation_prompt=False)
    except TemplateError as e:
        raise ValueError(f"chat template {spec}: does not render a system/user/assistant conversation: "
                         f"{type(e).__name__}: {e}") from None


def template_sha256(jinja: str) -> str:
    return hashlib.sha256(jinja.encode()).hexdigest()


def check_conversation(messages) -> list[dict]:
    """The messages as {"role", "content"} dicts, or BadConversation saying why not."""
    if not isinstance(messages, list) or not messages:
        raise BadConversation("not a list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise BadConversation("malformed message", f"message {i} needs a string 'content'")
        if m.get("role") not in ROLES:
            raise BadConversation("unknown role", f"message {i}: {m.get('role')!r}")
        if m["role"] == "system" and i > 0:
            raise BadConversation("system message not first", f"message {i}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadConversation("empty assistant turn", f"message {i}")
        if _BOS in m["content"] or _EOS in m["content"]:
            raise BadConversation("reserved character", f"message {i} holds U+E000/U+E001")
        out.append({"role": m["role"], "content": m["content"]})
    turns = [m["role"] for m in out if m["role"] != "system"]
    if "assistant" not in turns:
        raise BadConversation("no assistant turn")
    if any(r != ("user" if k % 2 == 0 else "assistant") for k, r in enumerate(turns)):
        raise BadConversation("roles do not alternate user/assistant", " ".join(turns))
    if turns[-1] != "assistant":
        raise BadConversation("ends with a user turn")
    return out


def _render_text(messages: list[dict], jinja: str, add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character spans of the answers (with their end-of-turn markup)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def rendered(msgs, prompt):
        out, spans = render_jinja_template([msgs], chat_template=jinja, return_assistant_tokens_mask=True,
                                           add_generation_prompt=prompt, bos_token=_BOS, eos_token=_EOS)
        return out[0], spans[0]

    text, spans = rendered(messages, add_generation_prompt)
    if GENERATION.search(jinja):
        return text, spans
    # A template without {% generation %} blocks (e.g. a release's): answer i spans from the end of
    # the conversation before it, rendered with the generation prompt, to the end of the one through it.
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = rendered(messages[:i], True)[0], rendered(messages[: i + 1], False)[0]
            if not (end.startswith(start) and text.startswith(end)):
                raise ValueError("chat template has no {% generation %} block and does not render a "
                                 "conversation as the prefix of its continuation: the loss mask is undefined")
            spans.append((len(start), len(end)))
    return text, spans


def _encode(text: str, tokenizer, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask of rendered text: sentinels -> control ids, SentencePiece between them."""
    control = {_BOS: tokenizer.bos_id, _EOS: tokenizer.eos_id}
    # Byte offset of every character boundary (SentencePiece reports byte offsets).
    byte_at = np.concatenate([[0], np.cumsum([len(c.encode()) for c in text])]).astype(np.int64)
    in_span = np.zeros(len(text) + 1, dtype=bool)
    for a, b in spans:
        in_span[a:b] = True
    ids, mask = [], []
    start = 0
    for i in [i for i, c in enumerate(text) if c in control] + [len(text)]:
        if i > start:
            piece = text[start:i]
            base = int(byte_at[start])
            local = np.searchsorted(byte_at, base + np.arange(len(piece.encode()) + 1)) - start  # byte -> char
            for p in tokenizer.sp.encode(piece, out_type="proto").pieces:  # offsets in piece bytes
                a, b = int(local[p.begin]), max(int(local[p.end]), int(local[p.begin]) + 1)  # byte-fallback: width 0
                ids.append(p.id)
                mask.append(int(in_span[start + a : start + b].any()))
        if i < len(text):
            ids.append(control[text[i]])
            mask.append(int(in_span[i]))
        start = i + 1
    return ids, mask


def render(messages, tokenizer, template: str | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a whole conversation as the shards hold it; BadConversation if unfit."""
    messages = check_conversation(messages)
    _, jinja = resolve_template(template)
    try:
        text, spans = _render_text(messages, jinja, add_generation_prompt=False)
    except TemplateError as e:  # the template's own raise_exception
        raise BadConversation("rejected by the template", str(e)) from None
    ids, mask = _encode(text, tokenizer, spans)
    if not ids or ids[0] != tokenizer.bos_id or ids[-1] != tokenizer.eos_id:
        raise ValueError(f"chat template {template or DEFAULT!r} must render <s> first and </s> last")
    return ids, mask


def prompt_ids(messages: list[dict], tokenizer, template: str | None = None) -> list[int]:
    """Ids of a conversation ending in a user turn, ready for the assistant's answer (generation)."""
    _, jinja = resolve_template(template)
    text, spans = _render_text(messages, jinja, add_generation_prompt=True)
    return _encode(text, tokenizer, spans)[0]


def prefix_ids(messages: list[dict], tokenizer, cut: str, template: str | None = None) -> list[int]:
    """Ids of the rendered conversation up to (not including) the text ``cut`` (e.g. a marker
    placed inside the last answer, to prompt with the start of an answer, as EvalPlus does)."""
    _, jinja = resolve_template(template)
    text, spans = _render_text(messages, jinja, add_generation_prompt=False)
    if cut not in text:
        raise ValueError(f"{cut!r} does not occur in the rendered conversation")
    return _encode(text[: text.index(cut)], tokenizer, spans)[0]


def hf_tokenizer_config(config: dict, template: str | None = None) -> dict:
    """tokenizer_config.json fields with the chat template added (for exports).

    ``split_special_tokens`` becomes false: otherwise transformers encodes the
    template's own "<s>"/"</s>" as text and ``apply_chat_template`` cannot
    produce control ids. Text holding literal "</s>" should then go through
    ``apply_chat_template(..., sanitize_control_tokens=True)``, which keeps it
    text (as training did).
    """
    _, jinja = resolve_template(template)
    return {**config, "chat_template": jinja, "split_special_tokens": False}


def add_to_hf_folder(folder: str | Path, template: str | None = None) -> None:
    """Write the chat template into the tokenizer_config.json in ``folder``: ``template`` if
    given, else the folder's own (a release's is kept), else DEFAULT. A chat_template.jinja
    is folded in and removed, so that the one template transformers loads is that one."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if template is None:
        own = folder_template(folder)
        template = str(own) if own is not None else DEFAULT
    config = hf_tokenizer_config(config, template)
    (Path(folder) / TEMPLATE_FILE).unlink(missing_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
