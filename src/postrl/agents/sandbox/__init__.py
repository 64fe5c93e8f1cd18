"""Where model-written code runs (docs/agents.md, DESIGN.md section 13).

- `sandbox.py`: the local backend, `run_python` in a fenced process tree (namespaces, seccomp, limits);
  `sandbox_description()` is the one line that says what is isolated on this machine;
- `_boot.py`: the first program inside the fence, run by path with a bare interpreter (it imports nothing of postrl);
- `fusion.py`: the remote backend, a SandboxFusion server over HTTP.
"""
