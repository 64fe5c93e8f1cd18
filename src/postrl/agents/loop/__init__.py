"""postrl's own multi-turn loop (`rollout.multi_turn`, docs/agents.md).

- `loop.py`: `AgentLoop`, an engine around the engine: generate, parse tool calls, call tools, append, repeat;
- `env.py`: a user's environment class (reset / step / reward) and the counts of its calls;
- `render.py`: tool turns rendered with the chat template into tokens (also used by agents/endpoint/).

The tool-call format (postrl/toolcall.py) and the token helpers the core shares with it (postrl/turns.py)
stand below agents/, so the core imports nothing from here.
"""
