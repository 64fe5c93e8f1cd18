"""Tools (schemas from type hints and docstrings, built-ins, calls under a time limit) and the
Hermes / Qwen tool-call parser, on hand-written model output."""

from __future__ import annotations

import pytest

from postrl.agents import CallStats, ToolCall, ToolResult, call_tool, load_tools, parse_tool_calls
from postrl.toolcall import ParseError
from postrl.errors import UserError


@pytest.fixture(scope="module")
def tools():
    return load_tools(["builtin:python", "builtin:calculator", "tools_for_tests:add", "tools_for_tests:lookup",
                       "tools_for_tests:fails", "tools_for_tests:hangs"])


# ------------------------------------------------------------------------------------------ loading


def test_a_typed_user_function_gets_its_schema_from_hints_and_docstring(tools):
    assert list(tools) == ["python", "calculator", "add", "lookup", "fails", "hangs"]
    assert tools["add"].spec == "tools_for_tests:add" and not tools["add"].builtin
    assert tools["add"].schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number."},
                },
                "required": ["a"],
            },
        },
    }
    units = tools["lookup"].schema["function"]["parameters"]["properties"]["units"]
    assert units["type"] == "array" and units["items"] == {"type": "string"} and units["nullable"] is True


def test_builtin_schemas_show_the_model_only_its_own_arguments(tools):
    python = tools["python"].schema["function"]
    assert python["name"] == "python" and python["parameters"]["required"] == ["code"]
    assert list(python["parameters"]["properties"]) == ["code"]  # timeout_s is the loop's, not the model's
    calc = tools["calculator"].schema["function"]
    assert calc["parameters"]["properties"]["expression"]["type"] == "string"


def test_a_function_without_a_docstring_is_a_user_error_that_says_what_is_needed():
    with pytest.raises(UserError) as exc:
        load_tools(["tools_for_tests:undocumented"])
    msg = str(exc.value)
    assert "tools_for_tests:undocumented" in msg and "no docstring" in msg
    assert "type hint on every argument" in msg and "'Args:' section" in msg


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_such_module_xyz:f", ["could not be loaded", "ModuleNotFoundError", "PYTHONPATH"]),
        ("tools_for_tests:missing", ["could not be loaded", "AttributeError"]),
        ("tools_for_tests:NOT_A_FUNCTION", ["is a int, not a function"]),
        ("builtin:shell", ["unknown built-in tool 'builtin:shell'", "builtin:python, builtin:calculator"]),
        ("calculator", ["is not a tool name", "package.module:function"]),
    ],
)
def test_unknown_or_unimportable_names_are_one_paragraph_user_errors(spec, words):
    with pytest.raises(UserError) as exc:
        load_tools([spec])
    msg = str(exc.value)
    assert "\n" not in msg and spec in msg
    for w in words:
        assert w in msg, msg


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(UserError, match="two tools are named 'add'"):
        load_tools(["tools_for_tests:add", "tools_for_tests:add"])


# ------------------------------------------------------------------------------------------ calling


def test_a_user_tool_returns_text(tools):
    assert call_tool(tools, "add", {"a": 2, "b": 0.5}, 5) == ToolResult("2.5", "ok")
    assert call_tool(tools, "lookup", {"city": "Paris", "units": None}, 5) == ToolResult(
        '{"city": "Paris", "temperature": 21, "units": ["celsius"]}', "ok"
    )
    assert call_tool(tools, "add", '{"a": 1}', 5) == ToolResult("2.0", "ok")  # arguments as a JSON string


def test_bad_arguments_come_back_as_text_for_the_model(tools):
    assert call_tool(tools, "add", {"b": 1}, 5) == ToolResult("cannot call 'add': missing required argument 'a'", "error")
    res = call_tool(tools, "add", {"a": "1", "c": 3}, 5)
    assert res.status == "error"
    assert "argument 'a' must be integer, got str '1'" in res.text and "unknown argument 'c' (arguments: a, b)" in res.text
    assert call_tool(tools, "add", {"a": True}, 5).status == "error"  # a JSON boolean is not an integer
    assert call_tool(tools, "nope", {}, 5) == ToolResult(
        "unknown tool 'nope'; available tools: python, calculator, add, lookup, fails, hangs", "error"
    )


def test_a_tool_that_raises_costs_that_call_only(tools):
    stats = CallStats()
    assert call_tool(tools, "fails", {"x": 7}, 5, stats=stats) == ToolResult("RuntimeError: no luck with 7", "error")
    assert call_tool(tools, "add", {"a": 1}, 5, stats=stats).status == "ok"
    assert stats.as_metrics("tools") == {"tools/success": 1, "tools/error": 1, "tools/timeout": 0}


def test_a_tool_that_hangs_times_out(tools):
    stats = CallStats()
    res = call_tool(tools, "hangs", {"seconds": 5.0}, 0.2, stats=stats)
    assert res == ToolResult("tool 'hangs' timed out after 0.2 s", "timeout")
    assert stats.timeout == 1
    assert call_tool(tools, "add", {"a": 1}, 5).status == "ok"  # the next call is not held up


