"""The agent loop: rendering tool turns with the chat template, the loop's limits and errors, SFT traces.

The rendering tests compare the ids the loop builds turn by turn (prompt, the model's sampled ids, the
rendered tool turn, ...) with the chat template rendering the whole conversation at once, for the tiny
tools model's template and Qwen2.5's. The loop tests drive it with `ScriptEngine`, an engine whose
policy is a fixed script of turns (the loop's logic is under test, not a model); the tiny model
running the loop for real is tests/test_learning.py's tool demo.
"""

from __future__ import annotations

import dataclasses

import json

import pytest

from postrl.agents.loop.loop import AgentLoop
from postrl.turns import model_text, model_tokens
from postrl.agents.loop.render import TurnRenderer
from postrl.builtin.tiny import build_tiny_model
from postrl.checks import load_config
from postrl.config import MultiTurnConfig
from postrl.data.traces import encode_trace
from postrl.errors import UserError
from postrl.rollout.base import Completion, EngineCapabilities, SamplingParams

# Qwen2.5-Instruct's chat template: the "chat_template" of its tokenizer_config.json, character for
# character. Checked against the copy of that JSON line quoted in ShishirPatil/gorilla,
# berkeley-function-call-leaderboard/bfcl/model_handler/local_inference/qwen.py (commit 2ea5bb9b,
# QwenHandler._format_prompt's docstring): json-decoded it equals this string. The tool parts are what
# matter here: the tools system block, assistant tool_calls in <tool_call> blocks, consecutive tool
# messages grouped in one user turn.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}\n'
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2-tools"))


@pytest.fixture(params=["tiny", "qwen2.5"])
def template_tokenizer(request, tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    if request.param == "qwen2.5":
        tok.chat_template = QWEN25_TEMPLATE
    return tok


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _call(expression: str, sep: str) -> str:
    return f"<tool_call>{sep}" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + f"{sep}</tool_call>"


def test_a_conversation_rendered_turn_by_turn_has_the_ids_of_the_whole_render(template_tokenizer):
    tok = template_tokenizer
    sep = "\n" if "Qwen" in tok.chat_template else ""  # Qwen2.5 puts the call's JSON on its own line
    call1, call2 = _call("347 * 28", sep), _call("9716 + 1205", sep)
    messages = [
        {"role": "user", "content": "What is 347 * 28 + 1205?"},
        {"role": "assistant", "content": call1},
        {"role": "tool", "name": "calculator", "content": "9716"},
        {"role": "assistant", "content": call2},
        {"role": "tool", "name": "calculator", "content": "10921"},
        {"role": "assistant", "content": "\\boxed{10921}"},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": "Yes: \\boxed{10921}"},
    ]
    whole = tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False)
    r = TurnRenderer(tok)
    ids = tok.apply_chat_template(messages[:1], tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False)
    # The model's turns as sampled: up to </tool_call> (the stop), or through its EOS.
    ids += _ids(tok, call1)
    ids += r.tool_turn([("calculator", "9716")], ids[-1])
    ids += _ids(tok, call2)
    ids += r.tool_turn([("calculator", "10921")], ids[-1])
    ids += _ids(tok, "\\boxed{10921}") + [tok.eos_token_id]  # ended with EOS: the environment answers
    ids += r.user_turn("Are you sure?", ids[-1])
    ids += _ids(tok, "Yes: \\boxed{10921}") + [tok.eos_token_id]
    assert ids == whole[: len(ids)]
    assert tok.decode(whole[len(ids) :]) == "\n"  # the template's newline after the last EOS


def test_the_tool_turn_of_the_tiny_template_is_masked_tool_text_and_the_next_assistant_header(tokenizer):
    r = TurnRenderer(tokenizer)
    call_end = tokenizer.convert_tokens_to_ids("</tool_call>")
    assert tokenizer.decode(r.tool_turn([("calculator", "10921")], call_end)) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>10921</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # after an EOS the turn is already closed
    assert tokenizer.decode(r.user_turn("no", tokenizer.eos_token_id)) == "\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n"


class ScriptEngine:
    """An engine whose policy is a script: turn k of every trajectory is `turns[k]` (text, tokenised).

    It records its calls, so a test can check that one engine call served all live trajectories.
    """

    name = "script"
    capabilities = EngineCapabilities(reports_logprobs=False, shares_trainer_model=False, can_sleep=False)

    def __init__(self, tokenizer, turns: list[str]):
        self.tok, self.turns, self.calls = tokenizer, turns, []

    def generate(self, prompts, params, multi_modal=None):
        self.calls.append((len(prompts), params))
        turn = len(self.calls) - 1
        n = 1 if params.greedy else params.n
        ids = self.tok(self.turns[turn], add_special_tokens=False)["input_ids"]
        out = []
        for i, prompt in enumerate(prompts):
            for _ in range(n):
                sample = ids[: params.max_tokens]
                stopped = bool(sample) and sample[-1] in (self.tok.eos_token_id, *params.stop_token_ids)
                out.append(Completion(i, sample, stopped, [-0.25] * len(sample)))
        return out

    def close(self):
        pass


