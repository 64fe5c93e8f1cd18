"""The critic of PPO (algorithm.adv_estimator: gae): a value model, its optimizer, GAE and the value update.

    packed rows (the actor's `pack`) -> values V_old [B, T] (no grad, `compute_values`)
      -> terminal reward on each row's last model token (- kl_coef x KL per token with use_kl_in_reward) -> GAE over model tokens -> returns = A + V_old,
         advantages whitened over the batch's model tokens on all ranks (`advantages`)
      -> the clipped value loss, mini x micro batches like the actor's (`update`)

The model is `AutoModelForTokenClassification` with one label, loaded from the policy's initial weights
(or critic.model_path): the backbone and a fresh linear head `score` on every position, as verl's
critic. Being a plain Hugging Face model it is saved and loaded in HF format (a checkpoint's critic/model
can seed another run's critic.model_path), and FSDP2 / DDP wrap it like the policy. The value of
response token t is read at the position that predicts it (t - 1), as for log-probs: V_t values the
state before the policy samples token t.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch

from postrl import algorithms as algo
from postrl import distributed
from postrl.actor import Actor, Packed, _WeightedSums
from postrl.errors import UserError
from postrl.runtime import Runtime
from postrl.schedule import lr_lambda

CRITIC_DIR = "critic"  # inside a checkpoint: model/ (HF format), optimizer_rank{r}.pt, scheduler.pt


def load_value_model(path: str, attn_implementation: str | None, gradient_checkpointing: bool) -> torch.nn.Module:
    """A one-label token-classification model of `path` in fp32 (master weights); no dropout on the head."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were newly initialized": the value head, as intended
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # values must not depend on a dropout draw (and resume stays exact)
        model = AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a value model (AutoModelForTokenClassification, one label) from '{path}' ({exc}). Fix: "
            "leave critic.model_path unset (the policy's weights with a fresh value head), or point it at a "
            "checkpoint's critic/model directory or another text model that transformers can load this way."
        ) from None
    finally:
        hf_logging.set_verbosity(previous)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


