"""`rollout.agent_workers`: the users' programs in worker processes (agents/program_workers.py).

Same engine and program as tests/test_gateway.py; the program is a module file under tmp_path, named by
its spec (only a spec can go to a worker process)."""

from __future__ import annotations

import json

import pytest

from postrl.agents.gateway import AgentGateway
from postrl.agents.loop import AgentLoop
from postrl.config import MultiTurnConfig, RolloutConfig
from postrl.rollout.base import SamplingParams
from tests.test_agents import TOOLS, ScriptEngine, _call, _prompt, tokenizer  # noqa: F401 - the module's fixture
from tests.test_gateway import QUESTION, SCRIPT

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
