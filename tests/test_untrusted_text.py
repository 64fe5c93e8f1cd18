"""Every reader of model-written text, fed generated hostile text: it returns, in bounded time, and never raises.

An RL policy explores, so it writes degenerate text on its own: thousands of brackets, a number with a
billion digits, a megabyte of one character, invalid UTF-8 (decoded with U+FFFD, or with lone surrogates
by a client that relays it), control characters and NUL. One property test per consumer (DESIGN.md
section 13, docs/reliability.md "Model-written text"): tool-call parsing (the agent loop's and the
endpoint's), the endpoint's message comparison, tool arguments, answer extraction, number parsing, every
built-in verifier's fast path, math equivalence's quick verdict, stop cutting, the agent loop's rendering,
the reward model's and the judge's inputs. The bound on time is hypothesis' deadline (generous: the
readers are linear, a megabyte costs tens of milliseconds) and pytest-timeout behind it for a hang; the
examples the issue found by probing are pinned with `@example` and with numbers in the plain tests below.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from postrl.toolcall import MAX_CALLS, ParseError, ToolCall, parse_tool_calls
from postrl.agents.loop.render import TurnRenderer, truncate_text
from postrl.agents.session import norm_tool_calls, same_message
from postrl.agents.tools.tools import call_tool, load_tools
from postrl.builtin.tiny import build_tiny_model
from postrl.config import MultiTurnConfig
from postrl.rewards.equivalence import quick_equal
from postrl.rewards.gsm8k import extract_flexible, extract_strict
from postrl.rewards.judge import fit_response
from postrl.rewards.math import extract_dapo_answer
from postrl.rewards.registry import MAX_IN_PROCESS_CHARS, RewardFunction, get_entry, registered_verifiers
from postrl.rewards.reward_model import encode
from postrl.rewards.text import last_boxed, minerva_normalize, normalize_math, numbers_equal, parse_number, simple_value
from postrl.rewards.verdict import VerifierResult
from postrl.rollout.base import SamplingParams, cut_at_stop
from postrl.untrusted import REWARD_UNREADABLE, Unreadable, exact_value, load_json, pop_tripped

MB = 1 << 20
# Pieces a degenerate policy repeats: brackets, the readers' own markers, huge numbers, control characters,
# U+FFFD and lone surrogates (what invalid UTF-8 decodes to), right-to-left marks, astral characters.
ATOMS = [
    "[", "{", "(", "}", "]", ")", "\\boxed{", "\\fbox{", "\\boxed ", "\\boxedx", "\\text{", "\\frac{", "\\frac", "\\left(",
    "<tool_call>", "</tool_call>", '{"name": "calculator", "arguments": ', '"', '\\"', "\\", "9", "0", "1e999999999",
    "1e-999999999", "-", "+", ".", ",", ",000", "e", "E", "/", "^", "####", "#### ", " ", "\t", "$", "\n", "Answer:", "=",
    "\x00", "\x07", "\x1b[2J", "\x7f", "\ufffd", "\ud800", "\udfff", "\udc80", "\U0001d7d8", "\u202e", "NaN", "Infinity",
]  # fmt: skip
SETTINGS = settings(
    max_examples=25, deadline=timedelta(seconds=10), derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)  # fmt: skip


@st.composite
def hostile(draw, max_chars: int = MB) -> str:
    """Up to `max_chars` of text: runs of the atoms (one run may be the whole megabyte), random text, and
    random bytes decoded as a model's tokenizer (U+FFFD) or a relaying client (surrogate escapes) would."""
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["run", "run", "text", "bytes"]))
        if kind == "run":
            atom = draw(st.sampled_from(ATOMS))
            parts.append(atom * draw(st.sampled_from([1, 7, 300, 5000, max_chars // len(atom)])))
        elif kind == "text":
            parts.append(draw(st.text(max_size=200)))
        else:
            raw = draw(st.binary(max_size=200))
            parts.append(raw.decode("utf-8", draw(st.sampled_from(["replace", "surrogateescape"]))))
    return "".join(parts)[:max_chars]


# The faults found by probing main (issue 60), each pinned as an example of the consumer that had it.
DEEP_CALL = "<tool_call>" + "[" * 5000
HUGE_NUMBER = "\\boxed{1e999999999}"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2-tools"))


# ------------------------------------------------------------------------------- tool calls
@pytest.mark.timeout(300)
@SETTINGS
@given(text=hostile())
@example(text=DEEP_CALL)
@example(text='<tool_call>{"name": "calculator", "arguments": ' + "{" * 100_000)
@example(text='<tool_call>{"name": "calculator", "arguments": {"expression": 1e999999}}</tool_call>')
@example(text="<tool_call></tool_call>" * 40_000)
def test_tool_call_parser_reads_hostile_text(text):
    """toolcall.py (the agent loop's `_parse`, the endpoint's `respond`, samples.py): a list of calls whose
    arguments serialise back as strict JSON (what `respond` sends), or an error message of bounded size."""
    for names in (None, {"calculator"}):
        out = parse_tool_calls(text, names)
        if isinstance(out, ParseError):
            assert out.message.startswith("Your tool call could not be run") and len(out.message) < 64 * 1024
        else:
            assert len(out) <= MAX_CALLS and all(isinstance(c, ToolCall) for c in out)
            for c in out:
                json.dumps(c.arguments, allow_nan=False)


def test_a_deep_call_is_the_turns_error_and_the_trajectory_goes_on(tokenizer):
    """The issue's probe: `<tool_call>` + 5000 `[` raised RecursionError out of the agent loop (the run died).
    Now the model reads an error, its next turn runs, and the step's metrics count one unreadable call."""
    from test_agents import ScriptEngine, _prompt

    engine = ScriptEngine(tokenizer, [DEEP_CALL + "</tool_call>", "\\boxed{1}<|im_end|>"])
    from postrl.agents.loop.loop import AgentLoop

    loop = AgentLoop(engine, tokenizer, MultiTurnConfig(enable=True, tools=["builtin:calculator"]))
    (c,) = loop.generate([_prompt(tokenizer)], SamplingParams(max_tokens=20_000, greedy=True))
    tool_text = tokenizer.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])
    assert "it cannot be read: it nests deeper than 64 levels" in tool_text
    assert c.finished and len(c.turn_spans) == 2
    m = loop.pop_metrics()
    assert (m["agent/unreadable"], m["agent/tool_error"], m["agent/tool_ok"]) == (1.0, 1.0, 0.0)
    assert loop.pop_metrics()["agent/unreadable"] == 0.0  # popped once, per step
    assert parse_tool_calls(DEEP_CALL).unreadable and not parse_tool_calls("<tool_call>{</tool_call>").unreadable


@pytest.mark.timeout(300)
@SETTINGS
@given(arguments=hostile())
@example(arguments="[" * 100_000)
@example(arguments='{"a": ' * 10_000)
def test_endpoint_message_comparison_reads_hostile_arguments(arguments):
    """agents/session.py: a program's tool call sent back with hostile `arguments` is compared, never raised on
    (the endpoint answered 500 where json.loads recursed)."""
    msg = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "calculator", "arguments": arguments}}]}
    ((name, args),) = norm_tool_calls(msg["tool_calls"])
    assert name == "calculator" and (args == arguments or isinstance(args, (dict, list, str, int, float, bool, type(None))))
    assert same_message(msg, msg)


