"""Chat templates selected by `prompt_type` (the MindSpeed-RL / LLaMA-Factory names).

A template does two things during `postrl preprocess`:

1. it shapes the chat messages stored in the parquet `prompt` column: its default system prompt
   (e.g. qwen_math_r1's "Please reason step by step ...") and a text put before the user's content
   (qwen_r1's R1-Zero instruction);
2. it renders those messages to text for counting prompt tokens against `seq_length` when the
   tokenizer has no chat template of its own (when it has one, that one is used, as at training time).

At training time `render_chat` turns a row's prompt into token ids with the tokenizer's own chat
template; a tokenizer without one falls back to plain text, and says so once (`has_chat_template`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.errors import UserError

log = logging.getLogger("postrl.data")
PLAIN_TEXT = "prompts are rendered as plain text (the messages' contents joined by newlines, no role markers)"
_warned_no_template: set[str] = set()  # tokenizers already warned about, by location

R1_INSTRUCTION = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. "
    "Put your final answer within \\boxed{}.\n"
)


@dataclass(frozen=True)
class ChatTemplate:
    """How a prompt_type turns (system, user) into messages and messages into prompt text."""

    name: str
    default_system: str | None = None  # system message added when the data has none
    user_prefix: str = ""  # put before the user's content in the stored message
    instructs: bool = False  # the template already tells the model how to answer (skip handler hints)
    prefix: str = ""  # text before the first turn (a BOS token)
    system_format: str = "{content}"
    user_format: str = "{content}"
    assistant_format: str = "{content}"

    def messages(self, user: str, system: str | None = None) -> list[dict[str, str]]:
        """Chat messages for one prompt; `system=""` means no system message."""
        system = self.default_system if system is None else system
        out = [{"role": "system", "content": system}] if system else []
        out.append({"role": "user", "content": self.user_prefix + user})
        return out

    def render(self, messages: list[dict[str, str]]) -> str:
        """Prompt text up to where the assistant's answer starts."""
        parts = [self.prefix]
        for m in messages:
            fmt = {"system": self.system_format, "user": self.user_format}.get(m["role"], self.assistant_format)
            parts.append(fmt.format(content=m["content"]))
        return "".join(parts)


_CHATML = dict(
    system_format="<|im_start|>system\n{content}<|im_end|>\n",
    user_format="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    assistant_format="{content}<|im_end|>\n",
)

TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("empty", system_format="{content}\n"),
        ChatTemplate("qwen", default_system="You are a helpful assistant.", **_CHATML),
        ChatTemplate(
            "qwen_r1", default_system="You are a helpful assistant.", user_prefix=R1_INSTRUCTION, instructs=True, **_CHATML
        ),
        ChatTemplate(
            "qwen_math_r1",
            default_system="Please reason step by step, and put your final answer within \\boxed{}.",
            instructs=True,
            **_CHATML,
        ),
        ChatTemplate("qwen3", **_CHATML),
        ChatTemplate(
            "llama3",
            prefix="<|begin_of_text|>",
            system_format="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            user_format="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            assistant_format="{content}<|eot_id|>",
        ),
    )
}


def load_templates_file(path: str | Path) -> dict[str, ChatTemplate]:
    """Templates from a JSON file in MindSpeed-RL's templates.json format: a list of entries with `name`,
    `format_user` / `format_system` / `format_assistant` / `format_prefix` ({"slots": [...]}, the text
    around `{{content}}`) and `default_system`. Special-token slots (["bos_token"]) are left out: the
    tokenizer's chat template adds them at training time."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"prompt_type_path '{path}' is not a readable JSON file ({exc}). Fix: point it at a templates.json.") from None
    if isinstance(entries, dict):
        entries = [{"name": k, **v} for k, v in entries.items()]

    def slots(entry: dict, key: str) -> str:
        parts = (entry.get(key) or {}).get("slots", [])
        text = "".join(p for p in parts if isinstance(p, str))
        return text.replace("{", "{{").replace("}", "}}").replace("{{{{content}}}}", "{content}")

    out = {}
    for e in entries:
        if not isinstance(e, dict) or "name" not in e:
            raise UserError(f"{path}: every template needs a 'name' (got {str(e)[:80]}). Fix: correct the file.")
        system = e.get("default_system")
        out[e["name"]] = ChatTemplate(
            e["name"], default_system=system or None, instructs=bool(system and ("boxed" in system or "answer" in system.lower())),
            prefix=slots(e, "format_prefix"), system_format=slots(e, "format_system") or "{content}",
            user_format=slots(e, "format_user") or "{content}", assistant_format=slots(e, "format_assistant") or "{content}",
        )  # fmt: skip
    return out


def get_template(name: str | None, path: str | Path | None = None) -> ChatTemplate:
    """The template named `name` (None means "empty"), from `path` (a templates.json) when given;
    a UserError lists the valid names."""
    if path is not None:
        found = load_templates_file(path)
        if name not in found:
            raise UserError(f"prompt_type '{name}' is not in {path}. Its templates: {', '.join(found)}. Fix: name one of them.")
        return found[name]
    key = "empty" if name in (None, "") else str(name)
    if key not in TEMPLATES:
        raise UserError(
            f"prompt_type '{name}' is not known. Valid prompt types: {', '.join(TEMPLATES)}. "
            "Fix: pick the one matching your model family (qwen for Qwen2.5-Instruct, qwen_r1 for R1-Zero style "
            "training of a base model, qwen_math_r1 for Qwen2.5-Math, empty for no template)."
        )
    return TEMPLATES[key]


def has_chat_template(tokenizer: Any, instead: str = PLAIN_TEXT) -> bool:
    """Whether `tokenizer` renders chat messages itself. When it does not, say once per tokenizer
    what is done `instead`: a chat model fed prompts without its format answers worse, silently."""
    if getattr(tokenizer, "chat_template", None):
        return True
    where = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if where not in _warned_no_template:
        _warned_no_template.add(where)
        log.warning(
            "tokenizer '%s' has no chat template, so %s. Fix: point model.tokenizer_path at a tokenizer that has "
            "one, or add a chat_template to it (tokenizer_config.json or chat_template.jinja); ignore this for a "
            "base model trained on plain text.",
            where, instead,
        )  # fmt: skip
    return False


def render_chat(tokenizer: Any, prompt: Any, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt (chat messages, or a plain string taken as one user message): through the
    tokenizer's chat template, else as plain text (warned once per tokenizer). `tools` (JSON schemas of
    the agent loop's tools) reach the template's `tools=`."""
    from postrl.data.traces import normalize_messages  # ShareGPT's from / value, as the template reads role / content

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else normalize_messages(list(prompt), "a prompt")
    if has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
