"""The OpenAI-compatible rollout endpoint (agents/endpoint/gateway.py): token-in-token-out, segments, containment.

The engine is tests/test_agents.py's `ScriptEngine` (a policy that is a fixed script of turns; the
endpoint's logic is under test, not a model); the programs are plain `openai` client code.
"""

from __future__ import annotations

import collections
import json
import time

import pytest
from conftest import AGENT_RECIPE, tiny_agent_overrides

from postrl.agents.endpoint.gateway import AgentGateway
from postrl.agents.loop.loop import AgentLoop
from postrl.agents.session import Session
from postrl.agents.tools.tools import call_tool, load_tools
from postrl.config import MultiTurnConfig, RolloutConfig
from postrl.rollout.base import Completion, EngineCapabilities, SamplingParams
from test_agents import TOOLS, ScriptEngine, _call, _ids, _prompt, tokenizer  # noqa: F401 - the module's fixture

QUESTION = [{"role": "user", "content": "What is 347 * 28 + 1205?"}]
CALC = load_tools(["builtin:calculator"])


def chat_agent(client, row):
    """A plain openai-client tool loop (what a user writes): call, run the tools, send the results back."""
    messages = list(row["prompt"])
    for _ in range(4):
        r = client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for tc in msg.tool_calls:
            result = call_tool(CALC, tc.function.name, json.loads(tc.function.arguments), 5).text
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    return None


def _gateway(tokenizer, turns, agent, max_model_len=None, **cfg):
    engine = ScriptEngine(tokenizer, turns)
    rollout = RolloutConfig(agent="tests.test_gateway:chat_agent", **{"agent_timeout_s": 30, **cfg})
    return AgentGateway(engine, tokenizer, rollout, agent=agent, max_model_len=max_model_len), engine


SCRIPT = [_call("347 * 28", ""), _call("9716 + 1205", ""), "\\boxed{10921}<|im_end|>"]


def test_a_three_turn_tool_chat_through_the_endpoint_has_the_agent_loops_ids_mask_and_logprobs(tokenizer):
    loop = AgentLoop(ScriptEngine(tokenizer, SCRIPT), tokenizer, MultiTurnConfig(enable=True, tools=["builtin:calculator"], max_turns=4))
    params = SamplingParams(max_tokens=200, greedy=True)
    (want,) = loop.generate([_prompt(tokenizer)], params)
    gw, engine = _gateway(tokenizer, SCRIPT, chat_agent)
    try:
        (got,) = gw.generate([_prompt(tokenizer)], params, rows=[{"prompt": QUESTION}])
        m = gw.pop_metrics()
    finally:
        gw.close()
    assert len(want.turn_spans) == 3 and want.tool_calls == 2 and want.finished
    assert got.prompt_ids == _prompt(tokenizer)
    assert got.token_ids == want.token_ids
    assert got.loss_mask == want.loss_mask and sum(got.loss_mask) == sum(len(_ids(tokenizer, t)) for t in SCRIPT)
    assert got.logprobs == want.logprobs and got.turn_spans == want.turn_spans
    assert got.finished and got.tool_calls == 2 and got.segments is None
    assert engine.calls[0][1].stop_token_ids == (tokenizer.convert_tokens_to_ids("</tool_call>"),)
    assert (m["agent/requests_mean"], m["agent/segments_mean"], m["agent/errors"], m["agent/bad_requests"]) == (3.0, 1.0, 0, 0)


def test_an_unreadable_tool_call_is_counted_in_the_endpoints_metrics(tokenizer):
    """A turn whose tool call nests past the reader's limit is answered as text (no tool_calls) and counted once in
    agent/unreadable, as the agent loop counts it (issue 60); the count is popped per step."""
    from test_untrusted_text import DEEP_CALL

    gw, _ = _gateway(tokenizer, [DEEP_CALL + "</tool_call>"], chat_agent)
    try:
        (got,) = gw.generate([_prompt(tokenizer)], SamplingParams(max_tokens=20_000, greedy=True), rows=[{"prompt": QUESTION}])
        m = gw.pop_metrics()
        again = gw.pop_metrics()
    finally:
        gw.close()
    assert got.tool_calls == 0 and (m["agent/unreadable"], m["agent/requests_mean"], m["agent/errors"]) == (1.0, 1.0, 0)
    assert again["agent/unreadable"] == 0.0


