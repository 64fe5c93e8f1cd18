"""The actor: the policy under training, its optimizer and LR schedule, and the clipped policy update.

    rows of the global batch -> this rank's rows, packed on runtime.device (`pack`)
      -> micro-batches trimmed to their own padding (`micro_batches`); with train.use_remove_padding
         (default) each forward packs them without padding, a group's prompt once (`models.response_logprobs`)
      -> old / ref log-probs (`compute_logprobs`, no grad)
      -> per mini-batch: normalisers over all ranks, then forward + loss + backward per micro-batch,
         clip, AdamW step (`update`); the LR scheduler steps once per training step.

Where it departs from a textbook reading:
- On-policy shortcut (as TRL does): with one optimizer step per batch (mini_batch_size ==
  global_batch_size, epochs_per_batch == 1) the "old" policy is the current one, so old log-probs
  are the detached log-probs of the update pass itself; the extra forward pass is skipped and the
  ratio is exactly 1 (its gradient is the policy gradient). Otherwise, and with a rollout correction
  level that rejects tokens (they must leave the normalisers before the first micro-batch), they come
  from a separate no-grad pass before the update (the guides' old_log_p step).
- Loss normalisers (token and sequence counts) are taken over the whole mini-batch on all ranks
  before the first micro-batch, so the gradient does not depend on micro-batching or world size
  (`algorithms.loss_normalizers` / `aggregate_loss`); tokens rollout correction rejects do not count.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from postrl import algorithms as algo
from postrl.algorithms.mismatch import MismatchAccumulator
from postrl import distributed, moe
from postrl.distill import TEACHER_KEYS, Distiller
from postrl import sequence_parallel as sp
from postrl.errors import UserError
from postrl.batch import Batch
from postrl.models import Policy, build_sequences, response_logprobs
from postrl.nonfinite import NonFiniteWatch, bad_rows
from postrl.partition import rank_rows, token_budget_micro_batches
from postrl.runtime import Runtime
from postrl.schedule import lr_lambda

LOGPROB_KEYS = ("old_logp", "ref_logp", "engine_logp")  # [B, T] tensors sliced with each micro-batch
VALUE_KEYS = ("values", "returns")  # [B, T], with a critic (held/critic.py), sliced likewise


@dataclass
class Packed:
    """This rank's rows as tensors on the runtime device: prompts left-padded to P, responses right-padded to T.

    tensors: input_ids / attention_mask / position_ids [B, P+T], response_mask [B, T] (the loss mask:
    1 only on tokens the policy sampled, so a trajectory's tool results are 0), reward [B], adv [B] (or [B, T]
    per-token advantages, which a critic's GAE puts in its place), and the [B, T] tensors of LOGPROB_KEYS
    and VALUE_KEYS once computed. Log-probs cover every real response token, aligned
    with the response ids; the loss reads them where response_mask is 1.
    """

    tensors: dict[str, torch.Tensor]
    lengths: list[int]  # prompt + response tokens per row, tool tokens included (dynamic batch size)
    multi_modal: list[dict | None] | None

    @property
    def size(self) -> int:
        return len(self.lengths)


class Actor:
    """Owns the trained model's optimizer and scheduler; `update` is one training step's update."""

    def __init__(self, cfg: Any, policy: Policy, train_model: torch.nn.Module, runtime: Runtime, log=print):
        self.cfg = cfg
        self.model = model = policy.model  # FSDP2 shards it in place
        self.train_model = train_model  # what forward/backward go through (a DDP wrapper, or the model)
        self.pad_id = policy.tokenizer.pad_token_id
        self.modality = policy.modality  # VLMs: the image inputs of each forward
        self.runtime = runtime
        self.log = log
        self.G = cfg.rollout.n_samples_per_prompt
        t = cfg.train
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(t.warmup_steps, t.total_steps, t.lr_schedule, t.min_lr_ratio))
        self.scaler = distributed.grad_scaler(model, runtime.dtype, runtime.device)  # fp16 loss scaling; else a no-op
        # The loss's terms, chosen by name from the registries once and bound to their settings.
        a = cfg.algorithm
        self.policy_loss = functools.partial(
            algo.get_policy_loss_fn(a.policy_loss), clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, **a.policy_loss_args,
        )  # fmt: skip
        rc = a.rollout_correction
        self.rollout_correction = functools.partial(algo.rollout_correction, level=rc.level, cap=rc.cap) if rc.enable else None
        # A level that rejects tokens must weigh them before the update (they leave the normalisers), so it
        # needs the old log-probs up front: no on-policy shortcut then.
        self._rejects = rc.enable and algo.rollout_correction_rejects(rc.level)
        self.on_policy = t.mini_batch_size == t.global_batch_size and t.epochs_per_batch == 1 and not self._rejects
        self.kl_penalty = functools.partial(algo.kl_penalty, estimator=a.kl.estimator)
        self._agg = dict(mode=a.loss_agg_mode, max_response_len=cfg.rollout.max_tokens)
        self._logprob_options = dict(remove_padding=t.use_remove_padding, chunk_tokens=t.logprob_chunk_tokens)
        # Ulysses sequence parallelism: the ranks of a group hold the same rows, each runs a slice of every row.
        self.sp_group = distributed.sequence_parallel_group()
        self.sp_size = t.sequence_parallel_size if self.sp_group is not None else 1
        if self.sp_group is not None:
            _check_sequence_parallel(model, self.sp_size)
            self._logprob_options["sp_group"] = self.sp_group
        self.dp_group = distributed.data_parallel_group()  # row counts and metrics: one rank per set of rows
        # MoE: the routers' load-balancing loss and per-expert load of each update forward (postrl.moe)
        self.router = moe.RouterTrace(model) if moe.is_moe(model) else None
        self.router_aux_coef = moe.aux_loss_coef(cfg.model.router_aux_loss_coef, model)
        self.distill = Distiller(cfg) if cfg.distill.enable else None  # on-policy distillation (distill.py)
        self.nonfinite = NonFiniteWatch(cfg, policy.tokenizer, log)  # NaN / inf: skip, trace, count (nonfinite.py)

    # --------------------------------------------------------------------------------- tensors
    def pack(self, batch: Batch, adv_B: torch.Tensor) -> Packed:
        """This rank's rows of the global batch as tensors on the runtime device.

        Each mini-batch is dealt to the ranks in equal parts, token-balanced with dynamic batch size.
        The advantage of a row reaches its model tokens only: the loss reads it through response_mask.
        """
        rows = rank_rows(batch.lengths, self.cfg.train.mini_batch_size * self.G, balance=self.cfg.train.use_dynamic_bsz)
        prompts = [batch.prompt_ids[i] for i in rows]
        responses = [batch.response_ids[i] for i in rows]
        t = build_sequences(prompts, responses, self.pad_id, [batch.loss_masks[i] for i in rows])
        t["adv"] = adv_B[rows]
        t["reward"] = torch.tensor(batch.rewards, dtype=torch.float32)[rows]
        if batch.has_engine_logprobs:  # one per response token (0.0 on tool tokens, which the mask drops)
            lp = torch.zeros_like(t["response_mask"], dtype=torch.float32)
            for i, row in enumerate(rows):
                lp[i, : len(batch.engine_logprobs[row])] = torch.tensor(batch.engine_logprobs[row], dtype=torch.float32)
            t["engine_logp"] = lp
        device = self.runtime.device
        mm = [batch.multi_modal[i] for i in rows]
        return Packed(
            tensors={k: v.to(device) for k, v in t.items()},
            lengths=[batch.lengths[i] for i in rows],
            multi_modal=mm if any(mm) else None,
        )

    def micro_batches(
        self, rows: range | list[int], packed: Packed, log_prob_pass: bool = False
    ) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """Slices of `rows` of micro_batch_size (or by token budget), trimmed to their own padding; a no-grad
        log-prob pass uses its own, usually larger, size and budget (train.log_prob_*).

        The token budget counts every token of a row, tool results of a trajectory included: it bounds
        activation memory, and the forward computes (and stores for the backward) every token it attends
        to, whether or not the loss reads it. The width kept is the longest real response (attention
        mask), not the longest run of model tokens (loss mask).
        """
        rows = list(rows)
        t = self.cfg.train
        size = t.log_prob_micro_batch_size if log_prob_pass else t.micro_batch_size
        budget = t.log_prob_max_token_len if log_prob_pass else t.max_token_len_per_device
        budget = (budget or t.max_token_len_per_device) * self.sp_size  # a per-device budget: u ranks share a micro-batch
        if t.use_dynamic_bsz:
            groups = token_budget_micro_batches([packed.lengths[i] for i in rows], budget)
            chunks = [[rows[j] for j in g] for g in groups]
        else:
            chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        x = packed.tensors
        P = x["input_ids"].shape[1] - x["response_mask"].shape[1]
        for idx in chunks:
            ix = torch.tensor(idx, device=self.runtime.device)
            attn = x["attention_mask"][ix]
            resp_mask = x["response_mask"][ix]
            left = int((attn.sum(0) > 0).nonzero()[0])  # first column any sequence uses
            T = max(int(attn[:, P:].sum(1).max()), 1)  # the longest real response (tool tokens are real)
            mb = {
                "input_ids": x["input_ids"][ix, left : P + T],
                "attention_mask": attn[:, left : P + T],
                "position_ids": x["position_ids"][ix, left : P + T],
                "response_mask": resp_mask[:, :T].float(),
                "adv": x["adv"][ix] if x["adv"].dim() == 1 else x["adv"][ix, :T],
            }
            for key in LOGPROB_KEYS + VALUE_KEYS + TEACHER_KEYS:  # teacher_topk_*: [B, T, K]
                if key in x:
                    mb[key] = x[key][ix, :T]
            if packed.multi_modal is not None:
                mb["multi_modal"] = [packed.multi_modal[i] for i in idx]
            yield idx, mb

    @torch.no_grad()
    def compute_logprobs(self, model: torch.nn.Module, packed: Packed) -> torch.Tensor:
        """Log-probs [B, T] of every row's response under `model` (the policy or the reference)."""
        out = torch.zeros_like(packed.tensors["response_mask"], dtype=torch.float32)
        for idx, mb in self.micro_batches(range(packed.size), packed, log_prob_pass=True):
            T = mb["response_mask"].shape[1]
            with self.runtime.autocast():  # bf16 compute, fp32 log-probs (runtime.py: precision)
                logp, _ = response_logprobs(
                    model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], T, self.cfg.rollout.temperature,
                    multi_modal=mb.get("multi_modal"), modality=self.modality, **self._logprob_options,
                )  # fmt: skip
            out[torch.tensor(idx, device=out.device), :T] = logp
        return out

    # ---------------------------------------------------------------------------------- update
    def update(self, packed: Packed, use_ref: bool = False, commit: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Mini-batches x micro-batches with gradient accumulation; returns the actor/* metrics. `commit()` is called
        before the first optimizer step (a stop signal abandons the step only before it: runtime.StopOnSignal)."""
        t = self.cfg.train
        mini = t.mini_batch_size * self.G // distributed.data_parallel_size()  # this rank's rows of a mini-batch
        sums = _WeightedSums(self.dp_group)
        grad_norms = []
        x = packed.tensors
        if "old_logp" in x and "engine_logp" in x:  # engine vs trainer, every row (on-policy: in the first micro-batches)
            sums.mismatch.add(x["old_logp"], x["engine_logp"], x["response_mask"])
        step = self.scheduler.last_epoch + 1  # the scheduler steps once per training step (resumes included)
        self.nonfinite.start_step()
        self._skipped = False
        # Ulysses attention through forward and backward: gradient checkpointing recomputes inside the backward.
        ulysses = sp.ulysses(self.train_model, self.sp_group) if self.sp_group is not None else contextlib.nullcontext()
        with ulysses:
            self._epochs(packed, mini, use_ref, sums, grad_norms, commit)
        lr = self.optimizer.param_groups[0]["lr"]
        nonfinite = self.nonfinite.end_step(step, lr, self.runtime.dtype, self._skipped)  # stops after K in a row
        with warnings.catch_warnings():  # a skipped first step: "scheduler.step() before optimizer.step()" is intended
            warnings.simplefilter("ignore")
            self.scheduler.step()
        out = sums.means() | nonfinite
        out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["actor/lr"] = lr
        if self.scaler.is_enabled():
            out["actor/loss_scale"] = self.scaler.get_scale()
        return out

    def _epochs(
        self, packed: Packed, mini: int, use_ref: bool, sums: "_WeightedSums", grad_norms: list[float], commit: Callable[[], None]
    ) -> None:  # fmt: skip
        """The optimizer steps of `update`: epochs x mini-batches, each accumulated over its micro-batches."""
        t = self.cfg.train
        for epoch in range(t.epochs_per_batch):
            for start in range(0, packed.size, mini):
                rows = range(start, min(start + mini, packed.size))
                norms = distributed.all_reduce_sum_dict(algo.loss_normalizers(self._loss_mask(packed, rows)), self.dp_group)
                self.optimizer.zero_grad(set_to_none=True)
                pg_total = kl_total = 0.0
                first = epoch == 0 and start == 0  # before any optimizer step: the ratio must be 1
                bad = []  # micro-batches whose loss was not finite
                for j, (_idx, mb) in enumerate(self.micro_batches(rows, packed)):
                    pg, kl, loss_finite, _ = self._micro_step(mb, norms, use_ref, sums, first=first)
                    pg_total += pg
                    kl_total += kl
                    bad += [] if loss_finite else [j]
                commit()  # from here the optimizer and the weights change: the step finishes
                self.scaler.unscale_(self.optimizer)  # fp16: the gradients at their true size before clipping
                grad_norm = distributed.clip_grad_norm_(self.params, t.grad_clip)
                overflow = not bool(torch.isfinite(grad_norm))  # fp16: an overflow is the scaler's cue to halve the scale
                if distributed.all_reduce_max(int(bool(bad))) or overflow and not self.scaler.is_enabled():
                    self._trace_nonfinite(rows, packed, norms, use_ref, first, bad, dict(epoch=epoch, mini_batch_start=start))
                else:
                    self.scaler.step(self.optimizer)
                    self.nonfinite.note_grad_norm(float(grad_norm))
                self.scaler.update()
                grad_norms.append(float(grad_norm))
                pg_total, kl_total = distributed.all_reduce_sum([pg_total, kl_total], self.dp_group)
                sums.add("actor/pg_loss", pg_total)
                sums.add("actor/kl_loss", kl_total)

    def _trace_nonfinite(self, rows: range, packed: Packed, norms: dict, use_ref: bool, first: bool, bad: list[int], where: dict) -> None:
        """A non-finite loss or gradient: the optimizer step is skipped; the micro-batch whose loss was not finite (or,
        for a gradient alone, each until one shows it) runs again, padded, under the hooks of nonfinite.py."""
        self._skipped = True
        mbs = list(self.micro_batches(rows, packed))
        order = bad[:1] or list(range(len(mbs)))
        options = dict(self._logprob_options)
        self._logprob_options["remove_padding"] = False  # one row per batch row, so the hooks can name rows

        def run_pass(mb: dict) -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            return self._micro_step(mb, norms, use_ref, _WeightedSums(), first=first)[3]

        try:
            for j in order + [0] * (len(mbs) - len(order)):  # every rank runs as many passes (FSDP2 / DDP collectives)
                before = len(self.nonfinite.records)
                self.nonfinite.trace(self.model, mbs[j][1], run_pass, {**where, "micro_batch": j, **_input_rows(mbs[j][1])})
                if distributed.all_reduce_max(int(self.nonfinite.found(before))):
                    break
        finally:
            self._logprob_options = options
            self.optimizer.zero_grad(set_to_none=True)

    def _micro_step(self, mb: dict, norms: dict, use_ref: bool, sums: "_WeightedSums", first: bool) -> tuple:
        """Forward, loss and backward of one micro-batch; returns its (pg, kl) loss shares, whether its loss was finite,
        and its log-probs [B, T] (detached)."""
        a, mask = self.cfg.algorithm, mb["response_mask"]
        distill_fn = self.distill.logits_fn(mb) if self.distill is not None else None
        logp, entropy, *topk = self._forward(mb, distill_fn)
        old_logp = logp.detach() if self.on_policy else mb["old_logp"]
        adv_BT = mb["adv"] if mb["adv"].dim() == 2 else mb["adv"].unsqueeze(1).expand_as(logp)  # per token, or per row
        distill_BT, distill_stats = None, {}
        if self.distill is not None:  # the teacher's per-token advantage, or its top-k KL as a loss
            adv_BT, distill_BT, distill_stats = self.distill.terms(mb, old_logp, adv_BT, topk[0] if topk else None, mask)
        pg_BT, stats = self.policy_loss(logp, old_logp, adv_BT, mask)
        stats = {**stats, **distill_stats}
        loss_mask = mask
        if self.rollout_correction is not None and "engine_logp" in mb:  # the trainer's policy over the engine's
            weight_BT, rc_stats = self.rollout_correction(old_logp, mb["engine_logp"], mask)
            pg_BT, stats = pg_BT * weight_BT, {**stats, **rc_stats}
            loss_mask = algo.rollout_loss_mask(weight_BT, mask)  # rejected tokens leave every term, as in _loss_mask
        agg = functools.partial(algo.aggregate_loss, mask_BT=loss_mask, **self._agg, **norms)
        loss = pg = agg(pg_BT)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * agg(entropy)
        if distill_BT is not None:
            loss = loss + agg(distill_BT)
        if self.router is not None:  # MoE: Switch Transformer's load-balancing loss, per micro-batch
            aux, moe_stats = self.router.stats()  # under sequence parallelism: of this rank's slice, so averaged
            loss = loss + self.router_aux_coef * aux / self.sp_size
            stats = {**stats, **moe_stats}
        kl_value = 0.0
        if use_ref:
            kl = agg(self.kl_penalty(logp, mb["ref_logp"]))
            loss = loss + a.kl.coef * kl
            kl_value = float(kl.detach())
        # DDP / FSDP average gradients over ranks; the loss is this rank's share of the global loss,
        # so the global gradient is the sum: scale by the world size. Under sequence parallelism the ranks of
        # a group compute the same loss, and each one's gradient is its slice's share (sequence_parallel.py).
        self.scaler.scale(loss * distributed.world_size()).backward()
        sums.add_micro_batch(stats, mask, entropy, logp, old_logp, mb.get("engine_logp"), first=first, on_policy=self.on_policy)
        if first and "engine_logp" in mb and "old_logp" not in mb:  # on-policy: the update pass's own log-probs
            sums.mismatch.add(old_logp, mb["engine_logp"], mask)
        return float(pg.detach()), kl_value, bool(torch.isfinite(loss.detach())), logp.detach()

    def _loss_mask(self, packed: Packed, rows: range) -> torch.Tensor:
        """The response mask of `rows` without the tokens rollout correction rejects (for the normalisers)."""
        x, sl = packed.tensors, slice(rows.start, rows.stop)
        mask = x["response_mask"][sl]
        if self._rejects and "engine_logp" in x:
            weight_BT, _ = self.rollout_correction(x["old_logp"][sl], x["engine_logp"][sl], mask)
            mask = algo.rollout_loss_mask(weight_BT, mask)
        return mask

    def _forward(self, mb: dict, logits_fn=None) -> tuple[torch.Tensor, ...]:
        """Log-probs and entropy [B, T] of a micro-batch's responses, with gradients, under the trained model
        (and logits_fn's output [B, T, K], distillation's top-k)."""
        router = self.router or contextlib.nullcontext()  # MoE: records the routing for the aux loss and metrics
        with self.runtime.autocast(), router:  # the forward only: losses and backward run outside, in fp32
            return response_logprobs(
                self.train_model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["response_mask"].shape[1],
                self.cfg.rollout.temperature, with_entropy=True, multi_modal=mb.get("multi_modal"), modality=self.modality,
                logits_fn=logits_fn, **self._logprob_options,
            )  # fmt: skip

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate from here on by `factor` (checkpoint.back_off); the new peak LR."""
        for i, group in enumerate(self.optimizer.param_groups):
            self.scheduler.base_lrs[i] *= factor
            group["lr"] *= factor
        return self.scheduler.base_lrs[0]

    def free_grads(self) -> None:
        """Drop the last update's gradients (fp32, 4 bytes a parameter) so that rollout has the memory."""
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Optimizer and scheduler state of this rank (the weights are saved in HF format apart); with
        fp16, the loss scaler's state rides with the optimizer's (as in Megatron)."""
        optimizer = self.optimizer.state_dict()
        if self.scaler.is_enabled():
            optimizer["grad_scaler"] = self.scaler.state_dict()
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore optimizer and scheduler; the config, not the checkpoint, sets lr / weight decay / betas.

        `optimizer.load_state_dict` restores the saved param-group hyperparameters; when the config
        names the same values the override below is a no-op, so an unchanged resume stays bit-exact.
        """
        optimizer = dict(state["optimizer"])
        scaler = optimizer.pop("grad_scaler", None)
        self.optimizer.load_state_dict(optimizer)
        if scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(scaler)
        self.scheduler.load_state_dict(state["scheduler"])
        t, sched = self.cfg.train, self.scheduler
        for i, group in enumerate(self.optimizer.param_groups):
            if group.get("initial_lr") == t.lr and group["weight_decay"] == t.weight_decay and tuple(group["betas"]) == tuple(t.betas):
                continue
            group["initial_lr"] = t.lr
            group["weight_decay"] = t.weight_decay
            group["betas"] = tuple(t.betas)
            sched.base_lrs[i] = t.lr
            group["lr"] = t.lr * sched.lr_lambdas[i](sched.last_epoch)

    def skip_schedule_to(self, step: int) -> None:
        """Fresh optimizer moments at a resumed step: the LR schedule still continues from `step`."""
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            for _ in range(step):
                self.scheduler.step()


class _WeightedSums:
    """Token-weighted means (and a few maxima) of per-micro-batch statistics, over ranks."""

    def __init__(self, group: Any = None) -> None:
        self.group = group  # the data-parallel group: one rank per set of rows (sequence parallelism)
        self.sums: dict[str, list[float]] = {}  # key -> [sum of value x weight, sum of weights]
        self.maxima: dict[str, float] = {}
        self.mismatch = MismatchAccumulator()  # engine vs trainer under verl's names (algorithms/mismatch.py)

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        acc = self.sums.setdefault(key, [0.0, 0.0])
        acc[0] += value * weight
        acc[1] += weight

    def add_max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, value), value)

    def add_micro_batch(self, stats: dict, mask, entropy, logp, old_logp, engine_logp, *, first: bool, on_policy: bool) -> None:
        """One micro-batch's metrics: the loss's stats, the entropy, and before the first optimizer step the
        engine-vs-trainer gap and |logp - logp_old| (the ratio must be 1 there; guards.py judges both)."""
        n_tok = float(mask.sum())
        for k, v in stats.items():
            self.add(k if "/" in k else f"actor/{k}", float(v), n_tok)
        self.add("actor/entropy", float(algo.masked_mean(entropy.detach(), mask)), n_tok)
        if first and engine_logp is not None:
            self.add("rollout/logprob_diff_mean", float(algo.masked_mean((old_logp.detach() - engine_logp).abs(), mask)), n_tok)
        if first and not on_policy:
            gap_BT = (logp.detach() - old_logp).abs()
            self.add_max("actor/first_ratio_gap", float((gap_BT * mask).max()))
            self.add("actor/first_ratio_gap_mean", float(algo.masked_mean(gap_BT, mask)), n_tok)

    def means(self) -> dict[str, float]:
        flat = {f"{k}\0{i}": v[i] for k, v in self.sums.items() for i in (0, 1)}
        total = distributed.all_reduce_sum_dict(flat, self.group)
        out = {k: total[f"{k}\0{0}"] / max(total[f"{k}\0{1}"], 1e-12) for k in self.sums}
        if self.mismatch.seen:  # the same on every rank: the batch has engine log-probs or not
            out |= self.mismatch.metrics(lambda s: distributed.all_reduce_sum_dict(s, self.group), distributed.all_reduce_max)
        return out | {k: distributed.all_reduce_max(self.maxima[k]) for k in sorted(self.maxima)}


def _input_rows(mb: dict) -> dict[str, list[int]]:
    """Rows of a micro-batch whose old / reference log-probs (no-grad passes) are not finite."""
    return {f"{k}_nonfinite_rows": bad_rows(mb[k], mb["response_mask"]) for k in ("old_logp", "ref_logp") if k in mb}


def _check_sequence_parallel(model: torch.nn.Module, size: int) -> None:
    """Refuse what Ulysses sequence parallelism does not split, before the first step."""
    text = getattr(model.config, "text_config", None) or model.config
    heads = int(text.num_attention_heads)
    if heads % size:
        raise UserError(
            f"train.sequence_parallel_size ({size}) must divide the model's attention heads ({heads}): Ulysses gives each "
            f"rank heads / {size} of them. Fix: choose a divisor of {heads}."
        )
