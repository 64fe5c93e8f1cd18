"""Supervised warm start (`postrl sft`): next-token loss on the response only, prompt tokens masked.

The guides start RL from an SFT model that already follows the answer format; on the built-in task
this gives the tiny model the \\boxed{} format and partial accuracy, leaving room for RL to gain.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from postrl import distributed
from postrl.config import Config
from postrl.data.dataset import encode_prompt, file_dir, read_rows
from postrl.errors import UserError
from postrl.modality import Modality
from postrl.models import Policy, load_policy
from postrl.runtime import Runtime, configure_threads, init_runtime, seed_everything
from postrl.schedule import lr_lambda
from postrl.utils import get_dotted, publish_dir, scratch_path


def build_examples(rows: list[dict], tokenizer, cfg: Config, source: str, modality: Modality | None = None) -> list[tuple]:
    """(prompt ids, response ids) per row, plus the prompt's image inputs for rows with images; a tool trace
    (a response that is a list of chat messages, data/traces.py) as (prompt ids, response ids, None, loss mask)."""
    from postrl.agents.loop.loop import tool_schemas
    from postrl.data.traces import encode_trace, is_trace, sft_pair

    tools = tool_schemas(cfg.rollout.multi_turn)
    out = []
    for i, row in enumerate(rows):
        where = f"{source}, row {i}"
        prompt, response, row_tools = sft_pair(row, cfg.data.prompt_key, cfg.data.response_key, where)
        if is_trace(response):
            p, r, mask = encode_trace(tokenizer, prompt, list(response), row_tools or tools, where)
            out.append((p, r, None, mask))
            continue
        encoded = encode_prompt(tokenizer, row, prompt, cfg.data, where, file_dir(source), modality, row_tools or tools)
        if encoded is None:  # malformed image row, skipped by data.skip_bad_rows
            continue
        p, multi_modal = encoded
        if multi_modal is not None and len(p) >= cfg.sft.max_length:
            raise UserError(
                f"{source}, row {i}: the prompt has {len(p)} tokens with its image tokens, >= sft.max_length "
                f"({cfg.sft.max_length}); cutting it would cut image tokens. Fix: raise sft.max_length or lower data.max_pixels."
            )
        r = tokenizer(str(response), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((p, r) if multi_modal is None else (p, r, multi_modal))
    return out


def collate(pairs: list[tuple], pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    seqs = [(x[0] + x[1])[:max_length] for x in pairs]
    L = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    attention = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, ((p, *rest), s) in enumerate(zip(pairs, seqs)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        labels[i, len(p) : len(s)] = torch.tensor(s[len(p) :], dtype=torch.long)
        if len(rest) > 2:  # a tool trace: only the assistant's tokens are trained
            masked = [len(p) + k for k, m in enumerate(rest[2][: len(s) - len(p)]) if not m]
            labels[i, masked] = -100
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def run_sft(cfg: Config, console: Any = None) -> dict[str, float]:
    """Fine-tune model.path on the training files' reference responses; save it to sft.output_dir/model."""
    from rich.console import Console

    console = console or Console()
    s = cfg.sft
    seed_everything(s.seed)
    rt = init_runtime(cfg.train.device, cfg.model.dtype)
    policy = load_policy(cfg.model, dtype="float32", device=rt.device)  # fp32 master weights; forwards in model.dtype (runtime.py)
    policy.model.to(rt.device)
    configure_threads(policy.model, cfg.train.num_threads, console.print)
    pairs = []
    for f in cfg.data.train_files:
        rows = read_rows(f, cfg.data.builtin.model_dump(), cfg.data.shapes.model_dump(), cfg.data.tool_arithmetic.model_dump())
        pairs += build_examples(rows, policy.tokenizer, cfg, f, policy.modality)
    console.print(f"SFT on {len(pairs)} examples from {', '.join(cfg.data.train_files)} (model {policy.path})")
    loss = fine_tune(policy, pairs, cfg, rt, console)
    out = save_model(policy, Path(s.output_dir) / "model")
    console.print(f"SFT done: final loss {loss:.4f}; model saved to {out}")
    result = {"sft/loss": loss}
    if s.eval_prompts and cfg.data.val_files:
        result.update(eval_greedy(policy, cfg, s.eval_prompts, rt))
        accs = ", ".join(f"{k.split('/')[1]} {v * 100:.1f}%" for k, v in result.items() if "acc_mean" in k)
        console.print(f"[bold]held-out greedy accuracy after SFT:[/bold] {accs}")
    return result


