"""The rollout endpoint's cost: model tokens/s through it against the in-process agent loop, same batch.

    python benchmarks/gateway.py                                  # the tool demo's SFT model, hf
    python benchmarks/gateway.py --engine vllm
    python benchmarks/gateway.py --model builtin:tiny-qwen2-tools # no SFT model: single turns, no tool calls

The workload is one rollout batch of the tool demo: `--prompts` held-out `builtin:tool_arithmetic`
prompts x `--n` samples at temperature 1. One side is postrl's agent loop (`rollout.multi_turn` with
`builtin:calculator`: 3 turns, 2 calls, as configs/tiny_tool_dapo.yaml); the other is the same task as
a plain openai-client program (examples/openai_agent/calculator_agent.py) through the endpoint
(`rollout.agent`), so every model call is an HTTP request, rendered from the program's messages,
batched with the other programs' requests into engine calls, and parsed back into tool calls. Both
wrap the same engine object (same settings, threads, seed) and count the tokens the model sampled
(their loss-masked tokens). Calls alternate (loop, endpoint, loop, ...) after a warm-up of each, so load
from other processes hits both alike. Printed: the median tokens/s of each and their ratio (goal >= 0.8x),
and the CPU seconds of each rollout (all threads of this process) with the same ratio per CPU second
(what the endpoint costs in CPU, less sensitive to other processes' load on a shared machine).
`--async-program` adds a third arm, the example's async variant (`run_async`, AsyncOpenAI clients on
one event loop instead of a thread per program). `--agent-workers 1 2` adds an arm per number: the sync
program in that many worker processes (`rollout.agent_workers`); their CPU seconds are not in this
process's, so the per-CPU-second ratio of those arms counts the trainer's side only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/tiny_tool_sft/model", help="a model that calls tools (postrl sft configs/tiny_tool_sft.yaml)")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96, help="response budget across turns")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-wait-ms", type=float, default=20.0, help="rollout.agent_batch_wait_ms")
    ap.add_argument("--async-program", action="store_true", help="also measure the example's async variant (run_async: one event loop)")
    ap.add_argument("--agent-workers", type=int, nargs="*", default=[], metavar="N",
                    help="also measure the sync program in N worker processes (rollout.agent_workers), an arm per N")  # fmt: skip
    args = ap.parse_args()

    from postrl.agents.endpoint.gateway import AgentGateway
    from postrl.agents.loop.loop import AgentLoop, tool_schemas
    from postrl.config import DataConfig, MultiTurnConfig, RolloutConfig
    from postrl.data.dataset import load_prompts
    from postrl.models import load_model, load_tokenizer, resolve_model_path
    from postrl.rollout import make_engine
    from postrl.rollout.base import SamplingParams

    path = resolve_model_path(args.model)
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    mt = MultiTurnConfig(enable=True, tools=["builtin:calculator"], max_turns=3, max_tool_calls=2)
    examples, _ = load_prompts(["builtin:tool_arithmetic:val"], tokenizer, DataConfig(), max_rows=args.prompts, tools=tool_schemas(mt))
    prompts, rows = [e.prompt_ids for e in examples], [e.row for e in examples]
    engine = make_engine(RolloutConfig(engine=args.engine, enforce_eager=True), model, tokenizer, max_model_len=512)
    loop = AgentLoop(engine, tokenizer, mt, model=model)
    arms = {"agent loop": loop}
    for name, fn in (("endpoint", "run"), ("endpoint async", "run_async"))[: 1 + args.async_program]:
        agent = f"{ROOT}/examples/openai_agent/calculator_agent.py:{fn}"
        rollout = RolloutConfig(agent=agent, agent_concurrency=len(prompts) * args.n, agent_batch_wait_ms=args.batch_wait_ms)
        arms[name] = AgentGateway(engine, tokenizer, rollout, model=model, max_model_len=512)
    for workers in args.agent_workers:
        agent = f"{ROOT}/examples/openai_agent/calculator_agent.py:run"
        rollout = RolloutConfig(agent=agent, agent_concurrency=len(prompts) * args.n, agent_batch_wait_ms=args.batch_wait_ms,
                                agent_workers=workers)  # fmt: skip
        arms[f"endpoint {workers}w"] = AgentGateway(engine, tokenizer, rollout, model=model, max_model_len=512)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=0)

    def workers_cpu(side) -> float:
        """The CPU seconds of the side's worker processes so far (rollout.agent_workers), 0 for the others."""
        import psutil

        procs = [w.proc.pid for w in getattr(side.programs, "workers", []) if w is not None] if side is not loop else []
        return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in procs)

    def run(side) -> tuple[int, float, float, float, float]:
        start, cpu, wcpu = time.perf_counter(), time.process_time(), workers_cpu(side)
        out = side.generate(prompts, params, rows=rows) if side is not loop else side.generate(prompts, params)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if side is not loop and getattr(side.programs, "workers", None):
            print(f"{'':14s} + {workers_cpu(side) - wcpu:.2f} s CPU in the worker processes", flush=True)
        turns = sum(len(c.turn_spans or []) for c in out) / len(out)
        return sum(sum(c.loss_mask) for c in out), seconds, cpu, sum(c.tool_calls > 0 for c in out) / len(out), turns

    for side in arms.values():  # warm-up (the endpoint starts on its first call)
        run(side)
        side.pop_metrics()
    tps: dict[str, list[float]] = {name: [] for name in arms}
    per_cpu: dict[str, list[float]] = {name: [] for name in arms}  # model tokens per CPU second of this process
    for _ in range(args.repeats):
        for name, side in arms.items():
            tokens, seconds, cpu, calling, turns = run(side)
            tps[name].append(tokens / seconds)
            per_cpu[name].append(tokens / cpu)
            print(f"{name:14s} {tokens:6d} model tokens in {seconds:6.2f} s ({cpu:5.2f} s CPU) = {tokens / seconds:8.0f} tokens/s "
                  f"({calling:.0%} call the tool, {turns:.2f} turns)", flush=True)  # fmt: skip
    a = statistics.median(tps["agent loop"])
    for name, side in list(arms.items())[1:]:
        m = side.pop_metrics()
        print(f"{name}: time split over {args.repeats} rollouts: {m['timing/agent_generate']:.2f} s in all, engine "
              f"{m['timing/agent_engine']:.2f} s, rendering requests {m['timing/agent_render']:.2f} s, waiting for requests "
              f"{m['timing/agent_idle']:.2f} s, {m['agent/ticks']:.0f} ticks; "
              f"{m['agent/requests_mean']:.2f} requests per sample, {m['agent/batch_mean']:.1f} requests per engine call, "
              f"errors {m['agent/errors']:.0f}, timeouts {m['agent/timeouts']:.0f}, bad requests {m['agent/bad_requests']:.0f}")  # fmt: skip
        b = statistics.median(tps[name])
        c, d = statistics.median(per_cpu["agent loop"]), statistics.median(per_cpu[name])
        print(f"{args.engine}: {name} {b:.0f} tokens/s vs agent loop {a:.0f} tokens/s = {b / a:.2f}x (goal >= 0.8x); "
              f"per CPU second {d:.0f} vs {c:.0f} = {d / c:.2f}x")  # fmt: skip
    for side in list(arms.values())[1:]:
        side.programs.close()
        side._server.close()
    loop.close()  # closes the engine too


if __name__ == "__main__":
    main()
