"""The process a `verifiers` environment runs in: postrl starts it with the environment's own interpreter.

    python agents/verifiers/worker.py <environment> '<json of load_environment's args>'

A script of its own: it imports the standard library, `verifiers` (0.1.x, the classic API: an
`Environment` from `load_environment(**args)` with its dataset, multi-turn logic and rubric) and postrl's
ipc.py by its file path (`_load_ipc`), never postrl or torch, so it runs in a venv of its own
(docs/agents.md: verifiers 0.1.x pins packages postrl's other extras cannot share). postrl talks to it
through ipc.py's JSON frames on its stdin and stdout (the environment's own prints go to stderr):

    <- {"op": "ready", "env_id": ..., "group_rubric": bool}  (or {"op": "fatal", "error": ...})
    -> {"id": 1, "op": "dataset", "split": "train" | "eval"}
    <- {"id": 1, "rows": [{"prompt", "answer", "info", "task", "example_id"}, ...], "more": bool}
       (a frame of at most ~1 MiB of rows each; "more": false on the last; postrl refuses frames past 16 MiB)
    -> {"id": 2, "op": "rollout", "url": <session base URL>, "key": <session key>, "model": ..., "input": {...}}
    <- {"id": 2, "reward": float, "metrics": {name: float}, "error": str | null, "rubric_errors": int}
       (or {"id": 2, "exception": "Type: message"} when the rollout itself raised)

A rollout is `env.run_rollout(input, client, model, env.sampling_args)`: the environment's own loop (its
turns, tools, stop conditions) against an `AsyncOpenAI` client pointed at the sample's session on postrl's
endpoint, then its rubric's `score_rollout`; the reward is the rubric's weighted sum. Rollouts run
concurrently on one event loop. `rubric_errors` is the number of reward functions that raised so far
(verifiers scores them 0 and logs an error; this process counts those records).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path


CHUNK_BYTES = 1 << 20
MAX_REQUEST_BYTES = 1 << 30  # postrl's frames: trusted, as large as its dataset rows (a rollout's input)
MAX_REQUEST_DEPTH = 1000  # and as deep


def _load_ipc():
    """postrl/ipc.py (the frame channel of every postrl child), loaded from its file, two levels above this one.
    postrl is not installed in this interpreter's venv, and importing the package would pull in torch; ipc.py
    imports only the standard library, and being the very file postrl reads with, the two sides cannot drift
    apart (a path passed on the command line could name another postrl's)."""
    path = Path(__file__).resolve().parents[2] / "ipc.py"
    spec = importlib.util.spec_from_file_location("postrl_ipc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ipc = _load_ipc()


class _ErrorCounter(logging.Handler):
    """Counts verifiers' "Error calling reward function" records (a rubric function that raised)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "reward function" in record.getMessage():
            self.count += 1


def load(spec: str, args: dict):
    """The environment that `spec` names: an installed module or package (the Hub's environments are
    packages with `load_environment`), or a path to a .py file (its directory goes on sys.path)."""
    import verifiers as vf

    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        sys.path.insert(0, str(path.parent))
        spec = path.stem
    module = importlib.import_module(spec.replace("-", "_").split("/")[-1])  # as vf.load_environment: owner/my-env -> my_env
    if not hasattr(module, "load_environment"):
        raise AttributeError(f"the module '{spec}' ({getattr(module, '__file__', '?')}) has no load_environment function")
    env = module.load_environment(**args)
    if not isinstance(env, vf.Environment):
        raise TypeError(f"load_environment returned {type(env).__name__}, not a verifiers Environment")
    return env


def jsonable(value):
    return json.loads(json.dumps(value, default=str))


def dataset_rows(env, split: str) -> list[dict]:
    ds = env.get_dataset() if split == "train" else env.get_eval_dataset()
    keep = ("prompt", "answer", "info", "task", "example_id")
    return [jsonable({k: row.get(k) for k in keep if k in row}) for row in ds]


async def rollout(env, msg: dict, errors: _ErrorCounter) -> dict:
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    openai_client = AsyncOpenAI(base_url=msg["url"], api_key=msg["key"], max_retries=0, timeout=msg.get("timeout", 600))
    client = OpenAIChatCompletionsClient(openai_client)
    try:
        out = await env.run_rollout(msg["input"], client, msg["model"], dict(env.sampling_args))
    finally:
        await openai_client.close()
    error = out.get("error")
    metrics = {k: float(v) for k, v in (out.get("metrics") or {}).items() if isinstance(v, (int, float))}
    return {"reward": float(out.get("reward") or 0.0), "metrics": metrics, "error": None if error is None else str(error)[:500],
            "rubric_errors": errors.count}  # fmt: skip


async def serve(env, out, errors: _ErrorCounter) -> None:
    loop = asyncio.get_running_loop()
    tasks: set = set()

    def send(reply: dict) -> None:
        out.write(ipc.encode(reply))
        out.flush()

    async def handle(msg: dict) -> None:
        try:
            if msg["op"] == "dataset":
                rows, size, chunk = dataset_rows(env, msg["split"]), 0, []
                for row in rows:  # chunks of ~1 MiB: postrl caps a frame's length
                    chunk.append(row)
                    size += len(json.dumps(row))
                    if size > CHUNK_BYTES:
                        send({"id": msg["id"], "rows": chunk, "more": True})
                        size, chunk = 0, []
                reply = {"rows": chunk, "more": False}
            elif msg["op"] == "rollout":
                reply = await rollout(env, msg, errors)
            else:
                reply = {"exception": f"ValueError: unknown op {msg['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - the environment's own bug: reported, the worker goes on
            reply = {"exception": f"{type(exc).__name__}: {exc}"[:2000]}
        send({"id": msg["id"], **reply})

    while True:  # postrl's requests, read on a thread (ipc.py blocks) while the rollouts run on this loop
        try:
            msg = await loop.run_in_executor(None, ipc.recv, sys.stdin.fileno(), MAX_REQUEST_BYTES, None, MAX_REQUEST_DEPTH)
        except EOFError:  # postrl closed the channel: the end
            return
        task = asyncio.create_task(handle(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")  # the protocol's channel; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    spec, args = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    try:
        env = load(spec, args)
    except Exception as exc:  # noqa: BLE001 - said to postrl, which stops with a clear message
        out.write(ipc.encode({"op": "fatal", "error": f"{type(exc).__name__}: {exc}"[:2000]}))
        out.flush()
        sys.exit(3)
    errors = _ErrorCounter()  # after the import: verifiers' setup_logging clears its logger's handlers
    logging.getLogger("verifiers").addHandler(errors)
    out.write(ipc.encode({"op": "ready", "env_id": env.env_id or Path(spec).stem, "group_rubric": bool(env.requires_group_rollouts)}))
    out.flush()
    asyncio.run(serve(env, out, errors))


if __name__ == "__main__":
    main()
