"""Verifiers environments (`rollout.environment`, docs/agents.md): an environment of the `verifiers` library
runs in a process of its own, usually in a side venv.

- `env.py`: the parent side, the environment's process, its dataset rows and rewards, served through the
  endpoint (agents/endpoint/);
- `worker.py`: the child side, run by path with the environment's interpreter;
- `python.py`: whether an interpreter can run the worker.
"""
