"""The agent loop's cost: its model tokens/s against one-shot generation on the same engine, one run.

    python benchmarks/agent_loop.py                                   # the tool demo's SFT model, hf
    python benchmarks/agent_loop.py --engine vllm
    python benchmarks/agent_loop.py --model runs/tiny_tool_dapo/checkpoints/best/model

The workload is one rollout batch of the tool demo (configs/tiny_tool_dapo.yaml): `--prompts` held-out
`builtin:tool_arithmetic` prompts x `--n` samples at temperature 1 with `builtin:calculator`. The agent
loop runs it multi-turn (generate until EOS or </tool_call>, run the calls, render the results, generate
again: with vLLM one continuous batch that each trajectory's next turn joins, with HF one engine call
per turn); the one-shot side asks the same engine object (same settings: eager or compiled, KV cache,
threads, seed) for the same prompts in one call, with a budget of the loop's mean model tokens per
trajectory (so both sample about as many tokens, one-shot at most that many). Both count the tokens
the model sampled (the loop: its loss-masked tokens, so every prefill of tool results, every turn
boundary and the tools themselves are overhead it pays). Calls alternate (loop, one-shot, loop, ...)
after a warm-up of each, so load from other processes hits both alike. Printed: median tokens/s of
each and their ratio (goal: >= 0.8x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/tiny_tool_sft/model", help="a model that calls tools (postrl sft configs/tiny_tool_sft.yaml)")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96, help="response budget (the loop: across turns)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="vLLM: compile the model (rollout.enforce_eager false); default eager")
    ap.add_argument("--by-turns", action="store_true", help="vLLM: one engine call per turn, as the HF engine (the loop before continuous batching)")
    args = ap.parse_args()

    from postrl.agents.loop.loop import AgentLoop, tool_schemas
    from postrl.config import DataConfig, MultiTurnConfig, RolloutConfig
    from postrl.data.dataset import load_prompts
    from postrl.models import load_model, load_tokenizer
    from postrl.rollout import make_engine
    from postrl.rollout.base import SamplingParams

    model, tokenizer = load_model(args.model).eval(), load_tokenizer(args.model)
    mt = MultiTurnConfig(enable=True, tools=["builtin:calculator"], max_turns=3, max_tool_calls=2)
    examples, _ = load_prompts(["builtin:tool_arithmetic:val"], tokenizer, DataConfig(), max_rows=args.prompts, tools=tool_schemas(mt))
    prompts = [e.prompt_ids for e in examples]
    engine = make_engine(RolloutConfig(engine=args.engine, enforce_eager=not args.compile), model, tokenizer, max_model_len=512)
    loop = AgentLoop(_ByTurns(engine) if args.by_turns else engine, tokenizer, mt, model=model)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=0)

    def run_loop() -> tuple[int, float, float]:
        start = time.perf_counter()
        out = loop.generate(prompts, params)
        seconds = time.perf_counter() - start
        return sum(sum(c.loss_mask) for c in out), seconds, sum(c.tool_calls > 0 for c in out) / len(out)

    warm_tokens = run_loop()[0]  # warm-up; sets the one-shot budget to the loop's model tokens per trajectory
    once_params = replace(params, max_tokens=max(1, round(warm_tokens / (len(prompts) * args.n))))

    def run_once() -> tuple[int, float]:
        start = time.perf_counter()
        out = engine.generate(prompts, once_params)
        return sum(len(c.token_ids) for c in out), time.perf_counter() - start

    run_once()  # warm-up
    loop_tps, once_tps = [], []
    for r in range(args.repeats):
        tokens, seconds, calling = run_loop()
        loop_tps.append(tokens / seconds)
        print(f"agent loop  {tokens:6d} model tokens in {seconds:6.2f} s = {tokens / seconds:8.0f} tokens/s ({calling:.0%} call the tool)")
        tokens, seconds = run_once()
        once_tps.append(tokens / seconds)
        print(f"one-shot    {tokens:6d} tokens       in {seconds:6.2f} s = {tokens / seconds:8.0f} tokens/s")
    m = loop.pop_metrics()
    print(f"loop time split: generate {m['timing/agent_generate']:.2f} s, tools {m['timing/agent_tools']:.2f} s; turns/trajectory {m['agent/turns_mean']:.2f}")
    ratio = statistics.median(loop_tps) / statistics.median(once_tps)
    print(f"{args.engine}: agent loop {statistics.median(loop_tps):.0f} tokens/s vs one-shot {statistics.median(once_tps):.0f} tokens/s = {ratio:.2f}x (goal >= 0.8x)")
    loop.close()


class _ByTurns:
    """The engine without `generate_continuing`: the agent loop then makes one engine call per turn."""

    def __init__(self, engine):
        self.engine, self.name, self.capabilities = engine, engine.name, engine.capabilities

    def generate(self, prompts, params, multi_modal=None):
        return self.engine.generate(prompts, params, multi_modal=multi_modal)

    def close(self):
        self.engine.close()


if __name__ == "__main__":
    main()