def fine_tune(policy: Policy, pairs: list[tuple], cfg: Config, rt: Runtime, console: Any) -> float:
    """sft.steps AdamW steps on random batches of `pairs`; returns the loss (an exponential moving average)."""
    s, model = cfg.sft, policy.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters; a frozen vision tower stays out
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(s.warmup_steps, s.steps, s.lr_schedule, 0.0))
    scaler = distributed.grad_scaler(model, rt.dtype, rt.device)  # fp16 loss scaling; else a no-op
    rng = random.Random(s.seed)
    loss_ema = None
    with _Progress(console, s.steps, bar=cfg.logging.progress) as progress:
        for step in range(s.steps):
            sample = rng.sample(pairs, min(s.batch_size, len(pairs)))
            batch = {k: v.to(rt.device) for k, v in collate(sample, policy.tokenizer.pad_token_id, s.max_length).items()}
            images = policy.modality.forward_kwargs(model, batch["input_ids"], [x[2] if len(x) > 2 else None for x in sample])
            with rt.autocast():
                loss = model(**batch, **images).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # fp16: the gradients at their true size before clipping
            distributed.clip_grad_norm_(params, 1.0)
            scaler.step(opt)  # skipped (fp16) when the gradients overflowed
            scaler.update()
            sched.step()
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
            progress.update(step + 1, loss_ema)
    return loss_ema or 0.0


class _Progress:
    """A rich bar on a terminal (with logging.progress); a plain line every 5% of the steps otherwise,
    so that output sent to a file or a job log shows the run is alive."""

    def __init__(self, console: Any, total: int, bar: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console, self.total = console, total
        self.every = max(1, total // 20)
        self.bar = Progress(
            TextColumn("[bold]SFT"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]:.4f}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not (bar and console.is_terminal),
        )  # fmt: skip
        self.task = self.bar.add_task("sft", total=total, loss=float("nan"))
        self.lines = self.bar.disable
        self.start = time.perf_counter()

    def __enter__(self) -> "_Progress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def update(self, step: int, loss: float) -> None:
        self.bar.update(self.task, completed=step, loss=loss)
        if self.lines and (step % self.every == 0 or step == self.total):
            elapsed = time.perf_counter() - self.start
            self.console.print(f"SFT step {step}/{self.total}  loss {loss:.4f}  {elapsed:.0f} s", markup=False, highlight=False)


def save_model(policy: Policy, out: Path) -> Path:
    """The fine-tuned model at `out` as a plain Hugging Face directory (written aside, then renamed)."""
    tmp = scratch_path(out)
    distributed.save_pretrained(policy.model, tmp, write=True)  # with LoRA: merged, a plain model
    policy.tokenizer.save_pretrained(tmp)  # VLMs: with the image processor (the policy's tokenizer writes it)
    return publish_dir(tmp, out)


def eval_greedy(policy: Policy, cfg: Config, max_prompts: int, rt: Runtime) -> dict[str, float]:
    from postrl.agents.loop.loop import tool_schemas
    from postrl.agents.verifiers.env import dataset_rows
    from postrl.evaluate import evaluate, load_val_sets
    from postrl.rewards import RewardFunction
    from postrl.assembly import policy_engine

    tokenizer, tools = policy.tokenizer, tool_schemas(cfg.rollout.multi_turn)
    # the HF engine on the policy just trained (the agent loop around it, as validation in RL runs it)
    engine = policy_engine(cfg, policy, rt, rollout=cfg.rollout.model_copy(update={"engine": "hf"}))
    reward_fn = RewardFunction(cfg.reward)
    out = {}
    greedy = cfg.eval.model_copy(update={"n_samples": 1, "temperature": 0.0})
    for name, examples in load_val_sets(cfg.data.val_files, tokenizer, cfg.data, max_prompts, policy.modality, tools, dataset_rows).items():
        out.update(evaluate(engine, tokenizer, reward_fn, examples, greedy, name, agent=cfg.rollout.takes_rows))
    reward_fn.close()
    engine.close()
    return out
