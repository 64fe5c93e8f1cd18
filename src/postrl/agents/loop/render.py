"""The ids the environment adds to a trajectory, rendered with the model's own chat template.

The model's turns are never re-tokenised: the loop keeps the ids it sampled. What comes between two
model turns (the end of the assistant turn, the tool results or the environment's message, the next
assistant header) is the difference between the chat template rendered with and without those
messages, after an assistant turn whose content is a marker:

    render([user, assistant: MARK])                    ...<|im_start|>assistant\\nMARK<|im_end|>\\n
    render([user, assistant: MARK, tool], gen=True)    ...<|im_start|>assistant\\nMARK<|im_end|>\\n<|im_start|>user\\n
                                                       <tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    -> the text after MARK, tokenised: "<|im_end|>\\n<|im_start|>user\\n<tool_response>...<|im_start|>assistant\\n"

The text starts at the end-of-turn marker, a special token, so tokenising it alone gives the ids a
whole-conversation render gives (tests/test_agents.py checks it for the tiny template and Qwen2.5's).
A model turn that already ended with that token (EOS, as before an environment's message) does not
get it twice. verl's agent loop and TRL's environments compute tool turns the same way. What is
rendered (tool output, an environment's or a client's text) is tokenised with lone surrogates replaced:
a tokenizer raises on them.
"""

from __future__ import annotations

from typing import Any

from postrl.errors import UserError
from postrl.untrusted import clean_text

MARK = "<<postrl-assistant-turn>>"


class TurnRenderer:
    """Ids of the messages appended after a model turn, through `tokenizer`'s chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "rollout.multi_turn needs a chat template to render tool results and environment turns, and the "
                f"tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has none. Fix: use a chat model's tokenizer "
                "(model.tokenizer_path) or add a chat_template to it."
            )
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
        before = self._render(self._base, generation_prompt=False)
        self._cut = before.index(MARK) + len(MARK)
        self._prefix = before[: self._cut]
        self.turn_end = self._ids(before[self._cut :])  # what closes an assistant turn, e.g. <|im_end|> \n

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def after_turn(self, messages: list[dict], last_token: int | None) -> list[int]:
        """Ids from the end of a model turn (whose last sampled id is `last_token`) through `messages` up to
        the next assistant header."""
        text = self._render(self._base + messages, generation_prompt=True)
        if not text.startswith(self._prefix):
            raise UserError(
                "the chat template renders the conversation before a tool / environment message differently once "
                "that message is added, so its ids cannot be appended to the trajectory. Fix: use a template whose "
                "earlier turns do not change when a turn is added (Qwen2.5, Llama 3, ChatML do not)."
            )
        ids = self._ids(clean_text(text[self._cut :]))  # a tool's or a client's text may hold lone surrogates
        if last_token is not None and self.turn_end and ids[:1] == self.turn_end[:1] and last_token == ids[0]:
            ids = ids[1:]  # the model closed its turn itself (EOS)
        return ids

    def tool_turn(self, results: list[tuple[str, str]], last_token: int | None) -> list[int]:
        """Ids of the tool results [(tool name, text)] of one model turn."""
        return self.after_turn([{"role": "tool", "name": n, "content": t} for n, t in results], last_token)

    def user_turn(self, text: str, last_token: int | None) -> list[int]:
        """Ids of an environment's observation, shown as a user message."""
        return self.after_turn([{"role": "user", "content": text}], last_token)


def truncate_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text` cut to `max_tokens` tokens, with a note that says so (tool output shown to the model)."""
    text = clean_text(text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + f"\n[output cut at {max_tokens} tokens]"
