"""Tool traces for SFT: chat messages with `tool_calls` and `tool` turns, trained on the assistant's tokens only.

A trace is the list of messages after the prompt (OpenAI / transformers format):

    [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
         {"name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}}]},
     {"role": "tool", "name": "calculator", "content": "10921"},
     {"role": "assistant", "content": "\\boxed{10921}"}]

The whole conversation is rendered once with the model's chat template (with the tools' schemas, as
rollout prompts are); each assistant message's tokens are the difference between the render up to its
header and the render through it. They are trained up to and including the first token that ends a
model turn in the agent loop (EOS, or </tool_call> when a tool call stops the turn); everything else
(the prompt, tool results, the tokens the template adds after a turn) is masked. So SFT trains exactly
the tokens the policy samples in the agent loop, and RL continues from the same trajectories.
"""

from __future__ import annotations

from typing import Any

from postrl.errors import UserError
from postrl.toolcall import call_end_id
from postrl.untrusted import Unreadable, load_json



def is_trace(response: Any) -> bool:
    """Whether a row's SFT response is a trace (a list of chat messages) rather than a text."""
    return isinstance(response, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in response)


def encode_trace(
    tokenizer: Any, prompt: Any, turns: list[dict], tools: list[dict] | None = None, where: str = "trace"
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response loss mask) of a prompt and the trace that follows it."""
    prompt_msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    turns = [_clean(m) for m in turns]

    def render(messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        ))  # fmt: skip

    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: a tool trace needs the tokenizer's chat template, and it has none. Fix: use a chat model's tokenizer.")
    prompt_ids = render(prompt_msgs, True)
    ids = render(prompt_msgs + turns, False)
    stops = {tokenizer.eos_token_id, call_end_id(tokenizer)} - {None, tokenizer.unk_token_id}
    mask = [0] * len(ids)
    for k, m in enumerate(turns):
        if m["role"] != "assistant":
            continue
        head = render(prompt_msgs + turns[:k], True)
        upto = render(prompt_msgs + turns[: k + 1], False)
        if ids[: len(head)] != head or ids[: len(upto)] != upto or upto[: len(head)] != head:
            raise UserError(
                f"{where}: the chat template renders the conversation so that an earlier part changes when a later "
                "turn is added, so assistant tokens cannot be told apart. Fix: use a template whose earlier turns stay "
                "as they are (Qwen2.5, Llama 3 and ChatML do)."
            )
        for pos in range(len(head), len(upto)):
            mask[pos] = 1
            if ids[pos] in stops:
                break
    if ids[: len(prompt_ids)] != prompt_ids:
        raise UserError(f"{where}: the prompt renders differently inside the whole conversation. Fix: check the chat template.")
    return prompt_ids, ids[len(prompt_ids) :], mask[len(prompt_ids) :]


def _clean(message: dict) -> dict:
    """A message as the template expects it: no None-valued keys (parquet fills missing fields with None)."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "assistant" and "content" not in out:
        out["content"] = ""
    if "tool_calls" in out:
        out["tool_calls"] = [
            {k: (_drop_none(v) if k == "function" else v) for k, v in call.items() if v is not None}
            for call in out["tool_calls"]
        ]  # fmt: skip
    return out