class Critic:
    """Owns the value model, its optimizer and scheduler; the trainer calls `advantages`, then `update`."""

    def __init__(self, cfg: Any, policy_path: str, actor: Actor, runtime: Runtime, log=print):
        self.cfg, self.actor, self.runtime, self.log = cfg, actor, runtime, log
        if actor.modality.name != "text":
            raise UserError(
                f"algorithm.adv_estimator gae needs a critic, and the critic supports text models only; this policy is a "
                f"{actor.modality.name} model. Fix: use a critic-free estimator (grpo, rloo, ...) for vision-language models."
            )
        c, t = cfg.critic, cfg.train
        attn = actor.model.config._attn_implementation
        self.model = load_value_model(c.model_path or policy_path, attn, cfg.model.gradient_checkpointing)
        self.model.to(runtime.device).train()
        self.train_model = distributed.wrap_model(
            self.model, t.strategy, compute_dtype=runtime.dtype, reshard_after_forward=t.reshard_after_forward
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(c.warmup_steps, t.total_steps, "constant", 1.0))
        self.value_loss = functools.partial(algo.value_loss, cliprange_value=c.cliprange_value)
        self._agg = dict(mode=cfg.algorithm.loss_agg_mode, max_response_len=cfg.rollout.max_tokens)

    # ---------------------------------------------------------------------------------- values
    def _values(self, model: torch.nn.Module, mb: dict) -> torch.Tensor:
        """V [b, T] of a micro-batch's response tokens (fp32), read where each token is predicted."""
        T = mb["response_mask"].shape[1]
        with self.runtime.autocast():
            out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False)
        return out.logits[:, -T - 1 : -1, 0].float()

    @torch.no_grad()
    def compute_values(self, packed: Packed) -> torch.Tensor:
        """V_old [B, T] of every row's response tokens under the current critic."""
        out = torch.zeros_like(packed.tensors["response_mask"], dtype=torch.float32)
        for idx, mb in self.actor.micro_batches(range(packed.size), packed, log_prob_pass=True):
            T = mb["response_mask"].shape[1]
            out[torch.tensor(idx, device=out.device), :T] = self._values(self.train_model, mb)
        return out

    def advantages(self, packed: Packed) -> dict[str, float]:
        """Values, GAE advantages (whitened over the whole batch's model tokens) and returns into `packed`;
        returns the critic/values|returns|advantages statistics (of the model tokens, all ranks)."""
        a, x = self.cfg.algorithm, packed.tensors
        mask = x["response_mask"].float()
        values = self.compute_values(packed) * mask
        rewards = algo.terminal_rewards(x["reward"], mask)
        stats = {}
        if a.use_kl_in_reward:  # verl's use_kl_in_reward with a fixed coefficient
            kl = algo.kl_penalty(x["old_logp"], x["ref_logp"], a.kl.estimator) * mask
            rewards = rewards - a.kl_ctrl.kl_coef * kl
            n, total = distributed.all_reduce_sum([float(mask.sum()), float(kl.sum())])
            stats = {"actor/reward_kl_penalty": total / max(n, 1.0), "actor/reward_kl_penalty_coeff": a.kl_ctrl.kl_coef}
        adv, returns = algo.gae_advantages(rewards, values, mask, a.gamma, a.lam)
        totals = distributed.all_reduce_sum(list(algo.whiten_totals(adv, mask)))
        x["values"], x["returns"], x["adv"] = values, returns, algo.masked_whiten(adv, mask, tuple(totals))
        for name, key in (("values", "values"), ("returns", "returns"), ("advantages", "adv")):
            stats.update(_token_stats(f"critic/{name}", x[key], mask))
        return stats

    # ---------------------------------------------------------------------------------- update
    def update(self, packed: Packed) -> dict[str, float]:
        """The clipped value loss over mini x micro batches (the actor's), train.epochs_per_batch times."""
        t = self.cfg.train
        mini = t.mini_batch_size * self.actor.G // distributed.world_size()
        sums = _WeightedSums()
        grad_norms = []
        for _epoch in range(t.epochs_per_batch):
            for start in range(0, packed.size, mini):
                rows = range(start, min(start + mini, packed.size))
                mask = packed.tensors["response_mask"][rows.start : rows.stop]
                norms = distributed.all_reduce_sum_dict(algo.loss_normalizers(mask))
                self.optimizer.zero_grad(set_to_none=True)
                vf_total = 0.0
                for _idx, mb in self.actor.micro_batches(rows, packed):
                    vf_total += self._micro_step(mb, norms, sums)
                grad_norm = distributed.clip_grad_norm_(self.params, t.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    self.log("[yellow]non-finite critic grad norm: this critic step is skipped[/yellow]")
                grad_norms.append(float(grad_norm))
                sums.add("critic/vf_loss", distributed.all_reduce_sum([vf_total])[0])
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        return {**sums.means(), "critic/grad_norm": sum(grad_norms) / len(grad_norms), "critic/lr": lr}

    def _micro_step(self, mb: dict, norms: dict, sums: _WeightedSums) -> float:
        mask = mb["response_mask"]
        vpred = self._values(self.train_model, mb)
        loss_BT, stats = self.value_loss(vpred, mb["values"], mb["returns"], mask)
        loss = algo.aggregate_loss(loss_BT, mask, **self._agg, **norms)
        (loss * distributed.world_size()).backward()  # this rank's share; DDP / FSDP average over ranks
        n_tok = float(mask.sum())
        sums.add("critic/vf_clipfrac", float(stats["critic/vf_clipfrac"]), n_tok)
        sums.add("critic/vpred_mean", float(algo.masked_mean(vpred.detach(), mask)), n_tok)
        return float(loss.detach())

    def free_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's critic/ holds: the model (saved in HF format) and this rank's optimizer and scheduler."""
        return {"model": self.model, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load(self, critic_dir: Path, optimizer: dict | None, scheduler: dict | None, step: int) -> None:
        """The weights of a checkpoint's critic/model, then its optimizer and scheduler (None: fresh moments,
        the schedule skipped to `step`, as the actor's with checkpoint.load_optimizer false)."""
        from postrl.checkpoint import load_weights

        if not (critic_dir / "model").is_dir():
            raise UserError(
                f"{critic_dir.parent} has no critic: it was written by a run without one, and this run "
                f"(algorithm.adv_estimator {self.cfg.algorithm.adv_estimator}) needs its value model. Fix: resume with the "
                "estimator that checkpoint was trained with, or start afresh from its weights with checkpoint.finetune: true."
            )
        load_weights(self.model, critic_dir / "model")
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
            self.scheduler.load_state_dict(scheduler)
            return
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            for _ in range(step):
                self.scheduler.step()


def _token_stats(prefix: str, x_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """mean / max / min of x over the model tokens of every rank."""
    keep = mask_BT.bool()
    n, s = distributed.all_reduce_sum([float(keep.sum()), float(x_BT[keep].sum())])
    hi = float(x_BT[keep].max()) if keep.any() else float("-inf")
    lo = float(x_BT[keep].min()) if keep.any() else float("inf")
    return {f"{prefix}/mean": s / max(n, 1.0), f"{prefix}/max": distributed.all_reduce_max(hi), f"{prefix}/min": -distributed.all_reduce_max(-lo)}
