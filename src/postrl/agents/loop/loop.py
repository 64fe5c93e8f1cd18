"""The agent loop: multi-turn rollout with tools and environments, token in, token out.

    prompt -> model turn (until EOS or </tool_call>) -> tool results (masked) -> model turn -> ... -> EOS

With vLLM the whole rollout is one continuous batch (`VLLMEngine.generate_continuing`): a trajectory's
next turn joins the running batch at the engine step after its turn ended, and reads the KV of
everything before from the prefix cache, so no trajectory waits for the slowest one of its turn.
Other engines (HF `generate`, image prompts) take one engine call per turn for all trajectories still
running (the first samples the n completions of each prompt in one request). A turn that stops at
`</tool_call>` has its calls parsed (Hermes / Qwen: <tool_call>{"name", "arguments"}</tool_call>) and
run concurrently across trajectories, each under `tool_timeout_s`; their results are rendered with
the model's own chat template (`role: tool`, agents/loop/render.py) and appended with loss mask 0. A
malformed call is answered with an error message for the model, never a crash; one that trips a reader's
limit (JSON too deep or too long, too many calls: postrl/untrusted.py) is such a call, also counted in
agent/unreadable. A turn that ends with EOS goes to the environment, when there is one (agents/loop/env.py),
else ends the trajectory.

The sampled ids are never re-tokenised: the trajectory is the prompt, then the engine's ids of each
model turn (mask 1, the engine's log-probs) and the rendered ids of what came between (mask 0,
log-prob 0.0). Limits: `max_turns` model turns, `max_tool_calls` per trajectory, a total budget of
response tokens (`max_response_tokens`, every token after the prompt), tool output cut to
`max_tool_response_tokens`. A trajectory cut by a limit is not `finished` (like a completion cut at
max_tokens). Decisions (docs/agents.md): verifiers read the model's tokens only (what the policy
wrote, not what the tools printed); an environment's rewards add to the verifier score.

`AgentLoop` is a rollout engine (rollout/base.py's protocol) around the real one, so validation,
`postrl eval` and `postrl doctor` run the same loop; the assembly puts it around the policy's engine
(agents/wrap.py) when `rollout.multi_turn.enable` is set.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from postrl.agents.loop.env import EnvCalls, load_environment
from postrl.agents.loop.render import TurnRenderer, truncate_text
from postrl.agents.session import append_tokens
from postrl.errors import UserError
from postrl.rollout.base import Completion, EngineWrapper, SamplingParams, cut_at_stop
from postrl.toolcall import CLOSE as CALL_END
from postrl.turns import end_ids
from postrl.untrusted import AGENT_UNREADABLE

if TYPE_CHECKING:
    from postrl.config import MultiTurnConfig



@dataclass
class Trajectory:
    """One rollout in progress: the ids after the prompt, which the policy sampled, and its counters."""

    prompt_index: int
    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] | None = field(default_factory=list)  # None once a turn came without them
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn in ids
    tool_calls: int = 0
    user_turns: int = 0
    env: Any = None
    env_reward: float = 0.0
    finished: bool = False  # ended by itself (EOS, or the environment said done), not cut by a limit
    done: bool = False

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        append_tokens(self, ids, sampled, logprobs)

    def stop(self, finished: bool) -> None:
        self.done, self.finished = True, finished


class AgentLoop(EngineWrapper):
    """A rollout engine that runs the agent loop on `engine` (the same protocol; docs/agents.md). Its
    `generate` also takes the prompts' dataset `rows` (environments reset from them: `generate_for`)."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: "MultiTurnConfig", model: Any = None, log: Any = None):
        from postrl.agents.tools.tools import load_tools, start_python_tool

        super().__init__(engine)  # what the wrapped engine can do is what the loop can
        self.tokenizer, self.cfg = tokenizer, cfg
        self.tools = load_tools(list(cfg.tools), sandbox_limits=cfg.sandbox.model_dump())
        if "python" in self.tools:
            start_python_tool(self.tools["python"].sandbox_limits, log)  # refuses where the code cannot be fenced
        self.env_cls = load_environment(cfg.interaction) if cfg.interaction else None
        self.env_calls = EnvCalls(cfg.interaction or "")
        self.renderer = TurnRenderer(tokenizer)
        # The engines stop on a one-token "</tool_call>"; otherwise the turn is cut after the token that completes
        # the text (the engine generates on to EOS; slower, same ids).
        self.eos_ids, self.call_end_id = end_ids(model, tokenizer)
        self.stop_ids = (self.call_end_id,) if self.call_end_id is not None and self.tools else ()
        self._pool = ThreadPoolExecutor(max_workers=cfg.tool_workers, thread_name_prefix="postrl-tool") if self.tools else None
        self.stats: dict[str, float] = {}
        self.reset_stats()

    # ------------------------------------------------------------------ the engine protocol
    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # ------------------------------------------------------------------------- the loop
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, multi_modal: list[dict] | None = None,
        rows: list[dict] | None = None,
    ) -> list[Completion]:  # fmt: skip
        """`params.n` trajectories per prompt, prompt-major (as `engine.generate`); `rows` (the prompts' dataset
        rows) reset the environment. `params.max_tokens` is the response budget across turns (capped by
        `max_response_tokens`)."""
        cfg = self.cfg
        n = 1 if params.greedy else params.n
        budget = min(params.max_tokens, cfg.max_response_tokens or params.max_tokens)
        trajs = [Trajectory(i, list(p)) for i, p in enumerate(prompts) for _ in range(n)]
        if self.env_cls is not None:
            if rows is None:
                raise UserError("rollout.multi_turn.interaction needs the prompts' dataset rows; this caller passed none.")
            for t in trajs:
                t.env = self.env_cls()
                if not self.env_calls.reset(t.env, rows[t.prompt_index]):
                    t.env = None
        turn_params = replace(params, stop_token_ids=tuple(params.stop_token_ids) + self.stop_ids)
        if multi_modal is None and self.engine.capabilities.continuous_batching:
            self._run_continuing(trajs, turn_params, budget)
        else:
            self._run_by_turns(prompts, trajs, turn_params, budget, multi_modal)
        for t in trajs:
            if not t.done:
                t.stop(finished=False)  # max_turns reached with a tool call or an environment turn pending
        self._record(trajs)
        self.env_calls.end_batch()
        return [
            Completion(
                prompt_index=t.prompt_index, token_ids=t.ids, finished=t.finished, logprobs=t.logprobs,
                loss_mask=t.mask, turn_spans=t.spans,
                tool_calls=t.tool_calls, env_reward=t.env_reward,
            )  # fmt: skip
            for t in trajs
        ]

    def _run_by_turns(
        self, prompts: list[list[int]], trajs: list[Trajectory], turn_params: SamplingParams, budget: int,
        multi_modal: list[dict] | None,
    ) -> None:  # fmt: skip
        """One engine call per turn for every trajectory still running (the HF engine, images)."""
        cfg, params = self.cfg, turn_params
        for turn in range(cfg.max_turns):
            live = [t for t in trajs if not t.done]
            if not live:
                break
            start = time.perf_counter()
            room = max(budget - len(t.ids) for t in live)
            if turn == 0:  # the n samples of a prompt in one request (shared prefix), as single-turn rollout
                outs = self.engine.generate(prompts, replace(turn_params, max_tokens=room), multi_modal=multi_modal)
            else:
                seed = None if params.seed is None else (params.seed + 7919 * turn) % 2**31
                mm = [multi_modal[t.prompt_index] for t in live] if multi_modal else None
                outs = self.engine.generate(
                    [t.prompt + t.ids for t in live], replace(turn_params, n=1, max_tokens=room, seed=seed), multi_modal=mm
                )
            self.stats["timing/agent_generate"] += time.perf_counter() - start
            calls = [(t, parsed) for t, out in zip(live, outs) if (parsed := self._end_turn(t, out, budget, last_turn=turn == cfg.max_turns - 1))]
            if calls:
                start = time.perf_counter()
                self._run_tools(calls, budget)
                self.stats["timing/agent_tools"] += time.perf_counter() - start

    def _run_continuing(self, trajs: list[Trajectory], turn_params: SamplingParams, budget: int) -> None:
        """vLLM: one continuous batch for the whole rollout. A trajectory's next turn joins the running batch
        at the engine step after its turn ended (its tool results or observation appended), instead of
        waiting for the slowest trajectory of the turn and a second engine call; its prompt's KV comes from
        the prefix cache. The tools of the turns that ended in one step run concurrently, then the batch
        goes on (so a seeded rollout is reproducible)."""
        cfg, one = self.cfg, replace(turn_params, n=1)
        tool_seconds = 0.0

        def request(k: int) -> tuple[int, list[int], SamplingParams]:
            t = trajs[k]
            return k, t.prompt + t.ids, replace(one, max_tokens=budget - len(t.ids))

        def on_finish(done: list[tuple[int, Completion]]) -> list[tuple[int, list[int], SamplingParams]]:
            nonlocal tool_seconds
            calls = []
            for k, out in done:
                t = trajs[k]
                if parsed := self._end_turn(t, out, budget, last_turn=len(t.spans) == cfg.max_turns - 1):
                    calls.append((t, parsed))
            if calls:
                start = time.perf_counter()
                self._run_tools(calls, budget)
                tool_seconds += time.perf_counter() - start
            return [request(k) for k, _ in done if not trajs[k].done]

        start = time.perf_counter()
        self.engine.generate_continuing([request(k) for k in range(len(trajs))], on_finish, seed=turn_params.seed)
        self.stats["timing/agent_generate"] += time.perf_counter() - start - tool_seconds
        self.stats["timing/agent_tools"] += tool_seconds

    def _end_turn(self, t: Trajectory, out: Completion, budget: int, last_turn: bool) -> list | None:
        """Append one model turn; returns its parsed tool calls when the loop should run them, else None."""
        room = budget - len(t.ids)
        ids, lps = list(out.token_ids), out.logprobs
        cut = len(ids) > room
        ids = ids[:room]
        at_call = bool(ids) and self.call_end_id is not None and ids[-1] == self.call_end_id and bool(self.tools)
        if not at_call and self.tools and self.call_end_id is None:
            ids, at_call = self._cut_at_call_text(ids)
        t.append(ids, sampled=True, logprobs=lps)
        if at_call:
            if last_turn or t.tool_calls >= self.cfg.max_tool_calls:
                t.stop(finished=False)
                return None
            return self._parse(ids)
        last = ids[-1] if ids else None
        if cut or last not in self.eos_ids:
            t.stop(finished=False)  # cut at the budget
            return None
        if t.env is None:
            t.stop(finished=True)
            return None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stepped = self.env_calls.step(t.env, text)
        if stepped is None:  # the step raised: counted, and the trajectory ends here
            t.stop(finished=False)
            return None
        obs, reward, env_done = stepped
        t.env_reward += reward
        if env_done:
            t.stop(finished=True)
        elif t.user_turns >= self.cfg.max_user_turns or last_turn:
            t.stop(finished=False)
        else:
            t.user_turns += 1
            self._append_masked(t, self.renderer.user_turn(obs, last), budget)
        return None

    def _cut_at_call_text(self, ids: list[int]) -> tuple[list[int], bool]:
        """Without a single </tool_call> token: the ids up to the one that completes that text (by bisection:
        a turn of n tokens costs log n decodes, not n)."""
        return cut_at_stop(self.tokenizer, ids, [CALL_END])

    def _parse(self, ids: list[int]) -> list[tuple[str | None, dict | None, str | None]]:
        """(name, arguments, error) of each call in a model turn; a malformed turn is one error for the model."""
        from postrl.toolcall import ParseError, parse_tool_calls

        parsed = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False), self.tools)
        if isinstance(parsed, ParseError):
            self.stats[AGENT_UNREADABLE] += parsed.unreadable  # past a reader's limit (postrl/untrusted.py)
            return [(None, None, parsed.message)]
        return [(c.name, c.arguments, None) for c in parsed]

    def _run_tools(self, calls: list[tuple[Trajectory, list]], budget: int) -> None:
        """Run every call of this turn, across trajectories, concurrently; append each trajectory's results."""
        from postrl.agents.tools.tools import ToolResult, call_tool

        cfg = self.cfg
        jobs = []
        for t, parsed in calls:
            for k, (name, arguments, error) in enumerate(parsed or [(None, None, "no tool call found between <tool_call> and </tool_call>")]):
                if error is None and k >= cfg.max_parallel_calls:
                    error = f"at most {cfg.max_parallel_calls} tool calls per turn; this one was not run"
                if error is None and t.tool_calls >= cfg.max_tool_calls:
                    error = f"the limit of {cfg.max_tool_calls} tool calls is reached; answer without tools"
                if error is None:
                    t.tool_calls += 1
                    future = self._pool.submit(call_tool, self.tools, name, arguments, cfg.tool_timeout_s)
                else:
                    future = None
                jobs.append((t, name or "error", future, error))
        results: dict[int, list[tuple[str, str]]] = {}
        for t, name, future, error in jobs:
            res = future.result() if future is not None else ToolResult(error, "error")
            self.stats[f"agent/tool_{res.status}"] += 1
            text = truncate_text(self.tokenizer, res.text, cfg.max_tool_response_tokens)
            results.setdefault(id(t), []).append((name, text))
        for t, _ in calls:
            self._append_masked(t, self.renderer.tool_turn(results[id(t)], t.ids[-1] if t.ids else None), budget)

    def _append_masked(self, t: Trajectory, ids: list[int], budget: int) -> None:
        if len(t.ids) + len(ids) >= budget:
            t.stop(finished=False)  # no room left for another model turn
            return
        t.append(ids, sampled=False)

    # ------------------------------------------------------------------------------ metrics
    def reset_stats(self) -> None:
        keys = ("agent/tool_ok", "agent/tool_error", "agent/tool_timeout", AGENT_UNREADABLE, "timing/agent_generate", "timing/agent_tools")
        self.stats = dict.fromkeys(keys, 0.0)
        self._n = self._turns = self._calls = self._with_call = self._model = self._total = 0
        self._env_reward = 0.0

    def _record(self, trajs: list[Trajectory]) -> None:
        self._n += len(trajs)
        self._turns += sum(len(t.spans) for t in trajs)
        self._calls += sum(t.tool_calls for t in trajs)
        self._with_call += sum(t.tool_calls > 0 for t in trajs)
        self._model += sum(sum(t.mask) for t in trajs)
        self._total += sum(len(t.ids) for t in trajs)
        self._env_reward += sum(t.env_reward for t in trajs)

    def pop_metrics(self) -> dict[str, float]:
        """agent/* and timing/agent_* since the last call (then reset): per-trajectory means and tool outcomes."""
        n = max(self._n, 1)
        m = dict(self.stats)
        m.update({
            "agent/turns_mean": self._turns / n, "agent/tool_calls_mean": self._calls / n,
            "agent/tool_call_ratio": self._with_call / n, "agent/model_tokens_mean": self._model / n,
            "agent/total_tokens_mean": self._total / n,
        })  # fmt: skip
        if self.env_cls is not None:
            m["agent/env_reward_mean"] = self._env_reward / n
            m.update(self.env_calls.pop_metrics())
        self.reset_stats()
        return m


def tool_schemas(multi_turn: "MultiTurnConfig") -> list[dict] | None:
    """The JSON schemas of `rollout.multi_turn.tools` for the chat template's `tools=` (None when the loop is
    off or has no tools): prompts are rendered with them for rollout, validation and SFT alike."""
    if not multi_turn.enable or not multi_turn.tools:
        return None
    from postrl.agents.tools.tools import load_tools

    return [t.schema for t in load_tools(list(multi_turn.tools)).values()]