def test_concurrent_programs_are_sampled_in_one_engine_call_per_turn(tokenizer):
    async def async_agent(client, row):  # an async program (AsyncOpenAI) takes the same path
        messages = list(row["prompt"])
        for _ in range(4):
            r = await client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return 0.5
            messages += [{"role": "tool", "tool_call_id": tc.id, "content": "9716"} for tc in msg.tool_calls]

    for agent in (chat_agent, async_agent):
        gw, engine = _gateway(tokenizer, SCRIPT, agent, agent_batch_wait_ms=10_000)  # only "all are waiting" flushes
        try:
            out = gw.generate([_prompt(tokenizer)] * 3, SamplingParams(max_tokens=200, n=2, seed=3), rows=[{"prompt": QUESTION}] * 3)
        finally:
            gw.close()
        assert [n for n, _ in engine.calls] == [6, 6, 6]
        assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
        assert all(len(c.turn_spans) == 3 and c.finished for c in out)
        assert [c.env_reward for c in out] == [0.0 if agent is chat_agent else 0.5] * 6


def test_programs_running_at_once_never_share_an_http_connection_pool(tokenizer):
    """The stall: programs that shared one httpx pool across threads could lose a request to the pool closing
    a connection it had just handed out (encode/httpcore#1110): a running program has a client of its own,
    and a finished program's client (with its kept-alive connection) serves the next program."""
    import asyncio
    import threading

    seen: list[int] = []
    barrier = threading.Barrier(6, timeout=20)

    def agent(client, row):
        seen.append(id(client._client))
        barrier.wait()  # all six are running at once
        client.chat.completions.create(model=client.model, messages=row["prompt"])
        return None

    abarrier: list = []

    async def async_agent(client, row):
        seen.append(id(client._client))
        abarrier.append(None)
        while len(abarrier) < 6:
            await asyncio.sleep(0.005)
        await client.chat.completions.create(model=client.model, messages=row["prompt"])
        return None

    for program in (agent, async_agent):
        seen.clear()
        gw, _ = _gateway(tokenizer, ["\\boxed{1}<|im_end|>"] * 2, program)
        try:
            for _ in range(2):
                abarrier.clear()
                gw.generate([_prompt(tokenizer)] * 3, SamplingParams(max_tokens=20, n=2, seed=0), rows=[{"prompt": QUESTION}] * 3)
                assert gw.pop_metrics()["agent/errors"] == 0
        finally:
            gw.close()
        assert len(set(seen[:6])) == 6  # six programs at once, six pools
        assert set(seen[6:]) == set(seen[:6])  # the next rollout's programs reuse them


class StepEngine(ScriptEngine):
    """A continuous-batching ScriptEngine (as vLLM's `generate_continuing`): a step takes ~1 ms; a request answers
    its trajectory's next scripted turn (the number of tool calls in its prompt), but not before the batch has
    had `hold` requests of that turn (a long generation that the other programs' requests catch up with; if
    they do not come within 5 s, it gives up waiting and counts a `late`)."""

    capabilities = EngineCapabilities(reports_logprobs=False, shares_trainer_model=False, can_sleep=False, continuous_batching=True)

    def __init__(self, tokenizer, turns, hold):
        super().__init__(tokenizer, turns)
        self.end, self.hold, self.base, self.streams, self.late = tokenizer.convert_tokens_to_ids("</tool_call>"), hold, None, [], 0
        self.seen = collections.Counter()  # requests of each turn, over all streams

    def generate_continuing(self, requests, on_finish, seed=None):
        self.streams.append([])
        live, seen, deadline = [], self.seen, time.time() + 5

        def add(new):
            for key, prompt, params in new:
                self.base = prompt.count(self.end) if self.base is None else self.base
                turn = None if key is None else prompt.count(self.end) - self.base
                live.append((key, turn, prompt, params))
                if key is not None:
                    seen[turn] += 1
                    self.streams[-1].append(key)

        add(requests)
        while live:
            time.sleep(0.001)  # the step's compute
            late = time.time() > deadline
            done = [x for x in live if x[0] is None or seen[x[1]] >= self.hold or late]
            self.late += late
            for x in done:
                live.remove(x)
            if done:
                outs = []
                for key, turn, prompt, params in done:
                    ids = self.tok(self.turns[turn or 0], add_special_tokens=False)["input_ids"][: params.max_tokens]
                    outs.append((key, Completion(0, ids, bool(ids) and ids[-1] in (self.tok.eos_token_id, *params.stop_token_ids), [-0.25] * len(ids))))
                add(on_finish(outs))


