"""Tools, their sandbox and the tool-call parser of the multi-turn agent loop (docs/agents.md).

- `load_tools(specs)` / `call_tool(tools, name, arguments, timeout_s)`: tools by name, called under a
  time limit; errors come back as text for the model, never as exceptions.
- `parse_tool_calls(text)`: the Hermes / Qwen `<tool_call>` blocks of a model turn.
- `run_python(code, ...)`: model-written code in a fenced process tree; `sandbox_description()` is
  the one line that says what is isolated on this machine.
"""

from postrl.agents.parse import ParseError, ToolCall, parse_tool_calls
from postrl.agents.sandbox import CallStats, SandboxResult, run_python, sandbox_description
from postrl.agents.tools import Tool, ToolResult, call_tool, load_tools

__all__ = [
    "CallStats",
    "ParseError",
    "SandboxResult",
    "Tool",
    "ToolCall",
    "ToolResult",
    "call_tool",
    "load_tools",
    "parse_tool_calls",
    "run_python",
    "sandbox_description",
]
