"""`verifiers` environments as the rollout: `rollout.environment: verifiers:<module or package>`.

A verifiers environment (`load_environment(**args)`, the classic API of verifiers 0.1.x: a `ToolEnv`,
`MultiTurnEnv`, ... with a dataset and a rubric; what prime-rl's Environments Hub holds) runs in a process of its
own, started with `rollout.environment_python` (default: this interpreter when it imports verifiers), because
verifiers 0.1.x pins packages that postrl's other extras cannot share (docs/agents.md). That process is
`worker.py`, which imports only verifiers (and postrl/ipc.py by its path); postrl talks to it by ipc.py's JSON
frames (load, the dataset rows, run sample i against session URL u), capped and checked here (`read_reply`,
`check_reply`), and the environment talks to postrl only through the endpoint.

- Data: `data.train_files: [verifiers:train]` and `data.val_files: [verifiers:eval]` (the defaults with
  rollout.environment, config/rules.py) are the environment's dataset and eval_dataset as postrl rows
  (`dataset_rows`): its prompt messages, its answer as the ground truth, and the whole verifiers row in
  extra_info.verifiers (what the environment gets back per sample).
- Rollout: an `AgentGateway` (agents/endpoint/gateway.py) whose agent is `VerifiersAgent.run`, an async function that
  asks the worker to run the environment's rollout for that sample against the sample's session and returns
  the rubric's reward. So the gateway's containment holds: an environment that raises, hangs or loses its
  process scores 0 and is counted (agent/errors, agent/timeouts), never fatal.
- Metrics (`VerifiersEngine.pop_metrics`, beside the gateway's agent/*): reward/rubric (the rubric's mean
  reward over the samples it scored), rubric/<function> (each rubric function's and metric's mean),
  rubric/scored, rubric/failed (rollouts that raised or lost the worker), rubric/rollout_errors (rollouts
  in which verifiers recorded an error, e.g. a refused model request), rubric/function_errors (rubric
  functions that raised: verifiers scores them 0), rubric/worker_restarts.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import postrl.agents.results as results
from postrl import ipc
from postrl.children import child_env
from postrl.agents.verifiers.python import interpreter_problems
from postrl.errors import UserError, fails_nearly_always
from postrl.ipc import FrameError
from postrl.rollout.base import EngineWrapper

if TYPE_CHECKING:
    from postrl.config import RolloutConfig

WORKER = Path(__file__).with_name("worker.py")
MAX_REPLY_BYTES = 16 * 1024 * 1024  # one frame from the environment's process (the dataset comes in chunks below it)
MAX_DATASET_BYTES = 4 * 1024**3  # a dataset's chunks together
FRAME_TIMEOUT_S = 30.0  # from a frame's first byte to its last (the process writes a frame at once; a reply
# itself may take a rollout's time to begin: the gateway's rollout.agent_timeout_s bounds that)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_reply(op: str, msg: Any) -> None:
    """FrameError unless `msg` is a reply to `op` of the shape worker.py documents. The shape only: a reward
    or metric out of range (NaN, 1e400, 10**400) is that sample's error, not the process's (`VerifiersAgent.run`)."""
    ok = isinstance(msg, dict) and isinstance(msg.get("id"), int)
    if ok and "exception" in msg:
        ok = isinstance(msg["exception"], str)
    elif ok and op == "dataset":
        ok = isinstance(msg.get("rows"), list) and all(isinstance(r, dict) for r in msg["rows"]) and isinstance(msg.get("more", False), bool)
    elif ok and op == "rollout":
        metrics, error = msg.get("metrics"), msg.get("error")
        ok = (_number(msg.get("reward")) and isinstance(metrics, dict) and all(isinstance(k, str) and _number(v) for k, v in metrics.items())
              and (error is None or isinstance(error, str)) and isinstance(msg.get("rubric_errors", 0), int))  # fmt: skip
    if not ok:
        raise FrameError(f"a reply that is not of the protocol's shape: {str(msg)[:200]!r}")


def read_reply(channel: ipc.Channel) -> tuple[Any, int]:
    """The next frame's value from the environment's process and its length; (None, 0) when the channel ends.
    The frame may take any time to begin; once begun it must be whole within FRAME_TIMEOUT_S and at most
    MAX_REPLY_BYTES of JSON (FrameError otherwise: the process is then killed)."""
    poller = select.poll()
    poller.register(channel if isinstance(channel, int) else channel.fileno(), select.POLLIN)
    poller.poll()  # readable, or its writer gone (then the read below is the end)
    try:
        data = ipc.recv_bytes(channel, MAX_REPLY_BYTES, FRAME_TIMEOUT_S)
    except EOFError:
        return None, 0
    return ipc.loads(data), len(data)


class Worker:
    """The environment's process (worker.py): requests by id over its stdin, replies read by a thread, ipc.py
    frames both ways. A bad frame (too long, cut short, not JSON, of another shape) ends the process: its
    pending requests fail with the reason, and the next sample starts a new one (`VerifiersAgent`)."""

    def __init__(self, settings: dict, start_timeout_s: float = 600.0):
        problems = interpreter_problems(settings.get("python"))
        if problems:
            raise UserError(*problems)
        spec = settings["spec"]
        env = child_env(settings.get("passthrough") or (), {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"})
        python = str(Path(settings.get("python") or sys.executable).expanduser())
        # the channel: ipc.py frames on its stdin and stdout; its replies at most MAX_REPLY_BYTES (64 levels deep),
        # each whole within FRAME_TIMEOUT_S of its first byte (`read_reply`); ours to it trusted (worker.py's caps)
        self.proc = subprocess.Popen(
            [python, str(WORKER), spec, json.dumps(settings.get("args") or {})], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        self.bad_frame: str | None = None
        first: dict = {}
        reader = threading.Thread(target=lambda: first.update(self._read_first()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if first.get("op") != "ready":
            late = self.proc.poll() is None
            self.proc.kill()
            code = self.proc.wait()
            why = first.get("error") or (f"it was not ready within {start_timeout_s:.0f} s" if late else f"its process exited (code {code})")
            why += " (its own output: stderr, i.e. the console or logging.dir's postrl.log)" if not first.get("error") else ""
            raise UserError(
                f"rollout.environment 'verifiers:{spec}' did not load: {why}. postrl imports '{spec}' (an installed "
                "module or package, or a .py file) in rollout.environment_python and calls its load_environment("
                f"**rollout.environment_args) with {settings.get('args') or {}}. Fix: install the environment into that "
                "interpreter (e.g. `prime env install <name>` or pip), or correct the name or the arguments."
            )
        if first.get("group_rubric"):
            self.close()
            raise UserError(
                f"rollout.environment 'verifiers:{spec}': its rubric has group-level reward functions, which score a "
                "group of rollouts together; postrl runs and scores each rollout on its own. "
                "Fix: use per-rollout reward functions in the rubric."
            )
        self.env_id = str(first.get("env_id"))[:200]
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, concurrent.futures.Future]] = {}
        self._rows: dict[int, list] = {}  # a dataset reply's chunks so far
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="postrl-verifiers-reader", daemon=True).start()

    def _read_first(self) -> dict:
        try:
            msg, _ = read_reply(self.proc.stdout)
        except FrameError as exc:
            return {"error": f"it wrote {exc} instead of its ready frame"}
        if msg is not None and not isinstance(msg, dict):
            return {"error": f"it wrote {str(msg)[:200]!r} instead of its ready frame"}
        return msg or {}

    def _read(self) -> None:
        why, chunks = None, 0
        try:
            while (got := read_reply(self.proc.stdout))[1]:  # its length: a frame of JSON null is a reply too (to nothing)
                msg = got[0]
                with self._lock:
                    op, fut = self._pending.get(msg.get("id"), (None, None)) if isinstance(msg, dict) else (None, None)
                if fut is None:
                    raise FrameError(f"a reply to no request: {str(msg)[:200]!r}")
                check_reply(op, msg)
                if msg.get("more"):  # a dataset chunk: the rest follows under the same id
                    chunks += got[1]
                    if chunks > MAX_DATASET_BYTES:
                        raise FrameError(f"a dataset of more than {MAX_DATASET_BYTES} bytes")
                    self._rows.setdefault(msg["id"], []).extend(msg["rows"])
                    continue
                if "rows" in msg:
                    msg["rows"] = self._rows.pop(msg["id"], []) + msg["rows"]
                with self._lock:
                    self._pending.pop(msg["id"], None)
                if not fut.cancelled():
                    try:
                        fut.set_result(msg)
                    except concurrent.futures.InvalidStateError:  # cancelled meanwhile (the sample's time ran out)
                        pass
        except FrameError as exc:
            why = f"the verifiers environment's process sent {exc}; it was killed (the next sample starts a new one)"
        except BaseException as exc:  # noqa: BLE001 - the pending requests must hear of the end, whatever happened
            why = f"reading the verifiers environment's process failed ({type(exc).__name__}: {exc}); it was killed"
        self.bad_frame = why
        if why is not None:
            self.proc.kill()
        code = self.proc.wait()
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(why or f"the verifiers environment's process exited (code {code})"))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self.bad_frame is None

    def request(self, msg: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(RuntimeError(self.bad_frame or f"the verifiers environment's process exited (code {self.proc.returncode})"))
                return fut
            msg = {"id": next(self._ids), **msg}
            self._pending[msg["id"]] = (msg["op"], fut)
            try:
                self.proc.stdin.write(ipc.encode(msg))
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._pending.pop(msg["id"], None)
                fut.set_exception(RuntimeError(f"the verifiers environment's process is gone ({exc})"))
        return fut

    def close(self) -> None:
        """End the process: its stdin closes (it exits when its rollouts are done), killed after 2 s."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _to_row(r: dict, env_id: str, split: str, index: int) -> dict:
    answer = "" if r.get("answer") is None else str(r["answer"])
    return {
        "data_source": env_id, "prompt": r.get("prompt"),  # none: the data loader names the row
        "reward_model": {"style": "rubric", "ground_truth": answer.strip() or "-"},  # "-": the environment has no answer
        "extra_info": {"index": index, "split": split, "verifiers": r},
    }  # fmt: skip


