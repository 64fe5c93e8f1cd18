"""Tools of the multi-turn loop and the endpoint (docs/agents.md): `tools.py` loads them by name
(`builtin:calculator`, `builtin:python`, a user's `module:function`) and calls them under a time limit;
errors come back as text for the model, never as exceptions. Code runs in agents/sandbox/.
"""