def test_with_a_continuous_engine_requests_join_the_running_batch_as_they_come_and_record_the_same_tokens(tokenizer):
    loop = AgentLoop(ScriptEngine(tokenizer, SCRIPT), tokenizer, MultiTurnConfig(enable=True, tools=["builtin:calculator"], max_turns=4))
    params = SamplingParams(max_tokens=200, n=2, seed=1)
    want = loop.generate([_prompt(tokenizer)] * 3, params)
    engine = StepEngine(tokenizer, SCRIPT, hold=6)
    gw = AgentGateway(engine, tokenizer, RolloutConfig(agent="x:y", agent_timeout_s=30), agent=chat_agent)
    try:
        got = gw.generate([_prompt(tokenizer)] * 3, params, rows=[{"prompt": QUESTION}] * 3)
        m = gw.pop_metrics()
    finally:
        gw.close()
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.loss_mask, g.logprobs, g.turn_spans) == (w.token_ids, w.loss_mask, w.logprobs, w.turn_spans)
        assert g.finished and g.tool_calls == 2 and g.segments is None
    assert engine.calls == []  # no per-turn generate call
    # a stream starts at the first request; each request of a turn found the other five joining it while it ran
    # (ticks poll the endpoint at every step), none waited in vain, and at most one stream per turn was started
    assert engine.late == 0 and sum(map(len, engine.streams)) == 18 and 1 <= len(engine.streams) <= 3
    assert (m["agent/requests_mean"], m["agent/errors"], m["agent/bad_requests"]) == (3.0, 0, 0) and m["agent/ticks"] > 0


def test_an_edited_history_opens_a_second_segment_with_its_own_mask_and_the_shared_reward(tokenizer):
    def summarising_agent(client, row):
        messages = list(row["prompt"])
        r = client.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
        tc = r.choices[0].message.tool_calls[0]
        # the program drops the call from its history and summarises it in the user turn instead
        edited = [{"role": "user", "content": row["prompt"][0]["content"] + " (347 * 28 = 9716)"}]
        client.chat.completions.create(model=client.model, messages=edited, tools=TOOLS)
        assert tc.function.name == "calculator"
        return 1.0

    gw, _ = _gateway(tokenizer, [_call("347 * 28", ""), "\\boxed{10921}<|im_end|>"], summarising_agent)
    try:
        (c,) = gw.generate([_prompt(tokenizer)], SamplingParams(max_tokens=200, greedy=True), rows=[{"prompt": QUESTION}])
        m = gw.pop_metrics()
    finally:
        gw.close()
    answer, call = _ids(tokenizer, "\\boxed{10921}<|im_end|>"), _ids(tokenizer, _call("347 * 28", ""))
    edited_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 347 * 28 + 1205? (347 * 28 = 9716)"}], tools=TOOLS, add_generation_prompt=True, return_dict=False
    )  # fmt: skip
    # the main segment is the one the last request made: its edited prompt, then the answer (all sampled)
    assert c.prompt_ids == edited_prompt and c.token_ids == answer and c.loss_mask == [1] * len(answer)
    (first,) = c.segments
    assert first.prompt_ids == _prompt(tokenizer) and first.token_ids == call and first.loss_mask == [1] * len(call)
    assert c.env_reward == 1.0 and m["agent/segments_mean"] == 2.0


