"""The GRPO / DAPO training loop (DESIGN.md section 1), top to bottom.

    prompts -> rollout (n per prompt) -> rule rewards (+ overlong shaping) -> group advantages
    -> dynamic sampling (drop zero-spread groups, refill) -> old / ref log-probs
    -> policy update (mini-batches x micro-batches, grad accumulation, clip, AdamW, LR schedule)
    -> weight sync to the rollout engine -> metrics, validation, checkpoint

Where it departs from a textbook reading:
- On-policy shortcut (as TRL does): with one optimizer step per batch (mini_batch_size ==
  global_batch_size, epochs_per_batch == 1) the "old" policy is the current one, so old log-probs
  are the detached log-probs of the update pass itself; the extra forward pass is skipped and the
  ratio is exactly 1 (its gradient is the policy gradient). Otherwise they come from a separate
  no-grad pass of the training model before the update (the guides' old_log_p step).
- Loss normalisers (token and sequence counts) are taken over the whole mini-batch on all ranks
  before the first micro-batch, so the gradient does not depend on micro-batching or world size.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from postrl import algorithms as algo
from postrl import distributed
from postrl.config import Config
from postrl.data.dataset import PromptExample, PromptSampler, load_prompts, multi_modal_of
from postrl.errors import UserError
from postrl.evaluate import evaluate
from postrl.metrics import MetricsLogger, Timer, summary_stats, throughput
from postrl.models import build_sequences, load_model, load_policy, response_logprobs
from postrl.rewards import RewardFunction
from postrl.rollout import SamplingParams, make_engine
from postrl.utils import configure_cpu_threads, seed_everything


# ------------------------------------------------------------------------------------------ batch


@dataclass
class Batch:
    """One training batch of B = groups x G sequences, prompt-major (a group is contiguous)."""

    examples: list[PromptExample]  # one per group
    group_size: int
    prompt_ids: list[list[int]]  # [B]
    response_ids: list[list[int]]  # [B]
    finished: list[bool]  # [B] stopped at EOS (else cut at max_tokens)
    scores: list[float]  # [B] raw weighted verifier score
    rewards: list[float]  # [B] score after overlong shaping
    verifier_metrics: dict[str, list[float]]  # name -> [B]
    engine_logprobs: list[list[float]] | None = None
    multi_modal: list[dict | None] | None = None  # [B] each sequence's image inputs (VLMs), else None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.response_ids)


def _concat(batches: list[Batch], group_size: int) -> Batch:
    has_lp = all(b.engine_logprobs is not None for b in batches)
    keys = batches[0].verifier_metrics.keys()
    return Batch(
        examples=[e for b in batches for e in b.examples],
        group_size=group_size,
        prompt_ids=[x for b in batches for x in b.prompt_ids],
        response_ids=[x for b in batches for x in b.response_ids],
        finished=[x for b in batches for x in b.finished],
        scores=[x for b in batches for x in b.scores],
        rewards=[x for b in batches for x in b.rewards],
        verifier_metrics={k: [x for b in batches for x in b.verifier_metrics[k]] for k in keys},
        engine_logprobs=[x for b in batches for x in b.engine_logprobs] if has_lp else None,  # type: ignore[union-attr]
        multi_modal=[x for b in batches for x in (b.multi_modal or [None] * b.size)] if any(b.multi_modal for b in batches) else None,
    )


def _gather(part: Batch, examples: list[PromptExample]) -> Batch:
    """The whole generation batch, from every rank's scored slice (the slice itself on one process)."""
    if not distributed.is_distributed():
        return part
    parts = distributed.all_gather_object(replace(part, examples=[]))  # every rank knows the examples
    return replace(_concat(parts, part.group_size), examples=list(examples))


def _select_rows(batch: Batch, rows: list[int]) -> Batch:
    """Single sequences of `batch` (for the update: groups need not stay whole once advantages exist)."""

    def pick(xs):
        return [xs[i] for i in rows]

    return Batch(
        examples=[],
        group_size=batch.group_size,
        prompt_ids=pick(batch.prompt_ids),
        response_ids=pick(batch.response_ids),
        finished=pick(batch.finished),
        scores=pick(batch.scores),
        rewards=pick(batch.rewards),
        verifier_metrics={k: pick(v) for k, v in batch.verifier_metrics.items()},
        engine_logprobs=pick(batch.engine_logprobs) if batch.engine_logprobs is not None else None,
        multi_modal=pick(batch.multi_modal) if batch.multi_modal is not None else None,
    )


