"""`rollout.agent_workers`: the users' programs in worker processes (agents/programs/workers.py).

Same engine and program as tests/test_gateway.py; the program is a module file under tmp_path, named by
its spec (only a spec can go to a worker process)."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest

from postrl.children import ALLOWED, THREADS_AND_DEVICES
from postrl.agents.endpoint.gateway import AgentGateway
from postrl.agents.loop.loop import AgentLoop
from postrl.agents.programs.workers import MAX_REPLY_BYTES
from postrl.config import MultiTurnConfig, RolloutConfig
from postrl.rollout.base import SamplingParams
from test_agents import TOOLS, ScriptEngine, _call, _prompt, tokenizer  # noqa: F401 - the module's fixture
from test_gateway import QUESTION, SCRIPT

AGENT = '''
import json, os, time

TOOLS = {tools}


def chat(client, row):
    kind = row.get("kind", "ok")
    messages = list(row["prompt"])
    for _ in range(4):
        r = client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        if kind == "raise":
            raise ValueError("the user's bug")
        if kind == "exit":
            os._exit(7)
        if kind == "hang":
            time.sleep(600)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 1.0 if kind == "ok" else None
        for tc in msg.tool_calls:
            result = str(eval(json.loads(tc.function.arguments)["expression"]))  # the calculator's answer, as text
            messages.append({{"role": "tool", "tool_call_id": tc.id, "content": result}})
    return 1.0


async def achat(client, row):  # the async form: AsyncOpenAI clients on the worker's event loop
    messages = list(row["prompt"])
    for _ in range(4):
        msg = (await client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 0.5
        for tc in msg.tool_calls:
            result = str(eval(json.loads(tc.function.arguments)["expression"]))
            messages.append({{"role": "tool", "tool_call_id": tc.id, "content": result}})
'''


def _gateway(tokenizer, tmp_path, turns, fn="chat", **cfg):
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT.format(tools=json.dumps(TOOLS)))
    rollout = RolloutConfig(agent=f"{path}:{fn}", **{"agent_timeout_s": 30, "agent_workers": 2, **cfg})
    return AgentGateway(ScriptEngine(tokenizer, turns), tokenizer, rollout)


@pytest.mark.parametrize("fn", ["chat", "achat"])
def test_a_three_turn_tool_chat_in_worker_processes_has_the_agent_loops_ids_mask_and_logprobs(tokenizer, tmp_path, fn):
    loop = AgentLoop(ScriptEngine(tokenizer, SCRIPT), tokenizer, MultiTurnConfig(enable=True, tools=["builtin:calculator"], max_turns=4))
    params = SamplingParams(max_tokens=200, greedy=True)
    (want,) = loop.generate([_prompt(tokenizer)], params)
    gw = _gateway(tokenizer, tmp_path, SCRIPT, fn, agent_batch_wait_ms=10_000)  # only "all are waiting" flushes: a turn a call
    try:
        assert type(gw.programs).__name__ == "WorkerPool" and gw.is_async == (fn == "achat")
        out = gw.generate([_prompt(tokenizer)] * 3, params, rows=[{"prompt": QUESTION, "kind": "plain"}] * 3)
        m = gw.pop_metrics()
        pids = {w.proc.pid for w in gw.programs.workers}
    finally:
        gw.close()
    assert len(want.turn_spans) == 3 and want.tool_calls == 2 and want.finished
    assert len(pids) == 2
    for got in out:
        assert got.token_ids == want.token_ids and got.loss_mask == want.loss_mask
        assert got.logprobs == want.logprobs and got.turn_spans == want.turn_spans
        assert got.finished and got.tool_calls == 2 and got.segments is None and got.env_reward == (0.0 if fn == "chat" else 0.5)
    assert (m["agent/requests_mean"], m["agent/errors"], m["agent/timeouts"]) == (3.0, 0, 0)


def test_worker_programs_that_raise_exit_or_hang_are_counted_and_their_workers_replaced(tokenizer, tmp_path):
    gw = _gateway(tokenizer, tmp_path, [_call("1 + 1", "")] * 20, agent_workers=1, agent_batch_wait_ms=5)
    params = SamplingParams(max_tokens=50, greedy=True)
    prompt = _prompt(tokenizer)
    seen = {}
    try:
        for kind in ("raise", "unpicklable", "exit", "hang", "ok"):
            if kind == "hang":
                gw.cfg.agent_timeout_s = 2.0
            row = {"prompt": QUESTION, "kind": kind, **({"f": lambda: 0} if kind == "unpicklable" else {})}
            (c,) = gw.generate([prompt], params, rows=[row])
            m = gw.pop_metrics()
            seen[kind] = (m["agent/errors"], m["agent/timeouts"], c.env_reward, sum(c.loss_mask) > 0, gw.programs.restarts)
            gw.cfg.agent_timeout_s = 30.0
    finally:
        gw.close()
    assert seen == {  # errors, timeouts, reward, trains, workers restarted so far
        "raise": (1, 0, 0.0, False, 0),
        "unpicklable": (1, 0, 0.0, False, 0),  # a row that cannot go to a worker: that program fails, not the rollout
        "exit": (1, 0, 0.0, False, 1),  # the worker died with the program: an error, and a new worker
        "hang": (0, 1, 0.0, False, 2),  # past its time limit: its worker killed at the rollout's end
        "ok": (0, 0, 1.0, True, 2),
    }



HOSTILE = '''
import json, os, socket, sys, time


def run(client, row):
    """Code in a worker writes straight onto the worker's channel to the trainer, then waits."""
    client.chat.completions.create(model=client.model, messages=row["prompt"])
    if "frame" in row:
        sock = socket.socket(fileno=os.dup(int(sys.argv[1])))  # the worker's end of the channel
        sock.sendall(bytes.fromhex(row["frame"]))
        time.sleep(600)
    if "env_out" in row:
        with open(row["env_out"], "w") as f:
            json.dump(dict(os.environ), f)
    return 1.0