def _drop_none(value: Any) -> Any:
    """A nested dict without None values (the fields parquet adds for other rows' keys)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


# ------------------------------------------------------------------------------ the formats users bring
# ShareGPT's speakers (`from`) in the chat roles of the templates (`role`).
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool", "function_call": "assistant",
}  # fmt: skip


def normalize_messages(messages: Any, where: str) -> Any:
    """Chat messages as the templates read them (`role` / `content`): ShareGPT's `from` / `value` converted
    (a `function_call` turn becomes an assistant tool call); a plain string is returned as it is."""
    if isinstance(messages, str) or not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{where}: message {k} is {type(m).__name__}, not a mapping with role and content. Fix: write each message as {{\"role\": ..., \"content\": ...}}.")
        if "role" in m:
            out.append(m)
            continue
        if "from" not in m:
            raise UserError(
                f"{where}: message {k} has neither 'role' (OpenAI / TRL) nor 'from' (ShareGPT) but {sorted(m)}. "
                "Fix: write messages as {\"role\": \"user\", \"content\": ...} (or ShareGPT's {\"from\": \"human\", \"value\": ...})."
            )
        role = SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise UserError(
                f"{where}: message {k} is from '{m['from']}', a ShareGPT speaker postrl does not know. "
                f"Fix: use one of {', '.join(SHAREGPT_ROLES)} (or write the message with a 'role')."
            )
        value = m.get("value", "")
        if str(m["from"]).lower() == "function_call":
            call = _function_call(value, f"{where}: message {k}")
            out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]})
        else:
            out.append({"role": role, "content": value, **({"name": m["name"]} if "name" in m else {})})
    return out


def _function_call(value: Any, where: str) -> dict:
    """A ShareGPT function_call message's JSON, read under the size and depth caps of model-written JSON."""
    try:
        call = load_json(value) if isinstance(value, str) else value
    except Unreadable as exc:
        raise UserError(f"{where} is a function_call whose value is not readable JSON ({exc}). "
                        "Fix: write it as a JSON object {\"name\": ..., \"arguments\": {...}}.") from None
    if not isinstance(call, dict):
        raise UserError(f"{where} is a function_call whose value is a {type(call).__name__}, not an object. "
                        "Fix: write it as a JSON object {\"name\": ..., \"arguments\": {...}}.")
    return call


def sft_pair(row: dict, prompt_key: str, response_key: str, where: str) -> tuple[Any, Any, list[dict] | None]:
    """(prompt, response, tools) of an SFT row in any of the formats users bring:

    - the configured columns (data.prompt_key / data.response_key: the verl schema by default);
    - TRL's conversational `{"messages": [...]}` (ShareGPT's `conversations` too): the messages before the
      first assistant turn are the prompt, the rest (assistant turns, tool calls, tool results) the trace;
    - TRL's `prompt` / `completion` (strings, or lists of messages);
    with a `tools` column of JSON schemas passed to the template. A preference row (`chosen` / `rejected`)
    is refused with the fix (SFT trains one response: data.response_key: chosen)."""
    from postrl.utils import get_dotted

    tools = row.get("tools") if isinstance(row.get("tools"), list) else None
    prompt, response = get_dotted(row, prompt_key), get_dotted(row, response_key)
    if prompt is not None and response is not None:
        return normalize_messages(prompt, where), normalize_messages(response, where), tools
    if "completion" in row and row.get("prompt") is not None:
        return normalize_messages(row["prompt"], where), normalize_messages(row["completion"], where), tools
    conversation = row.get("messages", row.get("conversations"))
    if isinstance(conversation, list):
        messages = normalize_messages(conversation, where)
        first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise UserError(
                f"{where}: the conversation has {'no assistant turn' if first is None else 'no prompt before its first assistant turn'}, "
                "so there is nothing to learn from (or nothing to condition on). Fix: each row needs user (or system) "
                "messages followed by the assistant's reply."
            )
        return messages[:first], messages[first:], tools
    if "chosen" in row and "rejected" in row:
        raise UserError(
            f"{where}: a preference pair (chosen / rejected); SFT trains on one reference response. Fix: set "
            "data.response_key: chosen to fine-tune on the preferred responses, or train a reward model with `postrl rm`."
        )
    missing = prompt_key if prompt is None else response_key
    raise UserError(
        f"{where}: no '{missing}' field; SFT needs a prompt (data.prompt_key) and a reference response "
        "(data.response_key), TRL's messages or prompt / completion columns, or ShareGPT's conversations. "
        f"The row has {sorted(row)}. Fix: set those keys to your columns."
    )
