"""Agents: engines around the policy's engine that run whole multi-turn episodes (docs/agents.md). One
sub-package per job; `wrap.py` picks the one that rollout config names (DESIGN.md section 2):

- `loop/`: postrl's own multi-turn loop (`rollout.multi_turn`): generate, parse tool calls, call tools, append;
  environments; tool turns rendered with the chat template;
- `tools/`: tools by name, called under a time limit, errors back as text for the model;
- `sandbox/`: where model-written code runs: a fenced local process tree, or a SandboxFusion server;
- `programs/`: user agent programs (`rollout.agent.program`), in threads or worker processes;
- `endpoint/`: the OpenAI-compatible endpoint those programs call (server, request schema, scheduler,
  answers, the gateway that serves them);
- `verifiers/`: verifiers environments in a process of their own, served through the endpoint.

Shared by several of them, at this level: `session.py` (one conversation's tokens, as the endpoint, the
programs and the loop append to it) and `results.py` (the checker of what programs, environments and tools
return). What the core shares with them stands below agents/, outside it: the tool-call format
(postrl/toolcall.py), token helpers (postrl/turns.py), child-process environments (postrl/children.py), the
sandbox's settings (postrl/sandbox_limits.py); the core imports nothing from agents/.

Re-exported here: `load_tools` / `call_tool`, `parse_tool_calls`, `run_python` / `sandbox_description`.
"""

from postrl.toolcall import ParseError, ToolCall, parse_tool_calls
from postrl.agents.sandbox.sandbox import CallStats, SandboxResult, run_python, sandbox_description
from postrl.agents.tools.tools import Tool, ToolResult, call_tool, load_tools

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