def test_long_results_are_cut(tools):
    res = call_tool(tools, "python", {"code": "print('y' * 500)"}, 10, max_chars=100)
    assert res.status == "ok" and res.text == "y" * 100 + "\n[output cut at 100 characters]"


def test_builtin_python_returns_stdout_or_the_error(tools):
    assert call_tool(tools, "python", {"code": "print(sum(range(10)))"}, 10) == ToolResult("45\n", "ok")
    res = call_tool(tools, "python", {"code": "print('before')\n1 / 0"}, 10)
    assert res.status == "error"
    assert res.text.startswith("before\n") and res.text.endswith("ZeroDivisionError: division by zero")
    res = call_tool(tools, "python", {"code": "while True:\n    pass"}, 1.0)
    assert res == ToolResult("[timed out after 1 s]", "timeout")


def test_sandbox_limits_reach_the_python_tool():
    tools = load_tools(["builtin:python"], sandbox_limits={"max_output_bytes": 10})
    res = call_tool(tools, "python", {"code": "print('z' * 50)"}, 10)
    assert res.status == "error" and res.text.startswith("z" * 10 + "\n[output cut at 10 bytes")
    with pytest.raises(UserError, match="unknown sandbox limit.s. memory_gb"):
        load_tools(["builtin:python"], sandbox_limits={"memory_gb": 1})


def test_the_sandbox_settings_have_one_set_of_defaults():
    """rollout.multi_turn.sandbox and the backends' SandboxLimits name the same settings with the same defaults."""
    from dataclasses import asdict

    from postrl.config import SandboxConfig
    from postrl.sandbox_limits import SandboxLimits

    assert SandboxConfig().model_dump() == asdict(SandboxLimits())


@pytest.mark.parametrize(
    "expression, text",
    [
        ("2 + 3 * 4", "14"),
        ("(3 + 4) * 2**10 / 7", "1024.0"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("2 ** -1", "0.5"),
        ("2**100", "1267650600228229401496703205376"),
        (" 1.5 * -(2 - 4) ", "3.0"),
    ],
)
def test_calculator_on_good_input(tools, expression, text):
    assert call_tool(tools, "calculator", {"expression": expression}, 1) == ToolResult(text, "ok")


@pytest.mark.parametrize(
    "expression, words",
    [
        ("2**99999999", "too large"),
        ("(2**4000)**4000", "too large"),
        ("10**1000 * 10**1000 * 10**1000 * 10**1000 * 10**1000", "too large"),
        ("__import__('os')", "a function call is not allowed"),
        ("os.system('ls')", "a function call is not allowed"),
        ("x + 1", "the name 'x' is not allowed"),
        ("[1] * 10**9", "List is not allowed"),
        ("'a' * 3", "the constant 'a' is not allowed"),
        ("True + 1", "the constant True is not allowed"),
        ("1 / 0", "ZeroDivisionError"),
        ("10.0 ** 400", "OverflowError"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "complex"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "too many nested parentheses"),
        ("-" * 990 + "1", "nested too deeply"),
        ("1+" * 600 + "1", "too long"),
    ],
)
def test_calculator_refuses_hostile_input(tools, expression, words):
    res = call_tool(tools, "calculator", {"expression": expression}, 1)
    assert res.status == "error" and words in res.text, res.text


# -------------------------------------------------------------------------------------------- parse


def test_one_call_as_qwen_emits_it():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2 + 2"})]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is 4.") == []


def test_several_calls_in_one_turn_keep_their_order():
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert parse_tool_calls(text, ["add", "lookup"]) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"city": "Oslo"})]


def test_arguments_as_a_json_string_or_missing_are_accepted():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call><tool_call>{"name": "now"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 3}), ToolCall("now", {})]


def test_a_call_cut_off_at_its_closing_tag_is_accepted():
    assert parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n') == [ToolCall("add", {"a": 1})]


@pytest.mark.parametrize(
    "text, words",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "the tool call: it is not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'the tool call: it has no "name"'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'it has no "name"'),
        ('<tool_call>["add", {"a": 1}]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', '"arguments" is a string that is not valid JSON'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object, got a JSON list'),
        ("<tool_call>\n</tool_call>", "it is empty"),
        ('<tool_call>{"name": "add"', "no closing </tool_call>"),
        ('{"name": "add"}</tool_call>', "found </tool_call> without a matching <tool_call>"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "there is no tool named 'search' (available tools: add, lookup)"),
    ],
)
def test_malformed_calls_give_a_message_for_the_model(text, words):
    out = parse_tool_calls(text, ["add", "lookup"])
    assert isinstance(out, ParseError), out
    assert words in out.message, out.message
    assert out.message.endswith('{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}\n</tool_call>')


def test_the_message_names_which_of_several_calls_is_wrong():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {</tool_call>'
    out = parse_tool_calls(text)
    assert isinstance(out, ParseError) and "tool call 2: it is not valid JSON" in out.message
    assert "tool call 1" not in out.message


def test_parsed_calls_feed_call_tool(tools):
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    (call,) = parse_tool_calls(text, tools)
    assert call_tool(tools, call.name, call.arguments, 1) == ToolResult("42", "ok")
