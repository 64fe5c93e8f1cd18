"""Rollout throughput: transformers `generate` (HFEngine) vs vLLM (VLLMEngine), same workload, one process.

    python benchmarks/rollout_engines.py                 # 32 prompts x n=8 x 64 tokens, tiny Qwen2
    python benchmarks/rollout_engines.py --tiny hidden_size=256,num_layers=8

The workload is one GRPO rollout batch: `--prompts` chat prompts (built-in arithmetic problems),
`--n` samples each, up to `--max-tokens` new tokens at temperature 1. The tiny model is randomly
initialised, so it rarely emits EOS (~1/vocab per token) and nearly every sequence runs to the limit;
tokens/s counts the tokens actually generated. Each engine gets one warm-up call, then `--repeats`
timed calls with the same seeds; the table reports best and median tokens/s and the vLLM/HF ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_tiny(spec: str) -> dict[str, int]:
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value)
    return out


def bench(engine, prompts, params, repeats: int) -> dict[str, float]:
    engine.generate(prompts, params)  # warm-up
    rates, tokens = [], 0
    for r in range(repeats):
        start = time.perf_counter()
        completions = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        rates.append(tokens / seconds)
    return {"best": max(rates), "median": statistics.median(rates), "tokens": tokens, "sequences": len(completions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per rollout batch")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per sample (upper bound)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per engine after one warm-up")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM CPU KV cache (rollout.kv_cache_space_gb)")
    ap.add_argument("--tiny", default="", help="tiny-model overrides, e.g. hidden_size=256,num_layers=8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from postrl.config import DataConfig, RolloutConfig
    from postrl.data.dataset import load_prompts
    from postrl.models import build_tiny_model, load_model, load_tokenizer
    from postrl.rollout.base import SamplingParams
    from postrl.rollout.hf import HFEngine
    from postrl.rollout.vllm import VLLMEngine

    path = str(build_tiny_model(**parse_tiny(args.tiny)))
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    examples, _ = load_prompts(["builtin:arithmetic:val"], tokenizer, DataConfig(), max_rows=args.prompts)
    prompts = [e.prompt_ids for e in examples][: args.prompts]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {path} ({n_params / 1e6:.2f}M params, fp32), {len(prompts)} prompts x n={args.n} x "
        f"max {args.max_tokens} tokens, torch threads {torch.get_num_threads()}, {args.repeats} timed runs"
    )

    # HF at the process's torch threads (what the trainer uses) and at one thread (vLLM's CPU setting),
    # so the ratio is against the better of the two.
    threads = torch.get_num_threads()
    results = {f"hf ({threads} threads)": bench(HFEngine(model, tokenizer), prompts, params, args.repeats)}
    if threads > 1:
        torch.set_num_threads(1)
        results["hf (1 thread)"] = bench(HFEngine(model, tokenizer), prompts, params, args.repeats)
        torch.set_num_threads(threads)
    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tokenizer, RolloutConfig(kv_cache_space_gb=args.kv_cache_gb, max_num_seqs=256))
    startup = time.perf_counter() - start
    results["vllm"] = bench(vllm_engine, prompts, params, args.repeats)

    print("\n| engine | tokens/s (best) | tokens/s (median) | tokens per run |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['best']:,.0f} | {r['median']:,.0f} | {r['tokens']:,} |")
    vl = results.pop("vllm")
    best_hf = max(results.values(), key=lambda r: r["median"])
    print(f"| vLLM / best HF | {vl['best'] / best_hf['best']:.1f}x | {vl['median'] / best_hf['median']:.1f}x | |")
    print(f"\nvLLM engine start-up (build + first weight sync): {startup:.1f} s")


if __name__ == "__main__":  # vLLM needs the guard
    main()