def _select_groups(batch: Batch, keep_groups: list[int]) -> Batch:
    """Whole groups of `batch`, in the order given."""
    G = batch.group_size
    rows = _select_rows(batch, [g * G + j for g in keep_groups for j in range(G)])
    return replace(rows, examples=[batch.examples[g] for g in keep_groups])


# ---------------------------------------------------------------------------------------- trainer


class Trainer:
    """Holds the run's state; `fit()` runs the loop. Each phase is one method."""

    def __init__(self, cfg: Config, console: Any = None):
        from rich.console import Console

        self.cfg = cfg
        self.console = console or Console()
        if not distributed.is_main():
            self.console = Console(quiet=True)  # rank 0 prints for the run
        self.algo_name = cfg.algorithm.name
        self.G = cfg.rollout.n_samples_per_prompt
        seed_everything(cfg.train.seed)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)

        self.policy = load_policy(cfg.model)
        self.model, self.tokenizer, self.model_path = self.policy.model, self.policy.tokenizer, self.policy.path
        configure_cpu_threads(self.model, self.log)
        self.model.train()
        self.ref_model = None
        if cfg.algorithm.kl.coef > 0:
            ref_path = cfg.checkpoint.ref_model_path
            self.ref_model = load_model(ref_path, cfg.model.dtype) if ref_path else copy.deepcopy(self.model)
            self.ref_model.eval().requires_grad_(False)
            self.ref_model = distributed.wrap_model(self.ref_model)
        # FSDP2 shards self.model in place (before the optimizer sees its parameters); DDP wraps it.
        self.train_model = distributed.wrap_model(self.model)

        self.train_examples, summary = load_prompts(cfg.data.train_files, self.tokenizer, cfg.data, modality=self.policy.modality)
        bad = f", {summary['dropped_bad']} malformed image rows skipped" if summary.get("dropped_bad") else ""
        self.log(f"train prompts: {summary['kept']} ({summary['dropped_overlong']} dropped as overlong{bad})")
        self.val_sets = self._load_val_sets()
        self.sampler = PromptSampler(len(self.train_examples), cfg.data.shuffle, cfg.data.seed)
        self.reward_fn = RewardFunction(cfg.reward)

        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(t.warmup_steps, t.total_steps, t.lr_schedule, t.min_lr_ratio))
        self.step = 0
        self.timer = Timer()
        engine = make_engine(
            cfg.rollout, self.model, self.tokenizer, log=self.log,
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_tokens, seed=cfg.train.seed,
            modality=self.policy.modality,
        )  # fmt: skip
        self.engine = distributed.colocate(engine, self.model)
        self.on_policy = t.mini_batch_size == t.global_batch_size and t.epochs_per_batch == 1
        self.logger = MetricsLogger(cfg.logging.dir, cfg.logging.sinks, cfg.model_dump(mode="json"), enabled=distributed.is_main())

        from postrl import checkpoint

        self.checkpoint = checkpoint
        resumed = checkpoint.maybe_resume(self)
        if resumed:
            self.log(f"resumed from {resumed} at step {self.step}")
            if self.step >= cfg.train.total_steps:
                self.log(
                    f"[yellow]nothing to train: the checkpoint is at step {self.step} and train.total_steps is "
                    f"{cfg.train.total_steps}. To start over, use a new logging.dir or checkpoint.resume=none; "
                    "to train on, raise train.total_steps.[/yellow]"
                )
            self.engine.sync_weights(self.model)

    def log(self, msg: str) -> None:
        self.console.print(msg)

    def _load_val_sets(self) -> dict[str, list[PromptExample]]:
        sets = {}
        for f in self.cfg.eval.files or []:
            examples, _ = load_prompts(
                [f], self.tokenizer, self.cfg.data, max_rows=self.cfg.eval.max_prompts, modality=self.policy.modality
            )
            name = examples[0].data_source if f.startswith("builtin:") else _stem(f)
            sets[name] = examples
        return sets

    # ----------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        cfg = self.cfg
        last: dict[str, float] = {}
        if cfg.eval.before_train and self.step == 0 and self.val_sets:
            last.update(self.validate())
            self.logger.log(0, last)
            self.log(self._val_line("before RL", last))
        progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=self.console, disable=not cfg.logging.progress, transient=True,
        )  # fmt: skip
        with progress:
            task = progress.add_task(f"{self.algo_name} training", total=cfg.train.total_steps, completed=self.step)
            while self.step < cfg.train.total_steps:
                metrics = self.train_step()
                self.step += 1
                if cfg.eval.freq and self.step % cfg.eval.freq == 0 and self.step < cfg.train.total_steps:
                    metrics.update(self.validate())
                if cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0:
                    with self.timer("save"):
                        self.checkpoint.save(self)
                    metrics["timing/save"] = self.timer.seconds.pop("save")
                self.logger.log(self.step, metrics)
                if self.step % cfg.logging.log_interval == 0:
                    progress.console.print(self._step_line(metrics))
                progress.update(task, completed=self.step)
                last = metrics
        final: dict[str, float] = {}
        if cfg.eval.after_train and self.val_sets:
            final = self.validate()
            self.logger.log(self.step, final)
            self.log(self._val_line("after RL", final))
        if cfg.checkpoint.save_final and not (cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0):
            self.checkpoint.save(self)
        self.logger.close()
        self.reward_fn.close()
        if hasattr(self.engine, "close"):
            self.engine.close()
        self._plot()
        return {**last, **final}

    def _plot(self) -> None:
        from pathlib import Path

        from postrl.metrics import plot_run

        metrics_path = Path(self.cfg.logging.dir) / "metrics.jsonl"
        if distributed.is_main() and "jsonl" in self.cfg.logging.sinks and metrics_path.exists():
            png = plot_run(metrics_path, Path(self.cfg.logging.dir) / "training.png", self.algo_name)
            self.log(f"metrics: {metrics_path}; plot: {png}")

    def train_step(self) -> dict[str, float]:
        self.timer = Timer()
        with self.timer("all"):
            batch, gen_stats = self.collect_batch()  # the global batch, the same on every rank
            with self.timer("resharding_to_train"):
                # GPU vLLM: free the KV cache and offload weights for the update (no-op on CPU / HF)
                getattr(self.engine, "sleep", lambda: None)()
            with self.timer("adv"):
                rewards_B = torch.tensor(batch.rewards)
                adv_B = algo.grpo_advantages(rewards_B, self.G, self.cfg.algorithm.norm_adv_by_std, self.cfg.algorithm.epsilon)
                local = self._rank_shard(batch, adv_B)
            if not self.on_policy:
                with self.timer("old_log_p"):
                    local.tensors["old_logp"] = self.compute_logprobs(self.model, local)
            if self.ref_model is not None:
                with self.timer("reference_model"):
                    local.tensors["ref_logp"] = self.compute_logprobs(self.ref_model, local)
            with self.timer("update"):
                update_stats = self.update_policy(local)
            with self.timer("resharding_to_infer"):
                self.engine.sync_weights(self.model)
        return self._step_metrics(batch, gen_stats, update_stats)

    # ------------------------------------------------------------------- rollout + reward + filter
    def collect_batch(self) -> tuple[Batch, dict[str, float]]:
        """Draw generation batches until global_batch_size groups survive dynamic sampling."""
        cfg, G = self.cfg, self.G
        fg = cfg.algorithm.filter_groups
        want = cfg.train.global_batch_size
        kept: list[Batch] = []
        n_kept = n_generated = num_gen_batches = 0
        while n_kept < want:
            num_gen_batches += 1
            if fg.enable and 0 < fg.max_num_gen_batches < num_gen_batches:
                raise UserError(
                    f"dynamic sampling drew {fg.max_num_gen_batches} generation batches of {cfg.train.gen_batch_size} "
                    f"prompts at step {self.step} and kept only {n_kept} of the {want} groups it needs: almost every "
                    f"group's '{fg.metric}' has zero spread, i.e. the data is too hard or too easy for this model. "
                    "Fix: use data matched to the model's level (or an SFT warm start), raise "
                    "rollout.n_samples_per_prompt or train.gen_batch_size, or set "
                    "algorithm.filter_groups.max_num_gen_batches: 0 (no limit)."
                )
            examples = [self.train_examples[i] for i in self.sampler.next_indices(cfg.train.gen_batch_size)]
            lo, hi = distributed.shard_range(len(examples))  # this rank's prompts: a group stays on one rank
            batch = self.generate_and_score(examples[lo:hi], seed=distributed.shard_seed(self._seed(num_gen_batches), lo))
            batch = _gather(batch, examples)  # every rank sees every score, so all take the same keep decisions
            n_generated += len(examples)
            if fg.enable:
                metric_B = torch.tensor(self._filter_metric(batch))
                keep = algo.group_keep_mask(metric_B, G).nonzero().flatten().tolist()
                batch = _select_groups(batch, keep)
            kept.append(batch)
            n_kept += len(batch.examples)
        full = _concat(kept, G)
        full = _select_groups(full, list(range(want)))
        return full, {"dapo/num_gen_batches": num_gen_batches, "dapo/kept_groups_ratio": n_kept / n_generated}

    def _seed(self, gen_batch: int) -> int:
        return (self.cfg.train.seed * 1_000_003 + self.step * 1009 + gen_batch) % 2**31

    def generate_and_score(self, examples: list[PromptExample], seed: int) -> Batch:
        cfg, G = self.cfg, self.G
        r = cfg.rollout
        params = SamplingParams(r.temperature, r.top_p, r.top_k, r.max_tokens, G, seed)
        with self.timer("rollout"):
            completions = self.engine.generate([e.prompt_ids for e in examples], params, multi_modal=multi_modal_of(examples))
        with self.timer("reward"):
            texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            owners = [examples[c.prompt_index] for c in completions]
            out = self.reward_fn(texts, [e.ground_truth for e in owners], [e.row for e in owners])
            rewards = list(out.scores)
            ob = cfg.algorithm.overlong_buffer
            if ob.enable:
                lengths = torch.tensor([len(c.token_ids) for c in completions])
                penalty = algo.overlong_penalty(lengths, r.max_tokens, ob.len, ob.penalty_factor)
                rewards = [s + p for s, p in zip(rewards, penalty.tolist())]
        has_lp = all(c.logprobs is not None for c in completions)
        return Batch(
            examples=list(examples),
            group_size=G,
            prompt_ids=[e.prompt_ids for e in owners],
            response_ids=[c.token_ids for c in completions],
            finished=[c.finished for c in completions],
            scores=list(out.scores),
            rewards=rewards,
            verifier_metrics=out.metrics,
            engine_logprobs=[c.logprobs for c in completions] if has_lp else None,  # type: ignore[misc]
            multi_modal=[e.multi_modal for e in owners] if multi_modal_of(examples) else None,
        )

    def _filter_metric(self, batch: Batch) -> list[float]:
        name = self.cfg.algorithm.filter_groups.metric
        if name == "score":
            return batch.scores
        if name == "seq_reward":
            return batch.rewards
        if name not in batch.verifier_metrics:
            raise UserError(
                f"algorithm.filter_groups.metric is '{name}', but the verifiers report only "
                f"{sorted(batch.verifier_metrics)} (plus 'score' and 'seq_reward'). Fix: pick one of those."
            )
        return batch.verifier_metrics[name]

    # ---------------------------------------------------------------------------------- tensors
    def _rank_shard(self, batch: Batch, adv_B: torch.Tensor) -> Batch:
        """This rank's sequences of the global batch, packed (the batch itself on one process).

        Each mini-batch is dealt to the ranks in equal parts, token-balanced with dynamic batch size.
        """
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        rows = distributed.rank_rows(lengths, self.cfg.train.mini_batch_size * self.G, balance=self.cfg.train.use_dynamic_bsz)
        local = batch if len(rows) == batch.size else _select_rows(batch, rows)
        self._pack(local, adv_B[rows])
        return local

    def _pack(self, batch: Batch, adv_B: torch.Tensor) -> None:
        t = build_sequences(batch.prompt_ids, batch.response_ids, self.tokenizer.pad_token_id)
        t["adv"] = adv_B
        if batch.engine_logprobs is not None:
            lp = torch.zeros_like(t["response_mask"], dtype=torch.float32)
            for i, row in enumerate(batch.engine_logprobs):
                lp[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
            t["engine_logp"] = lp
        batch.tensors = t

    def _micro_batches(self, rows: range | list[int], batch: Batch):
        """Slices of `rows` of micro_batch_size, trimmed to their own padding."""
        rows = list(rows)
        mbs = self.cfg.train.micro_batch_size
        if self.cfg.train.use_dynamic_bsz:
            from postrl.distributed import token_budget_micro_batches

            lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
            groups = token_budget_micro_batches(lengths, self.cfg.train.max_token_len_per_device)
            chunks = [[rows[j] for j in g] for g in groups]
        else:
            chunks = [rows[i : i + mbs] for i in range(0, len(rows), mbs)]
        t = batch.tensors
        P = t["input_ids"].shape[1] - t["response_mask"].shape[1]
        for idx in chunks:
            ix = torch.tensor(idx)
            attn = t["attention_mask"][ix]
            resp_mask = t["response_mask"][ix]
            left = int((attn.sum(0) > 0).nonzero()[0])  # first column any sequence uses
            T = max(int(resp_mask.sum(1).max()), 1)
            mb = {
                "input_ids": t["input_ids"][ix, left : P + T],
                "attention_mask": attn[:, left : P + T],
                "position_ids": t["position_ids"][ix, left : P + T],
                "response_mask": resp_mask[:, :T].float(),
                "adv": t["adv"][ix],
            }
            for key in ("old_logp", "ref_logp", "engine_logp"):
                if key in t:
                    mb[key] = t[key][ix, :T]
            if batch.multi_modal is not None:
                mb["multi_modal"] = [batch.multi_modal[i] for i in idx]
            yield idx, mb

    @torch.no_grad()
    def compute_logprobs(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        out = torch.zeros_like(batch.tensors["response_mask"], dtype=torch.float32)
        for idx, mb in self._micro_batches(range(batch.size), batch):
            T = mb["response_mask"].shape[1]
            logp, _ = response_logprobs(
                model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], T, self.cfg.rollout.temperature,
                multi_modal=mb.get("multi_modal"), modality=self.policy.modality,
            )  # fmt: skip
            out[torch.tensor(idx), :T] = logp
        return out

    # ----------------------------------------------------------------------------------- update
    def update_policy(self, batch: Batch) -> dict[str, float]:
        cfg = self.cfg
        a, t = cfg.algorithm, cfg.train
        mini = t.mini_batch_size * self.G // distributed.world_size()  # this rank's rows of a mini-batch
        sums: dict[str, float] = {}
        grad_norms, n_steps = [], 0
        params = [p for p in self.model.parameters() if p.requires_grad]

        def add(key: str, value: float, weight: float = 1.0) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            sums[key + "#w"] = sums.get(key + "#w", 0.0) + weight

        for _epoch in range(t.epochs_per_batch):
            for start in range(0, batch.size, mini):
                rows = range(start, min(start + mini, batch.size))
                norms = distributed.all_reduce_sum_dict(algo.loss_normalizers(batch.tensors["response_mask"][start : start + mini]))
                self.optimizer.zero_grad(set_to_none=True)
                pg_total = kl_total = 0.0
                for _idx, mb in self._micro_batches(rows, batch):
                    mask = mb["response_mask"]
                    T = mask.shape[1]
                    logp, entropy = response_logprobs(
                        self.train_model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], T,
                        cfg.rollout.temperature, with_entropy=True, multi_modal=mb.get("multi_modal"),
                        modality=self.policy.modality,
                    )  # fmt: skip
                    old_logp = logp.detach() if self.on_policy else mb["old_logp"]
                    adv_BT = mb["adv"].unsqueeze(1).expand_as(logp)
                    pg_BT, stats = algo.policy_loss(
                        logp, old_logp, adv_BT, mask,
                        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                    )  # fmt: skip
                    agg = dict(mode=a.loss_agg_mode, **norms, max_response_len=cfg.rollout.max_tokens)
                    pg = algo.aggregate_loss(pg_BT, mask, **agg)
                    loss = pg
                    if a.entropy_coef:
                        loss = loss - a.entropy_coef * algo.aggregate_loss(entropy, mask, **agg)
                    if self.ref_model is not None:
                        kl = algo.aggregate_loss(algo.kl_penalty(logp, mb["ref_logp"], a.kl.estimator), mask, **agg)
                        loss = loss + a.kl.coef * kl
                        kl_total += float(kl.detach())
                    # DDP / FSDP average gradients over ranks; the loss is this rank's share of the global
                    # loss, so the global gradient is the sum: scale by the world size.
                    (loss * distributed.world_size()).backward()
                    pg_total += float(pg.detach())
                    n_tok = float(mask.sum())
                    for k, v in stats.items():
                        add(f"actor/{k}", float(v), n_tok)
                    add("actor/entropy", float(algo.masked_mean(entropy.detach(), mask)), n_tok)
                    if "engine_logp" in mb and _epoch == 0:
                        diff = algo.masked_mean((old_logp.detach() - mb["engine_logp"]).abs(), mask)
                        add("rollout/logprob_diff_mean", float(diff), n_tok)
                grad_norm = distributed.clip_grad_norm_(params, t.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    self.log(f"[yellow]step {self.step}: non-finite grad norm, update skipped[/yellow]")
                grad_norms.append(float(grad_norm))
                pg_total, kl_total = distributed.all_reduce_sum([pg_total, kl_total])
                add("actor/pg_loss", pg_total)
                add("actor/kl_loss", kl_total)
                n_steps += 1
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        sums = distributed.all_reduce_sum_dict(sums)
        out = {k: sums[k] / max(sums[k + "#w"], 1e-12) for k in sums if not k.endswith("#w")}
        out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["actor/lr"] = lr
        return out

    # ---------------------------------------------------------------------------------- metrics
    def _step_metrics(self, batch: Batch, gen_stats: dict, update_stats: dict) -> dict[str, float]:
        cfg, name = self.cfg, self.algo_name
        resp_len = [len(r) for r in batch.response_ids]
        prompt_len = [len(p) for p in batch.prompt_ids]
        m: dict[str, float] = {"training/step": self.step + 1, "training/epoch": self.sampler.epoch}
        m.update(summary_stats(f"{name}/rewards", batch.rewards))
        m.update(summary_stats(f"{name}/score", batch.scores))
        for key, values in batch.verifier_metrics.items():
            m[f"{name}/{key}/mean"] = sum(values) / len(values)
        m.update(summary_stats("response_length", [float(x) for x in resp_len]))
        m["response_length/clip_ratio"] = sum(not f for f in batch.finished) / batch.size
        m.update(summary_stats("prompt_length", [float(x) for x in prompt_len]))
        m.update(gen_stats)
        m.update(update_stats)
        timing = self.timer.timing()
        m.update(timing)
        m.update(
            throughput(
                m["response_length/mean"], m["prompt_length/mean"], cfg.train.global_batch_size, self.G,
                cfg.world_size, timing, self.engine.name,
            )
        )  # fmt: skip
        return m

    def _step_line(self, m: dict[str, float]) -> str:
        n = self.algo_name
        return (
            f"step {self.step:>4} | reward {m[f'{n}/rewards/mean']:+.3f} acc {m.get(f'{n}/acc/mean', 0):.3f} "
            f"| len {m['response_length/mean']:.1f} | kept {m['dapo/kept_groups_ratio']:.2f} "
            f"({m['dapo/num_gen_batches']:.0f} gen) | pg {m['actor/pg_loss']:+.4f} ent {m['actor/entropy']:.3f} "
            f"clip {m['actor/pg_clipfrac']:.3f} | {m['timing/all']:.1f}s {m['e2e_tps']:.0f} tok/s"
        )

    def _val_line(self, when: str, m: dict[str, float]) -> str:
        accs = [f"{k.split('/')[1]} {v * 100:.1f}%" for k, v in m.items() if k.startswith("val/") and "acc_mean@" in k]
        return f"[bold]held-out accuracy {when}:[/bold] " + ", ".join(accs)

    # ------------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        start = time.perf_counter()
        out = {}
        for name, examples in self.val_sets.items():
            out.update(evaluate(self.engine, self.tokenizer, self.reward_fn, examples, self.cfg.eval, name, self.cfg.train.seed))
        out["timing/eval"] = time.perf_counter() - start
        return out


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_ratio: float):
    """Linear warmup to 1, then constant or cosine down to min_ratio (as a LambdaLR factor)."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _stem(path: str) -> str:
    from pathlib import Path

    return Path(path).stem


def train(cfg: Config, console: Any = None) -> dict[str, float]:
    """Run a full training job; returns the last step's metrics plus the final validation."""
    return Trainer(cfg, console).fit()