_DATASETS: dict[str, list[dict]] = {}
_WORKERS: dict[str, Worker] = {}  # one environment process per settings, shared by the data and the engine
_WORKERS_LOCK = threading.Lock()


def _key(settings: dict) -> str:
    return json.dumps([settings["spec"], settings.get("args"), settings.get("python")], sort_keys=True, default=str)


def shared_worker(settings: dict) -> Worker:
    """This process's worker of `settings`, started on first use (loading the environment takes seconds) and
    again when the last one has died. It ends with this process (its stdin closes)."""
    key = _key(settings)
    with _WORKERS_LOCK:
        worker = _WORKERS.get(key)
        if worker is None or not worker.alive:
            if not _WORKERS:
                atexit.register(close_workers)
            worker = _WORKERS[key] = Worker(settings)
        return worker


def close_workers() -> None:
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for w in workers:
        w.close()


def dataset_rows(path: str, settings: dict | None) -> list[dict]:
    """Rows of 'verifiers:train' (the environment's dataset) or 'verifiers:eval' (its eval_dataset; verifiers
    falls back to the dataset when it has none), in the verl schema. Loaded once per process."""
    split = path.removeprefix("verifiers:")
    if settings is None:
        raise UserError(f"data file '{path}' is a verifiers environment's dataset, but rollout.environment is not set. Fix: set it, or name data files.")
    if split not in ("train", "eval"):
        raise UserError(f"data file '{path}': a verifiers environment has 'verifiers:train' and 'verifiers:eval'. Fix: name one of them.")
    key = _key(settings) + split
    if key not in _DATASETS:
        worker = shared_worker(settings)
        reply = worker.request({"op": "dataset", "split": split}).result()
        if "exception" in reply:
            raise UserError(f"rollout.environment 'verifiers:{settings['spec']}': building its {split} dataset failed ({reply['exception']}). Fix the environment or its arguments.")
        _DATASETS[key] = [_to_row(r, worker.env_id, split, i) for i, r in enumerate(reply["rows"])]
    return _DATASETS[key]