'''


def _frame(payload: bytes, length: int | None = None) -> str:
    return (struct.pack(">I", len(payload) if length is None else length) + payload).hex()


class _Touch:
    """Unpickling it creates a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow  # seven workers killed and started again (~60 s on 2 cores)
def test_a_bad_frame_from_a_worker_ends_that_worker_its_program_counted_as_an_error_never_unpickled(tokenizer, tmp_path):
    marker = tmp_path / "unpickled"
    frames = {
        "garbage": _frame(b"\x80\x04not json at all"),
        "pickle": _frame(pickle.dumps(_Touch(str(marker)))),
        "oversize": _frame(b"{}", length=MAX_REPLY_BYTES + 1),
        "shape": _frame(json.dumps({"key": "x", "outcome": "ok"}).encode()),
        "huge_reward": _frame(b'["' + b"k" * 32 + b'", "ok", ' + b"1" * 400 + b"]"),  # no float holds it
        "nan_reward": _frame(b'["' + b"k" * 32 + b'", "ok", NaN]'),  # JSON's NaN parses: a value to refuse
        "deep": _frame(b"[" * 30_000 + b"]" * 30_000),
        "cut": _frame(b'["abc", "ok"', length=100),  # then the worker sleeps: the reader waits mid-frame
    }
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    logs: list[str] = []
    rollout = RolloutConfig(agent=f"{path}:run", agent_timeout_s=30, agent_workers=1, agent_batch_wait_ms=5)
    gw = AgentGateway(ScriptEngine(tokenizer, ["done<|im_end|>"] * 40), tokenizer, rollout, log=logs.append)
    params = SamplingParams(max_tokens=20, greedy=True)
    seen = {}
    try:
        for name, frame in frames.items():
            gw.cfg.agent_timeout_s = 3.0 if name == "cut" else 30.0  # a frame cut short: the program's time runs out
            (c,) = gw.generate([_prompt(tokenizer)], params, rows=[{"prompt": QUESTION, "frame": frame}])
            m = gw.pop_metrics()
            seen[name] = (m["agent/errors"], m["agent/timeouts"], c.env_reward, gw.programs.restarts)
            gw.cfg.agent_timeout_s = 30.0
            (ok,) = gw.generate([_prompt(tokenizer)], params, rows=[{"prompt": QUESTION}])  # the next program runs
            assert ok.env_reward == 1.0 and gw.pop_metrics()["agent/errors"] == 0, name
        bad_frames = gw.programs.bad_frames
    finally:
        gw.close()
    assert not marker.exists()
    assert seen == {  # errors, timeouts, reward, workers restarted so far
        "garbage": (1, 0, 0.0, 1), "pickle": (1, 0, 0.0, 2), "oversize": (1, 0, 0.0, 3), "shape": (1, 0, 0.0, 4),
        "huge_reward": (1, 0, 0.0, 5), "nan_reward": (1, 0, 0.0, 6), "deep": (1, 0, 0.0, 7), "cut": (0, 1, 0.0, 8),
    }  # fmt: skip
    assert bad_frames == 7  # "cut" ran out of time: its worker was killed as a stuck one
    said = [line for line in logs if "worker process sent" in line]
    assert len(said) == 7 and all(why in line for why, line in zip(["not JSON", "not JSON", "at most", "not [key", "out of range",
                                                                    "out of range", "not JSON"], said))


def test_workers_start_from_a_scrubbed_environment_plus_the_listed_names(tokenizer, tmp_path, monkeypatch):
    home = tmp_path / "home"  # the trainer's HOME holds a Hugging Face token file: the worker's HOME is elsewhere, empty
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_secret")
    monkeypatch.setenv("HOME", str(home))
    for name, value in {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "wb_x", "AWS_SECRET_ACCESS_KEY": "aws_x", "MY_SERVICE_KEY": "listed",
                        "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "7"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    rollout = RolloutConfig(agent=f"{path}:run", agent_timeout_s=30, agent_workers=1, agent_env_passthrough=["MY_SERVICE_KEY"])
    gw = AgentGateway(ScriptEngine(tokenizer, ["done<|im_end|>"] * 4), tokenizer, rollout)
    out = tmp_path / "env.json"
    try:
        (c,) = gw.generate([_prompt(tokenizer)], SamplingParams(max_tokens=20, greedy=True), rows=[{"prompt": QUESTION, "env_out": str(out)}])
    finally:
        gw.close()
    env = json.loads(out.read_text())
    assert c.env_reward == 1.0
    assert not {"HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert (env["MY_SERVICE_KEY"], env["LC_ALL"], env["PYTHONHASHSEED"], env["PATH"]) == ("listed", "C.UTF-8", "7", os.environ["PATH"])
    assert env["HOME"] != str(home) and os.path.isdir(env["HOME"])
    assert not os.path.exists(os.path.join(env["HOME"], ".cache", "huggingface", "token"))
    assert set(env) <= ALLOWED | THREADS_AND_DEVICES | {"MY_SERVICE_KEY", "HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "POSTRL_CACHE"} | {
        k for k in env if k.startswith(("LC_", "PYTHON"))}