def test_the_segment_rule_compares_ids():
    s = Session("k", 0)
    s.record([1, 2, 3], [([4, 5], [-0.1, -0.2], False)], 0)
    s.record([1, 2, 3, 4, 5, 6, 7], [([8], [-0.3], True)], 0)  # extends: one segment, 6 7 masked
    assert len(s.segments) == 1 and s.segments[0].ids == [4, 5, 6, 7, 8] and s.segments[0].mask == [1, 1, 0, 0, 1]
    assert s.segments[0].logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    s.record([1, 2, 3, 4, 9], [([10], None, True)], 1)  # drops 5 (the previous sample): a new segment
    assert len(s.segments) == 2 and s.segments[1].prompt == [1, 2, 3, 4, 9] and s.segments[1].mask == [1]
    assert s.main_segment() is s.segments[1] and s.segments[1].version == 1


def test_programs_that_raise_hang_or_send_malformed_requests_score_zero_and_are_counted(tokenizer):
    import threading

    import httpx

    release = threading.Event()

    def agent(client, row):
        kind = row["kind"]
        if kind == "raise":
            client.chat.completions.create(model=client.model, messages=row["prompt"], tools=TOOLS)
            raise ValueError("the user's bug")
        if kind == "hang":
            client.chat.completions.create(model=client.model, messages=row["prompt"], tools=TOOLS)
            release.wait(60)  # hangs until the test is over
            return 1.0
        if kind == "malformed":
            base = str(client.base_url).rstrip("/")
            bad = [httpx.post(base + "/chat/completions", content=b"{not json"),
                   httpx.post(base + "/chat/completions", json={"messages": "hi"}),
                   httpx.post(base + "/chat/completions", json={"messages": QUESTION, "n": 0}),
                   httpx.post(base + "/completions", json={"prompt": [10**9]}),
                   httpx.post(base + "/completions", json={"prompt": "1 2 3 " * 200})]  # fmt: skip
            assert [b.status_code for b in bad] == [400] * 5 and all("message" in b.json()["error"] for b in bad)
            assert bad[-1].json()["error"]["code"] == "context_length_exceeded"
            return "not a number"
        if kind == "wrong-session":
            r = httpx.post(str(client.base_url).replace("/s/", "/s/x") + "chat/completions", json={"messages": QUESTION})
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        r = client.chat.completions.create(model=client.model, messages=row["prompt"], tools=TOOLS)
        return 1.0 if r.choices[0].message.tool_calls else 0.0

    kinds = ("raise", "malformed", "wrong-session", "ok")
    gw, _ = _gateway(tokenizer, [_call("1 + 1", "")] * 8, agent, max_model_len=300, agent_timeout_s=120, agent_batch_wait_ms=5)
    params = SamplingParams(max_tokens=50, greedy=True)
    try:
        out = gw.generate([_prompt(tokenizer)] * 4, params, rows=[{"prompt": QUESTION, "kind": k} for k in kinds])
        m = gw.pop_metrics()
        gw.cfg.agent_timeout_s = 2.0  # a program that never returns: scored at its time limit
        (hung,) = gw.generate([_prompt(tokenizer)], params, rows=[{"prompt": QUESTION, "kind": "hang"}])
        m_hang = gw.pop_metrics()
    finally:
        release.set()
        gw.close()
    assert [c.env_reward for c in out] == [0.0, 0.0, 1.0, 1.0]
    assert [sum(c.loss_mask) > 0 for c in out] == [False, False, True, True]  # the failed ones train nothing
    assert (m["agent/errors"], m["agent/timeouts"], m["agent/bad_requests"]) == (2, 0, 6)  # 5 malformed, 1 unknown session
    assert hung.env_reward == 0.0 and sum(hung.loss_mask) == 0 and len(hung.token_ids) > 1  # it sampled, then hung
    assert (m_hang["agent/timeouts"], m_hang["agent/stuck_threads"]) == (1, 1)