def rollout_input(row: dict) -> dict:
    """What the environment gets for a sample: its own row (extra_info.verifiers), or, for rows of other files,
    their prompt and ground truth."""
    own = (row.get("extra_info") or {}).get("verifiers")
    if own is not None:
        return own
    answer = (row.get("reward_model") or {}).get("ground_truth", "")
    return {"prompt": row.get("prompt"), "answer": "" if answer is None else str(answer), "info": {}, "example_id": 0}


class VerifiersAgent:
    """The agent function the gateway runs per sample (`run`), and the rubric's counts since `pop_metrics`."""

    MAX_RESTARTS = 3

    def __init__(self, cfg: "RolloutConfig", log: Any = None):
        self.settings = {"spec": cfg.environment.removeprefix("verifiers:").strip(), "args": dict(cfg.environment_args),
                         "python": cfg.environment_python, "passthrough": list(cfg.agent_env_passthrough)}  # fmt: skip
        self.timeout_s, self.log = cfg.agent_timeout_s, log
        self.worker = shared_worker(self.settings)  # a bad environment stops the run here, before any rollout
        self._restart_lock = threading.Lock()
        self._lock = threading.Lock()
        self.restarts = self._function_errors = 0  # in the run so far
        self._reported: dict[int, int] = {}  # worker pid -> the rubric errors it reported (a running total)
        self._batch: list = [0, 0, ""]  # this generate call's rollouts scored, those verifiers recorded an error in, the first
        self._reset()

    def _reset(self) -> None:
        self._sums: dict[str, float] = {}
        self._scored = self._failed = self._rollout_errors = 0
        self._function_errors_before, self._restarts_before = self._function_errors, self.restarts

    def _live_worker(self) -> Worker:
        with self._restart_lock:
            if not self.worker.alive:
                if self.restarts >= self.MAX_RESTARTS:
                    raise RuntimeError(f"the verifiers environment's process died {self.restarts + 1} times; not restarted again")
                self.restarts += 1
                if self.log is not None:
                    self.log(f"[yellow]the verifiers environment's process exited (code {self.worker.proc.returncode}); restarting it[/yellow]")
                self.worker = shared_worker(self.settings)
            return self.worker

    async def run(self, client: Any, row: dict) -> float:
        """One sample: the environment's rollout against this sample's session; the rubric's reward."""
        msg = {"op": "rollout", "url": str(client.base_url), "key": client.api_key, "model": client.model,
               "input": rollout_input(row), "timeout": self.timeout_s}  # fmt: skip
        try:
            worker = self._live_worker()
            reply = await asyncio.wrap_future(worker.request(msg))
        except asyncio.CancelledError:
            raise
        except Exception:
            self._count_failure()
            raise
        if "exception" in reply:
            self._count_failure()
            raise RuntimeError(f"the verifiers environment raised: {reply['exception']}")
        try:  # the rubric's values (agents/results.py): one out of range is this sample's error
            reward, metrics = results.reward(reply["reward"], "the rubric's reward"), results.metrics(reply["metrics"], "the rubric's metrics")
        except results.BadResult:
            self._count_failure()
            raise
        with self._lock:
            self._scored += 1
            self._sums["reward/rubric"] = self._sums.get("reward/rubric", 0.0) + reward
            for name, value in metrics.items():
                self._sums[f"rubric/{name}"] = self._sums.get(f"rubric/{name}", 0.0) + value
            self._rollout_errors += reply.get("error") is not None
            self._batch[0] += 1
            if reply.get("error") is not None:
                self._batch[1] += 1
                self._batch[2] = self._batch[2] or reply["error"]
            pid, total = worker.proc.pid, reply.get("rubric_errors", 0)
            self._function_errors += max(total - self._reported.get(pid, 0), 0)
            self._reported[pid] = max(total, self._reported.get(pid, 0))
        if reply.get("error") is not None and self.log is not None and self._rollout_errors <= 3:
            self.log(f"[yellow]verifiers recorded an error in a rollout (the rubric scored it): {reply['error'][:300]}[/yellow]")
        return reward

    def check_batch(self) -> None:
        """Stop the run when verifiers recorded an error in (nearly) every rollout of one batch (the rule of
        postrl/errors.py): the rubric scored them, but an errored rollout (e.g. every model request refused)
        carries no signal. Rollouts that raised are the gateway's rule (agents/programs/programs.py `check_outcomes`)."""
        with self._lock:
            (n, errored, first), self._batch = self._batch, [0, 0, ""]
        if fails_nearly_always(n, errored):
            raise UserError(
                f"rollout.environment 'verifiers:{self.settings['spec']}': verifiers recorded an error in {errored} of the "
                f"{n} rollouts of this batch (counted in rubric/rollout_errors); the first: {' '.join(first[:600].split())}. The rubric "
                "scored them, but a rollout that ended in an error carries no signal, so training would learn nothing. "
                "Fix the environment or its settings by that error (a request the endpoint refused says why, e.g. a "
                "prompt past the run's context: raise data.max_prompt_length / rollout.max_tokens).",
                title="the environment fails on (nearly) every rollout",
            )

    def _count_failure(self) -> None:
        with self._lock:
            self._failed += 1

    def pop_metrics(self) -> dict[str, float]:
        """reward/rubric and rubric/* since the last call (then reset)."""
        with self._lock:
            m = {k: v / max(self._scored, 1) for k, v in self._sums.items()}
            m.setdefault("reward/rubric", 0.0)
            m.update({"rubric/scored": float(self._scored), "rubric/failed": float(self._failed),
                      "rubric/rollout_errors": float(self._rollout_errors),
                      "rubric/function_errors": float(self._function_errors - self._function_errors_before),
                      "rubric/worker_restarts": float(self.restarts - self._restarts_before)})  # fmt: skip
            self._reset()
        return m

    def close(self) -> None:
        with _WORKERS_LOCK:
            if _WORKERS.get(_key(self.settings)) is self.worker:
                del _WORKERS[_key(self.settings)]
        self.worker.close()


