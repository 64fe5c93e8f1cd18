"""Rollout throughput: transformers `generate` (HFEngine) vs vLLM (VLLMEngine), same workload, one process.

    python benchmarks/rollout_engines.py                 # 32 prompts x n=8 x 64 tokens, tiny Qwen2
    python benchmarks/rollout_engines.py --tiny hidden_size=256,intermediate_size=768   # 3.3M params
    OMP_NUM_THREADS=2 python benchmarks/rollout_engines.py ...   # both engines on two threads
    python benchmarks/rollout_engines.py --tiny hidden_size=512,num_layers=8,intermediate_size=1536

The workload is one GRPO rollout batch: `--prompts` chat prompts (built-in arithmetic problems),
`--n` samples each, up to `--max-tokens` new tokens at temperature 1. The tiny model is randomly
initialised, so it rarely emits EOS (~1/vocab per token) and nearly every sequence runs to the limit;
tokens/s counts the tokens actually generated.

HF runs twice: at the process's torch threads (what `rollout.engine: hf` uses in the trainer) and at
one thread (vLLM's own CPU serving setting; on a small shared machine often the faster one). Every
engine gets one warm-up call, then the timed calls are interleaved (hf, hf-1, vllm, hf, ...) so that
load from other processes hits all of them alike. Reported: best and median tokens/s and the ratio of
vLLM to the better HF setting.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per rollout batch")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per sample (upper bound)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per engine after one warm-up")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM CPU KV cache (rollout.kv_cache_space_gb)")
    ap.add_argument("--tiny", default="", help="tiny-model overrides, e.g. hidden_size=512,num_layers=8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from postrl.config import DataConfig, RolloutConfig
    from postrl.data.dataset import load_prompts
    from postrl.builtin.tiny import build_tiny_model
    from postrl.models import load_model, load_tokenizer
    from postrl.rollout.base import SamplingParams
    from postrl.rollout.hf import HFEngine
    from postrl.rollout.vllm import VLLMEngine

    path = str(build_tiny_model(**parse_tiny(args.tiny)))
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    examples, _ = load_prompts(["builtin:arithmetic:val"], tokenizer, DataConfig(), max_rows=args.prompts)
    prompts = [e.prompt_ids for e in examples][: args.prompts]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=args.seed)
    threads = torch.get_num_threads()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {path} ({n_params / 1e6:.2f}M params, fp32); {len(prompts)} prompts x n={args.n} x "
        f"max {args.max_tokens} new tokens (mean prompt {sum(map(len, prompts)) / len(prompts):.0f} tokens); "
        f"torch threads {threads}; {args.repeats} timed runs each"
    )

    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tokenizer, RolloutConfig(kv_cache_space_gb=args.kv_cache_gb, max_num_seqs=256))
    startup = time.perf_counter() - start
    hf_engine = HFEngine(model, tokenizer)
    runs = {f"hf ({threads} thread{'s' if threads > 1 else ''})": (hf_engine, threads)}
    if threads > 1:
        runs["hf (1 thread)"] = (hf_engine, 1)
    # VLLMEngine generates on one thread unless OMP_NUM_THREADS is set (then on that many).
    vllm_name = f"vllm ({vllm_engine.rollout_threads} thread{'s' if vllm_engine.rollout_threads > 1 else ''})"
    runs[vllm_name] = (vllm_engine, threads)

    def once(engine, n_threads: int) -> tuple[float, int]:
        torch.set_num_threads(n_threads)
        try:
            t0 = time.perf_counter()
            completions = engine.generate(prompts, params)
            seconds = time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)
        tokens = sum(len(c.token_ids) for c in completions)
        return tokens / seconds, tokens

    rates: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, int] = {}
    for name, (engine, n_threads) in runs.items():
        once(engine, n_threads)  # warm-up
    for _ in range(args.repeats):
        for name, (engine, n_threads) in runs.items():
            rate, tokens[name] = once(engine, n_threads)
            rates[name].append(rate)

    print("\n| engine | tokens/s (best) | tokens/s (median) | tokens per run |")
    print("|---|---:|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {max(r):,.0f} | {statistics.median(r):,.0f} | {tokens[name]:,} |")
    vl = rates[vllm_name]
    best_hf = max((r for name, r in rates.items() if name != vllm_name), key=statistics.median)
    print(f"| vLLM / best HF | {max(vl) / max(best_hf):.1f}x | {statistics.median(vl) / statistics.median(best_hf):.1f}x | |")
    print(f"\nvLLM engine start-up (build + first weight sync): {startup:.1f} s")


if __name__ == "__main__":  # vLLM needs the guard
    main()