def _loop(tokenizer, turns, **cfg) -> tuple[AgentLoop, ScriptEngine]:
    engine = ScriptEngine(tokenizer, turns)
    return AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, tools=["builtin:calculator"], **cfg)), engine


def _prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "What is 347 * 28 + 1205?"}], tools=TOOLS,
                                         add_generation_prompt=True, return_dict=False)  # fmt: skip


def test_the_loop_runs_the_tool_masks_its_output_and_batches_every_live_trajectory_in_one_call(tokenizer):
    loop, engine = _loop(tokenizer, [_call("347 * 28 + 1205", ""), "\\boxed{10921}<|im_end|>"])
    out = loop.generate([_prompt(tokenizer)] * 3, SamplingParams(max_tokens=200, n=4, seed=1))
    assert len(out) == 12 and [c.prompt_index for c in out] == [i for i in range(3) for _ in range(4)]
    assert [n for n, _ in engine.calls] == [3, 12]  # turn 1: 3 prompts x n=4; turn 2: the 12 trajectories, n=1
    assert engine.calls[0][1].stop_token_ids == (tokenizer.convert_tokens_to_ids("</tool_call>"),)
    c = out[0]
    text = tokenizer.decode(c.token_ids)
    assert "<tool_response>10921</tool_response>" in text and c.finished
    call_len, answer_len = len(_ids(tokenizer, _call("347 * 28 + 1205", ""))), len(_ids(tokenizer, "\\boxed{10921}<|im_end|>"))
    tool_len = len(c.token_ids) - call_len - answer_len
    assert c.loss_mask == [1] * call_len + [0] * tool_len + [1] * answer_len
    assert c.turn_spans == [(0, call_len), (call_len + tool_len, len(c.token_ids))]
    assert c.logprobs == [-0.25] * call_len + [0.0] * tool_len + [-0.25] * answer_len
    assert model_text(tokenizer, c).endswith("\\boxed{10921}") and model_tokens(c) == call_len + answer_len
    m = loop.pop_metrics()
    assert (m["agent/turns_mean"], m["agent/tool_calls_mean"], m["agent/tool_ok"], m["agent/tool_error"]) == (2.0, 1.0, 12, 0)
    assert m["agent/model_tokens_mean"] == call_len + answer_len and m["agent/total_tokens_mean"] == len(c.token_ids)


def test_a_malformed_call_is_answered_with_an_error_the_model_reads(tokenizer):
    loop, _ = _loop(tokenizer, ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "\\boxed{1}<|im_end|>"])
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=200, greedy=True))
    tool_text = tokenizer.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])
    assert "not valid JSON" in tool_text and c.finished and len(c.turn_spans) == 2
    assert loop.pop_metrics()["agent/tool_error"] == 1


def test_limits_end_trajectories_unfinished(tokenizer):
    call = _call("1 + 1", "")
    loop, _ = _loop(tokenizer, [call] * 5, max_turns=3)  # calls forever: max_turns ends it
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=500, greedy=True))
    assert len(c.turn_spans) == 3 and c.tool_calls == 2 and not c.finished
    loop, _ = _loop(tokenizer, [call] * 5, max_tool_calls=1)
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=500, greedy=True))
    assert len(c.turn_spans) == 2 and c.tool_calls == 1 and not c.finished
    loop, engine = _loop(tokenizer, [call] * 5)
    budget = len(_ids(tokenizer, call)) + 5  # room for one call, not for its tool turn and another call
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=budget, greedy=True))
    assert len(c.token_ids) <= budget and not c.finished and len(engine.calls) == 1


def test_tool_output_is_cut_to_max_tool_response_tokens(tokenizer):
    loop, _ = _loop(tokenizer, [_call("7 ** 60", ""), "\\boxed{1}<|im_end|>"], max_tool_response_tokens=10)
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=300, greedy=True))
    tool_text = tokenizer.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])
    assert str(7**60)[:10] in tool_text and str(7**60) not in tool_text and "[output cut at 10 tokens]" in tool_text


class Guess:
    """An environment: says 'higher' / 'lower' until the boxed number is the row's answer; reward 1 then."""

    def reset(self, row):
        self.target = int(row["answer"])

    def step(self, text):
        import re

        got = int(re.findall(r"\d+", text)[-1])
        if got == self.target:
            return "", 1.0, True
        return ("higher" if got < self.target else "lower"), 0.0, False


def test_an_environment_answers_with_masked_user_turns_and_its_reward(tokenizer):
    engine = ScriptEngine(tokenizer, ["\\boxed{3}<|im_end|>", "\\boxed{9}<|im_end|>", "\\boxed{5}<|im_end|>"])
    loop = AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, interaction=f"{__name__}:Guess", max_turns=4))
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=300, greedy=True), rows=[{"answer": "5"}])
    masked = tokenizer.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])
    assert masked == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    assert c.env_reward == 1.0 and c.finished and len(c.turn_spans) == 3
    assert loop.pop_metrics()["agent/env_reward_mean"] == 1.0
    with pytest.raises(UserError, match="package.module:Class"):
        AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, interaction="Guess"))


