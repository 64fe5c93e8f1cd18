"""The SFT files users bring from TRL / HF (issue 38) and ShareGPT (issue 41): TRL's conversational
`messages` with tool calls and tool turns, `prompt` / `completion`, ShareGPT's `from` / `value`."""

from __future__ import annotations

import json

import pytest

from postrl.checks import load_config
from postrl.cli import main
from postrl.data.traces import normalize_messages, sft_pair
from postrl.errors import UserError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}  # fmt: skip
TRL_TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": "What is 347 * 28 + 1205?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}}]},
        {"role": "tool", "name": "calculator", "content": "10921"},
        {"role": "assistant", "content": "\\boxed{10921}"},
    ],
    "tools": [CALC],
}  # fmt: skip


def test_formats_give_prompt_and_response():
    prompt, response, tools = sft_pair(TRL_TOOL_ROW, "prompt", "extra_info.solution", "r0")
    assert [m["role"] for m in prompt] == ["system", "user"] and [m["role"] for m in response] == ["assistant", "tool", "assistant"]
    assert tools == [CALC]
    assert sft_pair({"prompt": "2+2?", "completion": "4"}, "prompt", "extra_info.solution", "r1")[:2] == ("2+2?", "4")
    share = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    prompt, response, _ = sft_pair(share, "prompt", "extra_info.solution", "r2")
    assert prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}] and response == [{"role": "assistant", "content": "hello"}]
    with pytest.raises(UserError, match="data.response_key: chosen"):
        sft_pair({"prompt": "p", "chosen": "a", "rejected": "b"}, "prompt", "extra_info.solution", "r3")
    with pytest.raises(UserError, match="a ShareGPT speaker postrl does not know"):
        normalize_messages([{"from": "narrator", "value": "x"}], "r4")
    with pytest.raises(UserError, match="no assistant turn"):
        sft_pair({"messages": [{"role": "user", "content": "x"}]}, "prompt", "extra_info.solution", "r5")


def test_trl_messages_with_tool_calls_train_two_steps(tmp_path):
    """A TRL conversational JSONL with tool calls and tool turns: the assistant's tokens train, the tool's do not."""
    from postrl.models import load_tokenizer, resolve_model_path
    from postrl.sft import build_examples

    data = tmp_path / "trl.jsonl"
    rows = [TRL_TOOL_ROW, {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "\\boxed{5}"}]},
            {"prompt": [{"role": "user", "content": "What is 4 + 4?"}], "completion": [{"role": "assistant", "content": "\\boxed{8}"}]}]  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = [f"data.train_files=[{data}]", "data.val_files=[]", "sft.steps=2", "sft.batch_size=3", "sft.eval_prompts=0",
            f"sft.output_dir={tmp_path}/sft", f"logging.dir={tmp_path}/sft", "sft.warmup_steps=0"]  # fmt: skip
    cfg = load_config("configs/tiny_tool_sft.yaml", args)
    tok = load_tokenizer(resolve_model_path(cfg.model.path, cfg.model.tiny))
    p, r, _, mask = build_examples([TRL_TOOL_ROW], tok, cfg, "trl.jsonl")[0]
    trained = tok.decode([t for t, m in zip(r, mask) if m])
    assert "calculator" in trained and "10921}" in trained  # the call and the boxed answer
    assert "<tool_response>" not in trained and sum(mask) < len(r)  # the tool's result is masked
    assert main(["sft", "configs/tiny_tool_sft.yaml", *args]) == 0
    assert (tmp_path / "sft" / "model" / "config.json").is_file()


def test_sharegpt_prompts_render_through_the_template(tiny_model_path):
    from postrl.data.templates import render_chat
    from postrl.models import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    share = [{"from": "human", "value": "What is 2 + 3?"}]
    assert render_chat(tok, share) == render_chat(tok, [{"role": "user", "content": "What is 2 + 3?"}])