def test_the_endpoint_answers_models_completions_and_a_closed_session(tokenizer):
    import httpx

    seen = {}

    def agent(client, row):
        seen["models"] = [m.id for m in client.models.list().data]
        r = client.completions.create(model=client.model, prompt="What is", max_tokens=3, logprobs=1)
        seen["text"], seen["lp"] = r.choices[0].text, r.choices[0].logprobs
        seen["url"] = str(client.base_url)
        return None

    gw, _ = _gateway(tokenizer, ["1 2 3 4 5"], agent)
    try:
        (c,) = gw.generate([_prompt(tokenizer)], SamplingParams(max_tokens=50, greedy=True), rows=[{}])
        late = httpx.post(seen["url"] + "chat/completions", json={"messages": QUESTION})
    finally:
        gw.close()
    assert seen["models"] == [gw.model_name] and c.token_ids == _ids(tokenizer, "1 2 3 4 5")[:3]
    assert c.prompt_ids == _ids(tokenizer, "What is") and not c.finished
    assert late.status_code in (404, 410)


def test_the_openai_agent_example_trains_two_steps_and_validates_through_the_endpoint(tmp_path):
    """examples/openai_agent/ (a plain openai-client program) with tiny_tool_dapo's settings, shortened: the
    random tiny tools model, HF rollout, 2 steps, validation before and after."""
    from postrl.checks import load_config
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    cfg = load_config(AGENT_RECIPE, tiny_agent_overrides(
        tmp_path, f"{AGENT_RECIPE.parent}/calculator_agent.py:run", "rollout.max_tokens=16", "rollout.agent_concurrency=8",
        "data.tool_arithmetic.train_size=64", "data.tool_arithmetic.val_size=8", "eval.max_prompts=4", "eval.max_tokens=16",
    ))  # fmt: skip
    Trainer(cfg).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "agent/requests_mean" in r]
    assert len(steps) == 2 and all(r["agent/requests_mean"] >= 1 and r["agent/errors"] == r["agent/timeouts"] == 0 for r in steps)
    assert all(r["response_length/mean"] > 0 for r in steps)  # the endpoint's sampled tokens are trained on
    assert len([r for r in rows if "val/tool_arithmetic/acc_mean@1" in r]) == 2


def test_extra_segments_train_as_rows_of_their_own_with_their_trajectorys_reward_and_advantage():
    from postrl.config import build_config
    from postrl.batch import Batch, expand_segments
    from postrl.experience import Experience, batch_metrics
    from postrl.rollout.base import Completion

    seg = Completion(0, [7, 8, 9], True, [-0.5, 0.0, -0.5], loss_mask=[1, 0, 1], turn_spans=[(0, 1), (2, 3)], prompt_ids=[1, 2])
    n = 4
    batch = Batch(
        prompt_ids=[[1]] * n, response_ids=[[5], [6], [5, 6], [6]], loss_masks=[[1], [1], [1, 1], [1]], turns=[1] * n,
        finished=[True] * n, scores=[1.0, 0.0, 1.0, 1.0], rewards=[1.0, 0.0, 1.0, 1.0], verifier_metrics=[{"acc": 1.0}] * n,
        engine_logprobs=[None] * n, multi_modal=[None] * n, segments=[[seg], None, None, None],
    )  # fmt: skip
    full = expand_segments(batch)
    assert full.size == 5 and full.owners == [None] * 4 + [0]
    assert (full.prompt_ids[4], full.response_ids[4], full.loss_masks[4], full.turns[4]) == ([1, 2], [7, 8, 9], [1, 0, 1], 2)
    assert full.rewards[4] == 1.0 and full.engine_logprobs[4] == [-0.5, 0.0, -0.5]
    exp = Experience(build_config({"model": {"path": "builtin:tiny-qwen2"}, "rollout": {"n_samples_per_prompt": 2}}), None, None, None, [], None)
    adv = exp.advantages(full)
    assert adv.shape == (5,) and adv[4] == adv[0] and adv[0] > 0 > adv[1]
    assert torch_equal(adv[:4], exp.advantages(batch))  # the groups' advantages are those without the segment
    m = batch_metrics(full, "grpo", 2)
    assert m["agent/extra_segments"] == 1.0 and m["grpo/rewards/mean"] == 0.75


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_async_staleness_drops_a_stale_group_with_its_extra_segments():
    from postrl.placement.staleness import split_stale
    from postrl.batch import Batch

    n = 4  # two groups of 2; rows 4 and 5 are extra segments of rows 1 (stale group 0) and 2 (fresh group 1)
    batch = Batch(
        prompt_ids=[[1]] * 6, response_ids=[[i] for i in range(6)], loss_masks=[[1]] * 6, turns=[1] * 6, finished=[True] * 6,
        scores=[0.0] * 6, rewards=[0.0] * 6, verifier_metrics=[{}] * 6, engine_logprobs=[None] * 6, multi_modal=[None] * 6,
        versions=[0, 0, 3, 3, 0, 3], owners=[None] * n + [1, 2],
    )  # fmt: skip
    kept, dropped = split_stale(batch, step=3, max_staleness=1, group_size=2)
    assert dropped == 1 and kept.response_ids == [[2], [3], [5]] and kept.owners == [None, None, 0]


