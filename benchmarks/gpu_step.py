"""GRPO steps of Qwen2.5-shaped models on one GPU: postrl's throughput, memory and MFU, and TRL's beside it.

Builds Qwen2.5-0.5B / 1.5B / 3B-shaped models from their published configs (postrl.memory.QWEN25:
hidden size, layers, heads, MLP width, vocabulary 151,936) with random weights, so nothing is
downloaded; the built-in tiny tokenizer supplies the token ids (its 512 ids are a subset of the
vocabulary). A random model almost never samples EOS, so every response runs to --response tokens
and the work per step is fixed. Prompts are exactly --prompt tokens after the chat template.

Each run trains in its own subprocess (clean GPU memory and peak counters), one after the other in
this one invocation, so all see the same machine:
  postrl   `postrl train` settings: GRPO, --prompts x --samples per step, one optimizer step per
           step (on-policy), no KL, micro-batches of --micro sequences, gradient checkpointing,
           model.dtype bfloat16 (fp32 masters), rollout.engine auto (vLLM where installed, else HF).
  trl      (--peer trl) TRL's GRPOTrainer with the same model directory, prompts, reward (a
           constant: the reward's cost is not what is compared), group size, lengths, micro-batch
           (per_device_train_batch_size, gradient accumulation to the same batch), checkpointing
           and precision (fp32 weights, bf16 autocast); vLLM colocated where installed.

Printed per shape: e2e_tps, update_tps, rollout tps (postrl's metric definitions, docs/gpu.md), step
seconds, peak GPU memory, and MFU of the update = 6 x parameters x tokens / update seconds / peak
FLOP/s (the 6PT convention: attention FLOPs and checkpointing's recompute not counted; 4PT with
--lora-rank, whose frozen base computes no weight gradients), with peak
FLOP/s from --peak-tflops or the table below. The first step of each run is a warm-up and is left
out of the means. With --peer trl the TRL / postrl ratio of e2e_tps is printed (TRL reports no
update/rollout split). Missing TRL is reported and skipped, not fatal.

    python benchmarks/gpu_step.py --shapes 0.5b 1.5b --steps 3 --peer trl --out results.json
    python benchmarks/gpu_step.py --shapes 7b --steps 2 --lora-rank 64 --peer trl   # 7B on one GPU: adapters
    python benchmarks/gpu_step.py --smoke          # CPU, a minute: a tiny Qwen2.5-vocabulary model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Dense bf16 tensor-core peaks (vendor data sheets, TFLOP/s), matched against the device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0}
SMOKE_SHAPE = dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=151_936, tied=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], help="Qwen2.5 shapes: 0.5b 1.5b 3b (7b ...)")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--response", type=int, default=1024, help="response tokens (rollout.max_tokens)")
    ap.add_argument("--micro", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (alpha 2 x rank, all-linear) in both frameworks")
    ap.add_argument("--attn", default="auto", help="model.attn_implementation for both frameworks (auto: flash_attention_2 where installed, else sdpa)")
    ap.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"], help="postrl rollout.engine")
    ap.add_argument("--peer", choices=["trl"], default=None, help="also run TRL's GRPOTrainer on the same settings")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s of the device for MFU (default: table)")
    ap.add_argument("--device", default="auto", help="train.device (auto: cuda when present)")
    ap.add_argument("--smoke", action="store_true", help="CPU-sized run: tiny shape, 4 x 4 samples, 32 + 32 tokens, 2 steps, hf")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one (framework, shape) and print JSON
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.steps, args.prompts, args.samples = ["smoke"], 2, 4, 4
        args.prompt, args.response, args.micro, args.dtype = 32, 32, 8, "float32"
        args.engine = "hf"  # vLLM on CPU spends minutes starting up
    return args


# ----------------------------------------------------------------------------------- model + data


def shape_of(name: str):
    from postrl.memory import QWEN25, Shape

    return Shape(**SMOKE_SHAPE) if name == "smoke" else QWEN25[name]


def build_model_dir(name: str, out: Path, device: str) -> Path:
    """A Qwen2.5-shaped model with random weights (bf16 on disk) and the tiny tokenizer, in `out`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from postrl.builtin.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model())
    s = shape_of(name)
    config = Qwen2Config(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, vocab_size=s.vocab, tie_word_embeddings=s.tied, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # initialise where it is fast
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == s.params(), "the built model differs from the published shape"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def write_prompts(model_dir: Path, path: Path, n: int, tokens: int) -> list[str]:
    """`n` distinct prompts of exactly `tokens` tokens after the chat template, as verl-schema JSONL."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    texts = []
    for _ in range(n):
        words = [str(rng.randint(0, 9)) for _ in range(2 * tokens)]
        lo, hi = 0, len(words)
        while lo < hi:  # the longest prefix whose templated prompt fits
            mid = (lo + hi + 1) // 2
            if _prompt_len(tok, " ".join(words[:mid])) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        while _prompt_len(tok, text) < tokens:
            text += "0"  # a digit is one token: pad to the exact length
        texts.append(text)
    with path.open("w") as f:
        for t in texts:
            f.write(json.dumps({"prompt": [{"role": "user", "content": t}], "reward_model": {"ground_truth": "0"}}) + "\n")
    return texts


def _prompt_len(tok, text: str) -> int:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ----------------------------------------------------------------------------------------- workers


def postrl_overrides(args, model_dir: Path, data: Path, work: Path) -> list[str]:
    """The `postrl train` settings of a run (benchmarks/gpu_check.py adds its own to these)."""
    B, G = args.prompts, args.samples
    return [
        f"model.path={model_dir}", f"model.dtype={args.dtype}", f"model.gradient_checkpointing={not args.no_checkpointing}",
        f"model.attn_implementation={args.attn}", f"model.lora_rank={args.lora_rank}", f"model.lora_alpha={2 * max(args.lora_rank, 1)}",
        f"data.train_files=[{data}]", "data.val_files=[]", f"data.max_prompt_length={args.prompt}", "data.shuffle=false",
        f"rollout.engine={args.engine}", f"rollout.n_samples_per_prompt={G}", f"rollout.max_tokens={args.response}",
        "rollout.gpu_memory_utilization=0.35", "reward.verifiers=[format]", "algorithm.name=grpo", "algorithm.kl.coef=0",
        f"train.global_batch_size={B}", f"train.micro_batch_size={args.micro}", f"train.total_steps={args.steps}",
        "train.lr=1e-6", f"train.device={args.device}", "eval.before_train=false", "eval.after_train=false",
        "checkpoint.save_final=false", "logging.progress=false", f"logging.dir={work / 'postrl'}", "guards.enable=false",
    ]  # fmt: skip


def run_postrl(args, model_dir: Path, data: Path, work: Path) -> dict:
    import torch

    from postrl.checks import load_config
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    tr = Trainer(load_config(None, postrl_overrides(args, model_dir, data, work), check_paths=False))
    params = sum(p.numel() for p in tr.model.parameters())
    engine = tr.engine.name
    if tr.runtime.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tr.fit()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    rows = [r for r in read_jsonl(work / "postrl" / "metrics.jsonl") if "timing/all" in r]
    timed = rows[1:] or rows  # the first step warms up kernels and allocators

    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    return {
        "framework": "postrl", "engine": engine, "attn": tr.model.config._attn_implementation, "params": params, "steps_timed": len(timed),
        "e2e_tps": mean("e2e_tps"), "update_tps": mean("update_tps"), "rollout_tps": mean("rollout_tps"),
        "step_s": mean("timing/all"), "update_s": mean("timing/update"), "rollout_s": mean("timing/rollout"),
        "response_len": mean("response_length/mean"), "prompt_len": mean("prompt_length/mean"), "peak_mem_gib": peak / 2**30,
    }  # fmt: skip


def run_trl(args, model_dir: Path, data: Path, work: Path) -> dict:
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        return {"framework": "trl", "skipped": f"TRL is not installed here ({exc}); pip install trl"}
    import trl

    B, G = args.prompts, args.samples
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    use_vllm = args.engine != "hf" and _has_vllm() and torch.cuda.is_available()
    wanted = dict(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.micro, gradient_accumulation_steps=B * G // args.micro,
        num_generations=G, max_prompt_length=args.prompt, max_completion_length=args.response, temperature=1.0, top_p=1.0,
        learning_rate=1e-6, beta=0.0, num_iterations=1, loss_type="grpo", bf16=args.dtype == "bfloat16",
        gradient_checkpointing=not args.no_checkpointing, max_steps=args.steps, logging_steps=1, report_to=[],
        save_strategy="no", seed=42, use_vllm=use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.35,
        use_cpu=not torch.cuda.is_available(), shuffle_dataset=False,
    )  # fmt: skip
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(k for k in wanted if k not in fields)
    config = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    from postrl.models import attention_implementation
    from postrl.runtime import configure_threads

    attn = attention_implementation(args.attn, torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)  # fp32 masters, as postrl
    configure_threads(model)  # the same CPU thread policy as the postrl run (matters on CPU only)

    def constant_reward(completions, **kwargs):
        return [0.0] * len(completions)

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear", lora_dropout=0.0)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[constant_reward], args=config, train_dataset=ds, processing_class=tok, callbacks=[StepClock()],
        peft_config=peft_config,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    steps = [b - a for a, b in zip([start] + ends[:-1], ends)]
    timed = steps[1:] or steps
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    resp = sum(lens[1:] or lens) / max(len(lens[1:] or lens), 1)
    step_s = sum(timed) / len(timed)
    per_step = [  # every step, the warm-up too: seconds, mean response length, e2e tokens/s
        {"step_s": s, "response_len": n, "e2e_tps": (args.prompt + n) * B * G / s} for s, n in zip(steps, lens)
    ]
    return {
        "steps": per_step,
        "framework": "trl", "version": trl.__version__, "engine": "vllm" if use_vllm else "hf", "attn": attn, "steps_timed": len(timed),
        "e2e_tps": (args.prompt + resp) * B * G / step_s, "step_s": step_s, "response_len": resp, "prompt_len": args.prompt,
        "peak_mem_gib": peak / 2**30, "settings_unknown_to_this_trl": dropped,
    }  # fmt: skip


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------------------- driver


def peak_flops(args) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU (pass --peak-tflops for MFU)"
    name = torch.cuda.get_device_name(0)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            scale = 1.0 if args.dtype == "bfloat16" else 0.5 ** 4  # fp32 (TF32 off) is ~1/16 of bf16 on tensor-core GPUs
            return tflops * 1e12 * scale, f"{name}: {tflops:g} TFLOP/s dense bf16" + ("" if scale == 1 else " / 16 (fp32)")
    return None, f"{name}: not in the table (pass --peak-tflops)"


def worker(args) -> None:
    framework, shape, model_dir, data, work = args.worker.split(",")
    fn = run_postrl if framework == "postrl" else run_trl
    result = fn(args, Path(model_dir), Path(data), Path(work))
    print("RESULT " + json.dumps({"shape": shape, **result}), flush=True)


def run_one(framework: str, shape: str, model_dir: Path, data: Path, work: Path, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--worker", f"{framework},{shape},{model_dir},{data},{work}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        return {"shape": shape, "framework": framework, "failed": f"exit {proc.returncode} (its log is above): {last[:200]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    device = "cuda" if (args.device in ("auto", "cuda") and torch.cuda.is_available()) else "cpu"
    flops, flops_note = peak_flops(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp:
        for shape in args.shapes:
            work = Path(tmp) / shape
            work.mkdir()
            t0 = time.perf_counter()
            model_dir = build_model_dir(shape, work / "model", device)
            data = work / "prompts.jsonl"
            write_prompts(model_dir, data, args.prompts, args.prompt)
            print(f"[{shape}] model and prompts ready in {time.perf_counter() - t0:.0f} s", flush=True)
            for framework in ["postrl"] + ([args.peer] if args.peer else []):
                r = run_one(framework, shape, model_dir, data, work, argv)
                if "update_tps" in r and flops:
                    tokens_per_s = r["update_tps"]  # tokens of the step / update seconds (one device)
                    per_token = 4 if args.lora_rank else 6  # a frozen base needs no weight gradients: 2 (fwd) + 2 (input grads)
                    r["mfu_update"] = per_token * r["params"] * tokens_per_s / flops
                results.append(r)
                print(json.dumps(r), flush=True)
                if args.out:  # after every run: a later one that runs out of time keeps the earlier results
                    Path(args.out).write_text(json.dumps({"settings": vars(args), "peak_flops": flops_note, "results": results}, indent=1))
    print_table(args, results, flops_note)
    return 0


def print_table(args, results: list[dict], flops_note: str) -> None:
    gc = "off" if args.no_checkpointing else "on"
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, {args.prompt} prompt + {args.response} response tokens, "
        f"micro-batch {args.micro}, {args.dtype}, gradient checkpointing {gc}"
        + (f", LoRA rank {args.lora_rank}" if args.lora_rank else "") + f"; MFU peak: {flops_note}"
    )
    head = f"{'shape':<7}{'framework':<10}{'engine':<7}{'attention':<18}{'e2e_tps':>9}{'update_tps':>11}{'rollout_tps':>12}{'step s':>8}{'peak GiB':>9}{'MFU upd':>8}{'vs postrl':>10}"
    print(head)
    print("-" * len(head))
    by_shape: dict[str, float] = {}
    for r in results:
        if "failed" in r or "skipped" in r:
            print(f"{r['shape']:<7}{r['framework']:<10}{r.get('failed') or r.get('skipped')}")
            continue
        if r["framework"] == "postrl":
            by_shape[r["shape"]] = r["e2e_tps"]
        ratio = r["e2e_tps"] / by_shape[r["shape"]] if r["shape"] in by_shape else float("nan")

        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if key in r else "-"

        mfu = f"{r['mfu_update'] * 100:.1f}%" if "mfu_update" in r else "-"
        print(
            f"{r['shape']:<7}{r['framework']:<10}{r['engine']:<7}{r.get('attn', '-'):<18}{f('e2e_tps', '9.0f')}{f('update_tps', '11.0f'):>11}"
            f"{f('rollout_tps', '12.0f'):>12}{f('step_s', '8.1f')}{f('peak_mem_gib', '9.1f')}{mfu:>8}{ratio:>10.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
