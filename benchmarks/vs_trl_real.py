"""postrl against TRL's GRPOTrainer on a real pretrained model: held-out greedy accuracy against wall time.

Both peers run configs/smollm2_grpo.yaml's setting (issue 63): SmolLM2-135M-Instruct from the instruct model,
the recipe's prompts (two-number word problems with its instruction, through the model's chat template), its
reward (gsm8k_flexible: the last number of the answer), group size, prompts per step, learning rate, warm-up,
response budget and temperature; GRPO's loss (token mean per sequence, clip 0.2, no KL). The peers run one after
the other, never at once (a real model's training process holds ~10 GB; the machine load differs between them, so
run both on a quiet machine or read the ratio with care):

    postrl   `postrl train configs/smollm2_grpo.yaml` (vLLM rollout where installed), validation every --every steps
    trl      trl.GRPOTrainer(use_cpu=True, bf16=False), HF generate, loss_type="grpo", beta=0; the same
             greedy validation (HF generate, the recipe's budget) every --every steps, its time left out

Each peer stops at --steps or after --budget-s seconds of training time (validation excluded). Printed: each
validation's step, training seconds so far and held-out greedy accuracy, then each peer's last accuracy and the
time it took to reach the other's last accuracy.

    pip install -e '.[bench]'          # TRL
    python benchmarks/vs_trl_real.py [--steps 30] [--every 5] [--budget-s 1800] [--val 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "smollm2_grpo.yaml"


def run_postrl(workdir: Path, steps: int, every: int, budget_s: float, val: int) -> list[tuple[int, float, float]]:
    """(step, training seconds, held-out greedy accuracy) of each validation of a `postrl train` run of the recipe."""
    run = workdir / "postrl"
    cmd = [sys.executable, "-m", "postrl.cli", "train", str(RECIPE), f"logging.dir={run}", f"train.total_steps={steps}",
           f"eval.freq={every}", f"eval.max_prompts={val}", "logging.sinks=[jsonl]", "logging.progress=false"]  # fmt: skip
    try:
        subprocess.run(cmd, timeout=budget_s * 2 + 600, check=False)
    except subprocess.TimeoutExpired:
        print("postrl: stopped at the time limit; its validations so far are below")
    points, seconds = [], 0.0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        seconds += row.get("timing/all", 0.0)
        acc = [v for k, v in row.items() if k.startswith("val/") and k.endswith("/acc_mean@1")]
        if acc:
            points.append((row["step"], seconds, acc[0]))
    return points


def run_trl(workdir: Path, steps: int, every: int, budget_s: float, val: int) -> list[tuple[int, float, float]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.checks import load_config
    from postrl.data.dataset import read_rows
    from postrl.models import resolve_model_path
    from postrl.rewards.registry import get_verifier
    from postrl.utils import get_dotted

    cfg = load_config(RECIPE)
    r, t = cfg.rollout, cfg.train
    verifier = get_verifier(cfg.reward.verifiers[0].name)

    def reward(completions, ground_truth, **_):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(verifier(x, gt, {}).score) for x, gt in zip(texts, ground_truth)]

    knobs = cfg.data.builtin.model_dump()

    def rows(split: str) -> list[dict]:
        return [{"prompt": x["prompt"], "ground_truth": str(get_dotted(x, "reward_model.ground_truth"))}
                for x in read_rows(f"builtin:arithmetic:{split}", knobs)]  # fmt: skip

    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_out = rows("val")[:val]

    @torch.no_grad()
    def greedy_accuracy() -> float:
        model.eval()
        right = 0
        for i in range(0, len(held_out), 32):
            chunk = held_out[i : i + 32]
            text = [tokenizer.apply_chat_template(x["prompt"], tokenize=False, add_generation_prompt=True) for x in chunk]
            enc = tokenizer(text, return_tensors="pt", padding=True)
            out = model.generate(**enc, max_new_tokens=r.max_tokens, do_sample=False)
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            right += sum(reward(answers, [x["ground_truth"] for x in chunk]))
        model.train()
        return right / len(held_out)

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, fp16=False, report_to="none",
        per_device_train_batch_size=t.global_batch_size * r.n_samples_per_prompt, num_generations=r.n_samples_per_prompt,
        gradient_accumulation_steps=1, max_completion_length=r.max_tokens, temperature=r.temperature, top_p=1.0,
        loss_type="grpo", epsilon=0.2, beta=0.0, mask_truncated_completions=False, learning_rate=t.lr,
        lr_scheduler_type="constant_with_warmup", warmup_steps=t.warmup_steps, max_grad_norm=t.grad_clip,
        max_steps=steps, logging_steps=1, save_strategy="no", seed=t.seed, disable_tqdm=True, log_completions=False,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows("train")),
                          processing_class=tokenizer)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    points = [(0, 0.0, greedy_accuracy())]
    clock = {"trained": 0.0, "since": time.perf_counter()}

    class Validate(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            clock["trained"] += time.perf_counter() - clock["since"]
            if state.global_step % every == 0 or state.global_step == steps:
                points.append((state.global_step, clock["trained"], greedy_accuracy()))
                print(f"trl: step {state.global_step}: {clock['trained']:.0f} s, held-out greedy {points[-1][2]:.3f}", flush=True)
            if clock["trained"] > budget_s:
                control.should_training_stop = True
            clock["since"] = time.perf_counter()

    trainer.add_callback(Validate())
    clock["since"] = time.perf_counter()
    trainer.train()
    return points


def first_reaching(points: list[tuple[int, float, float]], acc: float) -> float | None:
    return next((s for _, s, a in points if a >= acc), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=1800.0)
    ap.add_argument("--val", type=int, default=100)
    ap.add_argument("--peers", nargs="+", default=["postrl", "trl"], choices=["postrl", "trl"])
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for peer in a.peers:  # one after the other: never two real-model processes at once
            run = run_postrl if peer == "postrl" else run_trl
            results[peer] = run(Path(tmp), a.steps, a.every, a.budget_s, a.val)
    for peer, points in results.items():
        print(f"\n{peer}: step  training s  held-out greedy acc")
        for step, seconds, acc in points:
            print(f"{peer}: {step:5d}  {seconds:10.0f}  {acc:.3f}")
    if len(results) == 2:
        p, t = results["postrl"], results["trl"]
        target = t[-1][2]
        reach = first_reaching(p, target)
        print(f"\nTRL's last accuracy {target:.3f} after {t[-1][1]:.0f} s; postrl's last {p[-1][2]:.3f} after {p[-1][1]:.0f} s; "
              f"postrl reached TRL's last accuracy after {'%.0f s' % reach if reach is not None else 'never'}")  # fmt: skip


if __name__ == "__main__":
    main()