def test_an_sft_trace_trains_the_assistant_tokens_through_each_turns_stop(template_tokenizer):
    tok = template_tokenizer
    trace = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}}]},
        {"role": "tool", "name": "calculator", "content": "10921"},
        {"role": "assistant", "content": "\\boxed{10921}"},
    ]  # fmt: skip
    prompt_ids, ids, mask = encode_trace(tok, "What is 347 * 28 + 1205?", trace, TOOLS)
    trained = [t for t, m in zip(ids, mask) if m]
    call = tok.decode(trained[: trained.index(tok.convert_tokens_to_ids("</tool_call>")) + 1])
    assert json.loads(call.removeprefix("\n").removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "calculator", "arguments": {"expression": "347 * 28 + 1205"}}  # fmt: skip
    assert tok.decode(trained).endswith("\\boxed{10921}<|im_end|>")
    assert "10921</tool_response>" not in tok.decode(trained) and "10921" in tok.decode([t for t, m in zip(ids, mask) if not m])


def test_config_takes_verls_multi_turn_names():
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2-tools", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[builtin:calculator]",
                             "rollout.multi_turn.max_assistant_turns=3", "rollout.multi_turn.max_tool_response_length=64"])  # fmt: skip
    assert cfg.rollout.multi_turn.max_turns == 3 and cfg.rollout.multi_turn.max_tool_response_tokens == 64


def test_the_hf_engine_stops_at_an_extra_stop_token_and_keeps_it(tokenizer):
    from postrl.models import load_model
    from postrl.rollout.hf import HFEngine

    model = load_model(str(build_tiny_model("tiny-qwen2-tools"))).eval()
    engine = HFEngine(model, tokenizer)
    prompt = _prompt(tokenizer)
    (free,) = engine.generate([prompt], SamplingParams(max_tokens=24, greedy=True))
    stop = free.token_ids[len(free.token_ids) // 2]
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=24, greedy=True, stop_token_ids=(stop,)))
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1] and stopped.finished


class Again:
    """An environment that always asks for another answer."""

    def reset(self, row):
        pass

    def step(self, text):
        return "again", 0.0, False


class _ByTurns:
    """A vLLM engine seen without `generate_continuing`: the loop then makes one engine call per turn."""

    def __init__(self, engine):
        self.engine, self.name = engine, engine.name
        self.capabilities = dataclasses.replace(engine.capabilities, continuous_batching=False)

    def generate(self, prompts, params, multi_modal=None):
        return self.engine.generate(prompts, params, multi_modal=multi_modal)


def test_with_vllm_every_turn_joins_one_continuous_batch(tokenizer):
    import postrl.rollout.vllm_platform as vllm_platform

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - only on machines without a working vLLM
        pytest.skip(f"vLLM is unavailable here: {exc}")
    from postrl.config import RolloutConfig
    from postrl.models import load_model
    from postrl.rollout.vllm import VLLMEngine

    # The untrained tiny model ends a turn with EOS now and then; the environment answers "again", so those
    # trajectories go on to a second and third turn.
    model = load_model(str(build_tiny_model("tiny-qwen2-tools"))).eval()
    engine = VLLMEngine(model, tokenizer, RolloutConfig(kv_cache_space_gb=0.25, max_num_seqs=256, enforce_eager=True), max_model_len=512)
    cfg = MultiTurnConfig(enable=True, tools=["builtin:calculator"], interaction=f"{__name__}:Again", max_turns=3)
    try:
        loop, by_turns = AgentLoop(engine, tokenizer, cfg, model=model), AgentLoop(_ByTurns(engine), tokenizer, cfg, model=model)
        prompts, rows = [_prompt(tokenizer)] * 16, [{}] * 16
        sampled = SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=3)
        out = loop.generate(prompts, sampled, rows=rows)
        assert [c.prompt_index for c in out] == [i for i in range(16) for _ in range(4)]
        assert sum(len(c.turn_spans) > 1 for c in out) >= 4  # measured 7 of 64
        for c in out:  # the trajectory layout of the turn-by-turn loop: model turns (mask 1, engine log-probs) and masked tool turns
            assert len(c.token_ids) == len(c.loss_mask) == len(c.logprobs) <= 64
            assert [i for s, e in c.turn_spans for i in range(s, e)] == [i for i, m in enumerate(c.loss_mask) if m]
            assert all(lp < 0 if m else lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask))
            if len(c.turn_spans) > 1:
                assert "user\nagain" in tokenizer.decode([i for i, m in zip(c.token_ids, c.loss_mask) if not m])
        assert [c.token_ids for c in loop.generate(prompts, sampled, rows=rows)] == [c.token_ids for c in out]  # seeded: reproducible
        greedy = SamplingParams(max_tokens=64, greedy=True)
        continuous, per_turn = (lp.generate(prompts[:2], greedy, rows=rows) for lp in (loop, by_turns))
        assert [c.token_ids for c in continuous] == [c.token_ids for c in per_turn]  # the same rollout either way
    finally:
        engine.close()
