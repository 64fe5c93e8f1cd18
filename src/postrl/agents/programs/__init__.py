"""User agent programs (`rollout.agent.program`, docs/agents.md): `programs.py` loads the program and runs it
in threads of this process; `workers.py` runs it in worker processes started from a scrubbed environment
(postrl/children.py), `python -m postrl.agents.programs.workers`. The endpoint (agents/endpoint/) serves them.
"""