@pytest.mark.timeout(300)
@SETTINGS
@given(arguments=hostile(max_chars=MB // 4))
@example(arguments='{"expression": "' + "9" * 5000 + '"}')
@example(arguments='{"expression": ' + "[" * 5000)
def test_tool_arguments_from_text_are_read_under_limits(arguments):
    """agents/tools/tools.py: a call whose arguments come as a JSON string (a program's) is a ToolResult, never raised."""
    result = call_tool(load_tools(["builtin:calculator"]), "calculator", arguments, timeout_s=5.0)
    assert result.status in ("ok", "error") and len(result.text) <= 17_000


def test_load_json_caps_size_depth_and_numbers():
    assert load_json('{"a": [1, 2.5, {"b": null}]}') == {"a": [1, 2.5, {"b": None}]}
    for text, why in [
        ("[" * 5000, "nests deeper than 64"), ("[" * 65 + "]" * 65, "nests deeper than 64"),
        ('{"x": 1e999}', "not finite"), ('{"x": NaN}', "not a JSON number"), ("1" * (MB + 1), "characters long"),
    ]:  # fmt: skip
        with pytest.raises(Unreadable, match=why):
            load_json(text)
    assert load_json("[" * 64 + "]" * 64) is not None
    with pytest.raises(ValueError):
        load_json("9" * 5000)  # past Python's 4300 digits: json's own ValueError, not a slow integer


# ------------------------------------------------------------------------------- answers and numbers
@pytest.mark.timeout(300)
@SETTINGS
@given(text=hostile())
@example(text="\\boxedx" * 150_000)
@example(text="#### " + " " * MB + "x")
@example(text="\\boxed{" + "{" * MB)
@example(text="1," * (MB // 2))
def test_answer_extraction_reads_hostile_text(text):
    """rewards/text.py, rewards/math.py, rewards/gsm8k.py: what each extractor finds is a piece of the text, or
    nothing. `#### ` then a megabyte of spaces took hours (two `\\s*` around `\\$?` backtracked); `\\boxedx`
    repeated was quadratic."""
    boxed = last_boxed(text)
    assert boxed is None or boxed in text
    dapo = extract_dapo_answer(text)
    assert dapo is None or dapo in text
    for number in (extract_strict(text), extract_flexible(text)):
        assert number is None or number.is_finite()
    assert isinstance(normalize_math(text), str) and isinstance(minerva_normalize(text[-300:]), str)


@pytest.mark.timeout(300)
@SETTINGS
@given(s=st.one_of(hostile(max_chars=200), st.from_regex(r"[-+]?\d{1,60}(\.\d{0,30})?([eE][-+]?\d{1,12})?", fullmatch=True)))
@example(s="1e999999999")
@example(s="1e-999999999")
@example(s="-9.9e-999999999")
@example(s="\\frac{" + "9" * 60 + "}{7}")
def test_numbers_are_parsed_and_compared_without_being_expanded(s):
    """rewards/text.py: `Fraction(Decimal("1e-999999999"))` builds a billion-digit integer; exact values are
    taken only under untrusted.MAX_EXPONENT, and comparisons run in a context that neither overflows nor expands."""
    num = parse_number(s)
    if num is not None:
        assert numbers_equal(num, num)
        assert isinstance(numbers_equal(num, Decimal("2.5")), bool) and isinstance(numbers_equal(num, Decimal("1e-999999999")), bool)
    value = simple_value(s)
    assert value is None or isinstance(value[0], Fraction)


def test_huge_numbers_cost_nothing_and_are_counted():
    assert exact_value(Decimal("1e999999999")) is None and exact_value(Decimal("1e-999999999")) is None
    assert exact_value(Decimal("-1.25e3")) == Fraction(-1250)
    assert numbers_equal(Decimal("1e999999999"), Decimal("1.0e999999999"))
    assert not numbers_equal(Decimal("1e999999999"), Decimal("1e999999998"))
    pop_tripped(REWARD_UNREADABLE)
    assert quick_equal("1e999999999", "x+1") is False  # was: hours in the trainer's process
    assert quick_equal("1e-999999999", "\\frac{\\pi}{2}") is False
    assert quick_equal("1e999999999", "1e999999999") is True and quick_equal("1e999999999", "10") is False
    assert quick_equal("0.5", "\\frac{1}{2}") is True  # ordinary answers are unchanged
    assert pop_tripped(REWARD_UNREADABLE) == 2 and pop_tripped(REWARD_UNREADABLE) == 0


# ------------------------------------------------------------------------------- the verifiers' fast paths
FAST = sorted(n for n in registered_verifiers() if get_entry(n).fast is not None or get_entry(n).in_process)
TRUTHS = ["42", "x+1", "\\frac{\\pi}{2}", "1e999999999", "\\boxed{3}", "Solution. #### 1,600"]


@pytest.mark.timeout(600)
@SETTINGS
@given(text=hostile(), truth=st.sampled_from(TRUTHS))
@example(text=HUGE_NUMBER, truth="x+1")
@example(text="\\boxed{1e-999999999}", truth="\\frac{1}{2}")
@example(text="Answer: " + "(" * 5000, truth="42")
@example(text="\\boxed{" + "9" * MB + "}", truth="42")
@example(text="Answer: " + "1e999999999 " * 80_000, truth="x+1")
def test_every_built_in_fast_path_reads_hostile_text(text, truth):
    """rewards/registry.py runs these in the trainer's process without a time limit: each gives a verdict or
    None (to the pool), never raises. Rows name verl_default's sources."""
    for name in FAST:
        entry = get_entry(name)
        if not entry.fn.__module__.startswith("postrl."):  # a test module's verifier, registered earlier in this worker
            continue
        for row in ({"data_source": "openai/gsm8k"}, {"data_source": "lighteval/MATH"}, {"data_source": "math_dapo"}):
            out = entry.fn(text, truth, row) if entry.in_process else entry.fast(text, truth, row)
            assert out is None or (isinstance(out, VerifierResult) and math.isfinite(out.score)), name


@pytest.mark.timeout(300)
@SETTINGS
@given(pred=hostile(max_chars=MB // 4), truth=st.one_of(st.sampled_from(TRUTHS), hostile(max_chars=300)))
@example(pred="1e999999999", truth="x+1")
@example(pred="[" * 5000, truth="5")
@example(pred="9" * (MB // 4), truth="\\frac{1}{2}")
def test_math_equivalence_quick_verdict_reads_hostile_text(pred, truth):
    """rewards/equivalence.py: the verdict the trainer's process decides (math-verify itself runs in the pool,
    under reward.timeout_s and its memory limit)."""
    assert quick_equal(pred, truth) in (True, False, None)


def test_reward_function_scores_a_huge_number_in_process_and_counts_it():
    """The issue's probe through the whole tier 1: `\\boxed{1e999999999}` against a formula is scored wrong in
    the trainer's process at once (no worker pool started), counted in reward/unreadable; a completion past
    MAX_IN_PROCESS_CHARS is left to the pool, where reward.timeout_s applies."""
    from postrl.config import RewardConfig

    cfg = RewardConfig(verifiers=[{"name": "math_17k_acc", "weight": 1.0}])
    with RewardFunction(cfg) as fn:
        out = fn([HUGE_NUMBER, "\\boxed{x+1}"], ["x+1", "x+1"], [{}, {}])
        assert out.scores == [0.0, 1.0] and fn._pool is None
        assert out.failures["reward/unreadable"] == 1 and out.failures["reward/errors"] == 0
        name, _, entry = fn.verifiers[0]
        assert fn._in_process(name, entry, "\\boxed{5}" * (MAX_IN_PROCESS_CHARS // 9 + 1), "5", {}) is None
        assert fn._in_process(name, entry, "\\boxed{5}", "5", {}).score == 1.0


# ------------------------------------------------------------------------------- stop cutting and rendering
@pytest.mark.timeout(300)
@SETTINGS
@given(text=hostile(max_chars=20_000), stop=st.sampled_from(["</tool_call>", "\n\n", "}}", "$", "\\boxed"]))
def test_stop_cutting_reads_hostile_turns(tokenizer, text, stop):
    """rollout/base.py `cut_at_stop` (the endpoint's `stop`, the loop's `</tool_call>` without its own token):
    a prefix of the ids whose text holds the stop, and no shorter prefix does (the loop decoded every prefix)."""
    ids = tokenizer(text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False)["input_ids"]
    cut, hit = cut_at_stop(tokenizer, ids, [stop])
    assert cut == ids[: len(cut)]
    if hit:
        assert stop in tokenizer.decode(cut) and stop not in tokenizer.decode(cut[:-1])
    else:
        assert cut == ids and stop not in tokenizer.decode(ids)


@pytest.mark.timeout(300)
@SETTINGS
@given(text=hostile(max_chars=64 * 1024))
@example(text="\ud800 lone surrogate from a client")
def test_the_agent_loops_rendering_reads_hostile_text(tokenizer, text):
    """agents/loop/render.py: tool output and an environment's or client's message rendered with the chat template;
    a tokenizer raises on lone surrogates, so they are replaced first. The ids decode back to the text."""
    renderer = TurnRenderer(tokenizer)
    shown = truncate_text(tokenizer, text, 50)
    note = len(tokenizer("\n[output cut at 50 tokens]", add_special_tokens=False)["input_ids"])
    assert len(tokenizer(shown, add_special_tokens=False)["input_ids"]) <= 50 + note + 4  # + a character cut in two
    for ids in (renderer.tool_turn([("calculator", text)], None), renderer.user_turn(text, None)):
        assert all(isinstance(i, int) for i in ids) and len(ids) > 0


# ------------------------------------------------------------------------------- the judge's and RM's inputs
@pytest.mark.timeout(300)
@SETTINGS
@given(text=hostile(max_chars=64 * 1024))
@example(text="\ud800" * 1000)
def test_reward_model_and_judge_inputs_read_hostile_text(tokenizer, text):
    """rewards/reward_model.py `encode` (the RM's ids, cut from the left) and rewards/judge.py `fit_response`
    (the response in at most the policy's budget of the judge's tokens, so its prompt fits its engine)."""
    batch = encode(tokenizer, [text, "short"], max_length=32)
    assert batch["input_ids"].shape[1] <= 32 and int(batch["attention_mask"].sum()) >= 1
    fitted = fit_response(tokenizer, text, 40)
    assert len(tokenizer(fitted, add_special_tokens=False)["input_ids"]) <= 40
    assert fit_response(tokenizer, "short answer", 40) == "short answer"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", ["\\boxed{" + "[" * 5000, "\\frac{" * 3000, "(" * 49 + "1" + ")" * 49])
def test_math_verify_is_never_asked_to_parse_brackets_nested_past_the_cap(text):
    """math-verify's LaTeX parser spent 48 s on a \\boxed{ of 5000 `[`: nesting past MAX_MATH_DEPTH (48) is scored
    wrong and counted before any parse, in math_equal and in completion_matches; 48 levels still parse."""
    from postrl.rewards.equivalence import completion_matches, math_equal

    pop_tripped(REWARD_UNREADABLE)
    assert math_equal(text, "1") is False and completion_matches(text, "1") is False
    assert pop_tripped(REWARD_UNREADABLE) == 2
    assert math_equal("\\frac{1}{(" + "(" * 46 + "2" + ")" * 47 + "}", "0.5") is True  # 48 levels: math-verify reads it
    assert pop_tripped(REWARD_UNREADABLE) == 0


@pytest.mark.parametrize("value", ["[" * 10_000, '{"name": ' + "9" * 2_000_000 + "}", "1e999", '"calc"'])
def test_a_sft_trace_function_call_that_is_not_readable_json_is_the_rows_named_error(value):
    """Dataset rows are hostile too: a ShareGPT function_call's JSON is read under the model-text caps and anything
    but an object is a one-paragraph error naming the row and message, never a RecursionError."""
    from postrl.data.traces import normalize_messages
    from postrl.errors import UserError

    with pytest.raises(UserError, match=r"row 7: message 1 is a function_call"):
        normalize_messages([{"from": "human", "value": "hi"}, {"from": "function_call", "value": value}], "row 7")


@pytest.mark.parametrize("value", [2**1024, 10**400, math.nan, math.inf, {"score": 2**1024}, {"score": -math.inf}])
def test_a_verdict_that_is_no_finite_float_is_invalid_not_a_crash(value):
    """A reward function's return is validated like a program's (issue 60): an int past a float's range is an
    InvalidVerdict (counted as reward/invalid, scored fail_score), not an OverflowError out of the verdict."""
    from postrl.rewards.verdict import InvalidVerdict, to_result

    with pytest.raises(InvalidVerdict):
        to_result(value)


def test_a_verdicts_metric_past_a_floats_range_is_nan_not_a_crash():
    from postrl.rewards.verdict import to_result

    got = to_result({"score": 1, "huge": 2**1024, "inf": -math.inf, "fine": 0.25, "flag": True})
    assert got.score == 1.0 and math.isnan(got.metrics.pop("huge"))
    assert got.metrics == {"inf": -math.inf, "fine": 0.25, "flag": 1.0, "acc": 1.0}