class VerifiersEngine(EngineWrapper):
    """The gateway that runs the environment (agents/endpoint/gateway.py), plus the rubric's metrics and the worker's end."""

    def __init__(self, gateway: Any, agent: VerifiersAgent):
        super().__init__(gateway)
        self.agent = agent

    def generate(self, prompts, params, multi_modal=None, **kw) -> list:
        try:
            out = self.engine.generate(prompts, params, multi_modal=multi_modal, **kw)
        except UserError:  # the gateway's rule (every program failed): verifiers' own record says why, when it has one
            self.agent.check_batch()
            raise
        self.agent.check_batch()
        return out

    def pop_metrics(self) -> dict[str, float]:
        return {**self.engine.pop_metrics(), **self.agent.pop_metrics()}

    def close(self) -> None:
        self.agent.close()
        self.engine.close()


def make_verifiers_engine(engine: Any, tokenizer: Any, cfg: "RolloutConfig", model: Any = None, log: Any = None,
                          max_model_len: int | None = None) -> VerifiersEngine:  # fmt: skip
    """`engine` wrapped in the endpoint whose programs are the environment's rollouts (rollout/__init__.make_engine)."""
    from postrl.agents.endpoint.gateway import AgentGateway

    agent = VerifiersAgent(cfg, log)
    if log is not None:
        log(f"rollout environment: verifiers:{agent.settings['spec']} ({agent.worker.env_id}), its own process (pid {agent.worker.proc.pid})")
    try:
        gateway = AgentGateway(engine, tokenizer, cfg, model=model, log=log, agent=agent.run, max_model_len=max_model_len)
    except BaseException:
        agent.close()
        raise
    return VerifiersEngine(gateway, agent)