class SeededStepEngine(ScriptEngine):
    """A continuous-batching engine that samples as vLLM's in-process `generate_continuing` does: a call's
    `seed` seeds one RNG that the requests draw from in the order they join; with no call seed, each request
    draws from its own `params.seed`. A completion is `\\boxed{<draw>}` and the end."""

    capabilities = EngineCapabilities(reports_logprobs=False, shares_trainer_model=False, can_sleep=False, continuous_batching=True)

    def generate_continuing(self, requests, on_finish, seed=None):
        import random

        shared = None if seed is None else random.Random(seed)
        live = list(requests)
        while live:
            done, live = live, []
            outs = []
            for key, prompt, params in done:
                draw = (shared or random.Random(params.seed)).randrange(10**6)
                ids = self.tok(f"\\boxed{{{draw}}}<|im_end|>", add_special_tokens=False)["input_ids"][: params.max_tokens]
                outs.append((key, Completion(0, ids, True, [-0.25] * len(ids))))
            live += on_finish(outs)


def test_a_seeded_rollout_samples_the_same_tokens_whatever_order_the_programs_ask_in(tokenizer):
    """Six programs ask one after the other (each waits for the one before it to be answered), first in the
    samples' order, then in the reverse: every sample gets the same tokens both times, since its seed is its
    own (the rollout's seed, the sample, its request), not the draw its arrival happened to get."""
    import threading

    gates: list[threading.Event] = []

    def in_turn(client, row):
        assert gates[row["rank"]].wait(30)
        try:
            client.chat.completions.create(model=client.model, messages=QUESTION)
        finally:
            gates[row["rank"] + 1].set()
        return 1.0

    engine = SeededStepEngine(tokenizer, [])
    gw = AgentGateway(engine, tokenizer, RolloutConfig(agent="x:y", agent_timeout_s=30), agent=in_turn)
    runs = []
    try:
        for ranks in (range(6), reversed(range(6))):
            gates[:] = [threading.Event() for _ in range(7)]
            gates[0].set()
            rows = [{"rank": r} for r in ranks]
            out = gw.generate([_prompt(tokenizer)] * 6, SamplingParams(max_tokens=20, n=1, seed=7), rows=rows)
            assert gw.pop_metrics()["agent/errors"] == 0
            runs.append([tokenizer.decode(c.token_ids) for c in out])
    finally:
        gw.close()
    assert runs[0] == runs[1] and len(set(runs[0])) == 6, runs  # the same six draws, one per sample
