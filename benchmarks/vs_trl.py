"""postrl against TRL's GRPOTrainer on the same CPU run: e2e tokens/s, time split, update vs raw bound.

The peers train the same model (the `make run` SFT model), on the same data (the built-in arithmetic
prompts through the model's chat template), with the same reward (math_17k_acc: boxed accuracy; TRL
gets a plain reward function that calls postrl's verifier), group size, batch, max tokens, sampling temperature and loss
(DAPO token-mean, clip 0.2 / 0.28, no KL, no dynamic sampling, no overlong penalty, one optimizer
step per batch):

    postrl-vllm   postrl, rollout.engine=vllm (colocated, in-process vLLM on CPU)
    postrl-hf     postrl, rollout.engine=hf (transformers generate)
    trl           trl.GRPOTrainer(use_cpu=True, bf16=False), HF generate, loss_type="dapo"

All peers live in this one process and take turns step by step (TRL's train() drives the loop; a
callback runs one postrl step of each other peer after each TRL step), so they all see the same
machine load; the ratio postrl / TRL is taken within the run. Each peer runs with its own CPU thread
count: postrl's thread policy (runtime.threads_for), and for TRL by default the same count
(`--trl-threads default` gives it torch's default, every core: on a busy machine that thrashes).

e2e tokens/s is the guides' formula for every peer (docs/metrics.md), over each peer's own
wall-clock time of a step: (mean response length + mean prompt length) x prompts x n / seconds.
The first `--warmup` steps are dropped; medians of the rest are printed.

The raw bound: one plain forward + backward (HF's own next-token loss, no optimizer step) of the
same model on a dense batch with the same number of tokens as postrl's update (rows x mean length),
at postrl's thread count, measured right after each postrl step (so under the same load). update /
raw near 1 means the update costs what the model's math costs; above 1, postrl computes less than
the dense batch (a group's prompt once, not once per sample).

    pip install -e '.[bench]'          # TRL
    python benchmarks/vs_trl.py [--settings 8x8 32x8] [--steps 6] [--warmup 2] [--model DIR] [--lora-rank R]

With --lora-rank every peer trains LoRA adapters of rank R (alpha 2R, all linear layers): postrl's
model.lora_rank, TRL's peft_config.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 64
N = 8  # samples per prompt
LR = 3e-5
SPLIT = ("rollout", "reward", "old_log_p", "update", "sync", "other")


@dataclass
class Step:
    seconds: float
    tokens: float  # the guides' numerator: (mean response + mean prompt length) x rows
    split: dict[str, float]
    rows: int = 0
    update_tokens: float = 0.0  # tokens the update trains on (prompt + response, no padding)
    raw_shape: tuple[int, int] = (0, 0)  # the raw bound's dense batch: rows x mean length
    raw_seconds: float = 0.0  # its forward + backward, measured right after this step


@dataclass
class Peer:
    name: str
    threads: int
    steps: list[Step] = field(default_factory=list)


# ------------------------------------------------------------------------------------- postrl


def postrl_peer(engine: str, model: str, prompts: int, workdir: Path, extra: list[str]):
    from postrl.checks import load_config
    from postrl.trainer import Trainer

    cfg = load_config(
        ROOT / "configs" / "tiny_dapo.yaml",
        [
            f"model.path={model}", f"rollout.engine={engine}", f"rollout.n_samples_per_prompt={N}",
            f"rollout.max_tokens={MAX_TOKENS}",
            "algorithm.overlong_buffer.enable=false", "algorithm.filter_groups.enable=false", "algorithm.kl.coef=0",
            f"train.global_batch_size={prompts}", f"train.gen_batch_size={prompts}", f"train.lr={LR}",
            "train.total_steps=1000", "eval.before_train=false", "eval.after_train=false",
            "logging.progress=false", "logging.sinks=[jsonl]", f"logging.dir={workdir / ('postrl-' + engine)}",
            "checkpoint.save_final=false", "checkpoint.resume=none", *extra,
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.engine.name == engine, f"asked for the {engine} engine, got {trainer.engine.name}"
    return trainer


def postrl_step(trainer) -> Step:
    start = time.perf_counter()
    m = trainer.train_step()
    seconds = time.perf_counter() - start
    trainer.step += 1
    rows = trainer.cfg.train.global_batch_size * N
    tokens = (m["response_length/mean"] + m["prompt_length/mean"]) * rows
    split = {
        "rollout": m["timing/rollout"],
        "reward": m["timing/reward"],
        "old_log_p": m.get("timing/old_log_p", 0.0),
        "update": m["timing/update"],
        "sync": m["timing/resharding_to_infer"] + m.get("timing/resharding_to_train", 0.0),
    }
    split["other"] = seconds - sum(split.values())
    return Step(seconds, tokens, split, rows, tokens)


# ---------------------------------------------------------------------------------------- TRL


def trl_trainer(
    model_path: str, prompts: int, max_steps: int, workdir: Path, on_step, knobs: dict, temperature: float, lora_rank: int = 0
):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.data.dataset import read_rows
    from postrl.rewards.registry import get_verifier
    from postrl.utils import get_dotted

    verifier = get_verifier("math_17k_acc")

    def boxed_accuracy(completions, ground_truth, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(verifier(t, gt, {}).score) for t, gt in zip(texts, ground_truth)]

    rows = read_rows("builtin:arithmetic:train", knobs)  # the postrl peers' prompts
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(get_dotted(r, "reward_model.ground_truth"))} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, fp16=False, report_to="none",
        per_device_train_batch_size=prompts * N, num_generations=N, gradient_accumulation_steps=1,
        max_completion_length=MAX_TOKENS, temperature=temperature, top_p=1.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, mask_truncated_completions=False,
        learning_rate=LR, lr_scheduler_type="constant_with_warmup", warmup_steps=5, max_grad_norm=1.0,
        max_steps=max_steps, logging_steps=1, save_strategy="no", seed=42, disable_tqdm=True, log_completions=False,
    )  # fmt: skip
    peft_config = None
    if lora_rank:  # the same adapters as postrl's model.lora_rank / lora_alpha (all-linear)
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear", lora_dropout=0.0)
    trainer = GRPOTrainer(
        model=model, reward_funcs=boxed_accuracy, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dict would bury the table

    class Interleave(TrainerCallback):
        def on_train_begin(self, *a, **k):
            times.clear()
            times["resume"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            on_step(time.perf_counter() - times["resume"])
            times["resume"] = time.perf_counter()

    times: dict[str, float] = {}
    trainer.add_callback(Interleave())
    return trainer


def instrument_trl(trainer) -> dict[str, float]:
    """Time TRL's phases by wrapping its methods on this instance (benchmark-only)."""
    acc: dict[str, float] = {}

    def timed(name, fn, key_of=None, capture=None):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            key = key_of(*a, **k) if key_of else name
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - start
            if capture is not None:
                capture(out)
            return out

        return wrapper

    def lengths(out):
        acc["prompt_tokens"] = float(out["prompt_mask"].sum())
        acc["response_tokens"] = float(out["completion_mask"].sum())
        acc["rows"] = float(out["completion_mask"].shape[0])

    trainer._generate = timed("rollout", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logps", trainer._get_per_token_logps_and_entropies, key_of=lambda *a, **k: "old_log_p" if not torch.is_grad_enabled() else "train_logps"
    )
    trainer._generate_and_score_completions = timed("experience", trainer._generate_and_score_completions, capture=lengths)
    return acc


def trl_step(acc: dict[str, float], seconds: float) -> Step:
    exp = acc.get("experience", 0.0)
    split = {
        "rollout": acc.get("rollout", 0.0),
        "reward": acc.get("reward", 0.0),
        "old_log_p": acc.get("old_log_p", 0.0),
        "update": seconds - exp,  # loss forward + backward + optimizer (and TRL's per-step bookkeeping)
        "sync": 0.0,
    }
    split["other"] = seconds - sum(split.values())
    tokens = acc["prompt_tokens"] + acc["response_tokens"]
    step = Step(seconds, tokens, split, int(acc["rows"]), tokens)
    acc.clear()
    return step


# ------------------------------------------------------------------------------------ raw bound


class RawBound:
    """One dense forward + backward (HF's next-token loss, no optimizer step) of a copy of the model."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).train()
        self.gen = torch.Generator().manual_seed(0)

    def seconds(self, rows: int, length: int) -> float:
        ids = torch.randint(3, self.model.config.vocab_size, (rows, length), generator=self.gen)
        start = time.perf_counter()
        self.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)
        return seconds


# ----------------------------------------------------------------------------------------- main


def run_setting(
    model: str, prompts: int, steps: int, warmup: int, engines: list[str], extra: list[str], trl_threads: str, lora_rank: int = 0
) -> dict[str, Peer]:
    if lora_rank:
        extra = [*extra, f"model.lora_rank={lora_rank}", f"model.lora_alpha={2 * lora_rank}"]
    default_threads = torch.get_num_threads()  # what a TRL user gets: torch's default
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        peers: dict[str, Peer] = {}
        trainers = {}
        for engine in engines:
            torch.set_num_threads(default_threads)
            trainers[engine] = postrl_peer(engine, model, prompts, workdir, extra)
            peers[f"postrl-{engine}"] = Peer(f"postrl-{engine}", torch.get_num_threads())
        if trl_threads == "postrl":  # TRL at postrl's count: on a busy machine its default would thrash
            default_threads = next(iter(peers.values())).threads
        elif trl_threads != "default":
            default_threads = int(trl_threads)
        peers["trl"] = Peer("trl", default_threads)

        def on_trl_step(seconds: float) -> None:
            peers["trl"].steps.append(trl_step(acc, seconds))
            for engine, trainer in trainers.items():
                torch.set_num_threads(peers[f"postrl-{engine}"].threads)
                step = postrl_step(trainer)
                step.raw_shape = (step.rows, max(1, round(step.update_tokens / step.rows)))
                step.raw_seconds = raw.seconds(*step.raw_shape)  # the bound, on the same tokens, same threads
                peers[f"postrl-{engine}"].steps.append(step)
            torch.set_num_threads(default_threads)
            done = len(peers["trl"].steps)
            line = "  ".join(f"{p.name} {p.steps[-1].tokens / p.steps[-1].seconds:,.0f}" for p in peers.values())
            print(f"  step {done}/{steps + warmup}: e2e tok/s  {line}", flush=True)

        raw = RawBound(model)
        torch.set_num_threads(default_threads)
        recipe = next(iter(trainers.values())).cfg  # TRL gets the postrl peers' prompts and sampling temperature
        trl = trl_trainer(
            model, prompts, steps + warmup, workdir, on_trl_step, recipe.data.builtin.model_dump(), recipe.rollout.temperature, lora_rank
        )
        acc = instrument_trl(trl)
        trl.train()
        for trainer in trainers.values():
            trainer.close()
    for p in peers.values():
        p.steps = p.steps[warmup:]
    return peers


def med(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def report(setting: str, peers: dict[str, Peer]) -> None:
    trl = peers["trl"]
    trl_tps = med(s.tokens / s.seconds for s in trl.steps)
    print(f"\n### {setting}, max {MAX_TOKENS} tokens: median of {len(trl.steps)} steps after warm-up\n")
    print("| peer | threads | e2e tok/s | x TRL | step s | " + " | ".join(SPLIT) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(SPLIT))
    for p in peers.values():
        tps = med(s.tokens / s.seconds for s in p.steps)
        split = " | ".join(f"{med(s.split[k] for s in p.steps):.3f}" for k in SPLIT)
        print(f"| {p.name} | {p.threads} | {tps:,.0f} | {tps / trl_tps:.2f} | {med(s.seconds for s in p.steps):.3f} | {split} |")
    for p in peers.values():
        if not p.name.startswith("postrl"):
            continue
        upd_tps = med(s.update_tokens / s.split["update"] for s in p.steps)
        raw_tps = med(s.raw_shape[0] * s.raw_shape[1] / s.raw_seconds for s in p.steps)
        ratio = med(s.update_tokens / s.split["update"] / (s.raw_shape[0] * s.raw_shape[1] / s.raw_seconds) for s in p.steps)
        rows, length = p.steps[-1].raw_shape
        print(
            f"\n{p.name}: update {upd_tps:,.0f} tok/s; raw forward+backward on [{rows}, ~{length}] {raw_tps:,.0f} tok/s "
            f"(measured after each step); update / raw = {ratio:.2f} (median of the per-step ratios)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_model = ROOT / "runs" / "tiny_sft" / "model"
    ap.add_argument("--model", default=str(default_model), help="SFT model directory (`postrl sft configs/tiny_sft.yaml`)")
    ap.add_argument("--settings", nargs="+", default=["8x8", "32x8"], help="PROMPTSxN, N must be 8")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per peer")
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped first")
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"], help="postrl engines to run")
    ap.add_argument(
        "--trl-threads", default="postrl",
        help="TRL's intra-op threads: postrl (the count postrl's thread policy chose), default (torch's), or N",
    )  # fmt: skip
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (alpha 2 x rank, all-linear) in every peer")
    ap.add_argument("overrides", nargs="*", help="extra postrl config overrides (train.use_remove_padding=true ...)")
    args = ap.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run `postrl sft configs/tiny_sft.yaml` first, or pass --model")
    print(f"load: {os.getloadavg()}  cores: {len(os.sched_getaffinity(0))}  torch threads: {torch.get_num_threads()}")
    for setting in args.settings:
        prompts, n = (int(x) for x in setting.split("x"))
        assert n == N, f"group size is fixed at {N}"
        print(f"\n== {setting}: {prompts} prompts x {N} samples, max {MAX_TOKENS} tokens")
        peers = run_setting(args.model, prompts, args.steps, args.warmup, args.engines, args.overrides, args.trl_threads, args.lora_rank)
        report(setting, peers)
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
