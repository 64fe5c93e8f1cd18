"""The GRPO / DAPO training loop, top to bottom (docs/architecture.md).

    batch of step s (rollout, rewards, dynamic sampling)           placement/ -> experience.py
    -> group advantages                                            experience.py
    -> old / ref log-probs -> clipped policy update (mini x micro batches, clip, AdamW, LR)   actor.py
    -> publish the weights for the next batches -> metrics, validation, checkpoint           here

assembly.py builds the pieces once (runtime, policy, reference, data, rewards, engine, actor); the
trainer only composes them. Where rollout runs (this rank, a worker process) is its BatchSource's
business: the loop reads the same for every placement. Formulas live in algorithms/, files in checkpoint/.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from postrl import checkpoint, distributed, guards, lora
from postrl.assembly import build_run
from postrl.placement.source import open_source
from postrl.config import Config
from postrl.held import reference, teacher
from postrl.errors import Stopped, UserError
from postrl.evaluate import ValidationHistory, evaluate
from postrl.experience import step_metrics
from postrl.metrics import MetricsLogger, Timer, plot_logged, progress_bar, step_line, val_line
from postrl.runtime import StepAbandoned, StopOnSignal, init_runtime, rng_state, set_rng_state
from postrl.samples import SampleWriter


class Trainer:
    """Holds the run's state; `fit()` runs the loop."""

    def __init__(self, cfg: Config, console: Any = None):
        from rich.console import Console

        self.cfg = cfg
        self.runtime = rt = init_runtime(cfg.train.device, cfg.model.dtype, cfg.train.strategy)
        distributed.init_sequence_parallel(cfg.train.sequence_parallel_size)  # its groups (a collective: every rank)
        self.console = (console or Console()) if rt.is_main else Console(quiet=True)  # rank 0 prints for the run
        checkpoint.check_run_dirs(cfg)  # before the model loads: a bad directory costs nothing yet
        self.lock = checkpoint.RunLock(cfg.logging.dir) if rt.is_main else None
        self.algo_name, self.G = cfg.algorithm.name, cfg.rollout.n_samples_per_prompt
        # runtime -> policy -> prompts -> reference -> actor (+ critic) -> validation -> rewards -> engine -> Experience
        self.run = run = build_run(cfg, "trainer", self.log, runtime=rt)  # below: short names for its most used fields
        self.actor, self.critic, self.ref_model, self.sampler = run.actor, run.critic, run.ref_model, run.sampler
        self.model, self.tokenizer, self.engine, self.experience = run.policy.model, run.policy.tokenizer, run.engine, run.experience
        if lora.is_lora(self.model):
            self.log(lora.summary(self.model))
            lora.turn_off_best_weights(cfg.checkpoint, self.log)
        self.logger = MetricsLogger(cfg.logging.dir, cfg.logging.sinks, cfg.model_dump(mode="json"), enabled=rt.is_main,
                                    metric_names=cfg.logging.metric_names, algo=self.algo_name)  # fmt: skip
        self.step, self.timer, self._closed, self.signals, self._phase = 0, Timer(), False, StopOnSignal(), ""  # _phase: _abandonable's message
        self.guards = guards.Guards(cfg, self.log)
        self.history = ValidationHistory(cfg.checkpoint.keep_best)  # the headline validation metric
        self.samples = SampleWriter(cfg, self.tokenizer, self.log, enabled=rt.is_main)  # <logging.dir>/samples/*.jsonl
        restored = checkpoint.resume(cfg, len(self.run.examples), self.log)
        if restored is not None:
            self.load_state_dict(restored)
            self.engine.sync_weights(self.model)
        # where rollout runs (postrl.placement): this rank's engine, or a worker process from the restored position
        self.batches = open_source(cfg, run, self.guards, self.step, self.log)

    def log(self, msg: str) -> None:
        self.console.print(msg)

    # ----------------------------------------------------------------------------------- the loop
    def fit(self) -> dict[str, float]:
        """Train to train.total_steps; whatever stops the run, its resources (verifier workers, engine, the
        run-directory lock) are released."""
        try:
            return self._fit()
        except BaseException:
            self.close()
            raise

    def _fit(self) -> dict[str, float]:
        cfg = self.cfg
        last: dict[str, float] = {}
        if cfg.eval.before_train and self.step == 0 and self.run.val_sets:
            last.update(self.validate())
            self.logger.log(0, last)
            self.log(val_line("before RL", last))
        with progress_bar(self.console, cfg.logging.progress) as progress, self.signals as stop:
            task = progress.add_task(f"{self.algo_name} training", total=cfg.train.total_steps, completed=self.step)
            while self.step < cfg.train.total_steps:
                metrics = self.train_step()
                self.step += 1
                self.guards.after_step(metrics, self.step)
                if cfg.eval.freq and self.step % cfg.eval.freq == 0 and self.step < cfg.train.total_steps:
                    metrics.update(self.validate())
                if checkpoint.saved_at(cfg, self.step):
                    with self.timer("save"):
                        checkpoint.save(cfg, self.state_dict())
                    metrics["timing/save"] = self.timer.seconds.pop("save")
                self.logger.log(self.step, metrics)
                if self.step % cfg.logging.log_interval == 0:
                    progress.console.print(step_line(metrics, self.algo_name, self.step))
                progress.update(task, completed=self.step)
                last = metrics
                if distributed.all_reduce_max(stop.signum):  # preemption or Ctrl-C: every rank stops after the same step
                    self._save_trained({})  # the finished step's checkpoint; then release everything and exit cleanly
                    self.close()
                    self.log(checkpoint.stopped_line(cfg, stop.signum, self.step))
                    raise Stopped(stop.signum)
        final: dict[str, float] = {}
        if cfg.eval.after_train and self.run.val_sets:
            final = self.validate(last=True)
            self.logger.log(self.step, final)
            self.log(val_line("after RL", final))
        if cfg.checkpoint.save_final and not checkpoint.saved_at(cfg, self.step):
            checkpoint.save(cfg, self.state_dict())
        if (summary := self.history.summary(checkpoint.best_dir(cfg))) is not None:
            self.log(summary)
        self.close()
        if self.runtime.is_main:
            plot_logged(cfg.logging, self.algo_name, self.log)
        return {**last, **final}

    def train_step(self) -> dict[str, float]:
        self.timer = Timer()
        for part in (self.actor, self.critic) if self.critic else (self.actor,):
            part.free_grads()  # the last update's fp32 gradients: rollout needs the memory more
        with self.timer("all"), self._abandonable():
            batch, gen_stats = self._collect()  # the global batch, the same on every rank
            self._phase = "computing its log-probs and update (before its optimizer step)"
            with self.timer("adv"):
                adv_B = self.experience.advantages(batch) if self.critic is None else torch.zeros(batch.size)  # GAE: below
                local = self.actor.pack(batch, adv_B)  # this rank's rows
            if not self.actor.on_policy or self.cfg.algorithm.use_kl_in_reward:  # PPO's KL in the reward reads them
                with self.timer("old_log_p"):
                    local.tensors["old_logp"] = self.actor.compute_logprobs(self.model, local)
            if self.ref_model is not None:
                with self.timer("reference_model"), reference.ready(self.ref_model, self.model, self.runtime, self.timer) as ref:
                    local.tensors["ref_logp"] = self.actor.compute_logprobs(ref, local)
            teacher.score(self.run.teacher, self.actor, self.model, local, self.runtime, self.timer)  # timing/teacher
            update_stats = {}
            if self.critic is not None:  # values, GAE advantages and returns, then the critic's update (verl's order)
                with self.timer("values"):
                    update_stats = self.critic.advantages(local)
                self.signals.commit()  # the critic's optimizer steps come first: from here the step finishes
                with self.timer("update_critic"):
                    update_stats.update(self.critic.update(local))
            with self.timer("update"):
                update_stats.update(self.actor.update(local, use_ref=self.cfg.algorithm.kl.coef > 0, commit=self.signals.commit))
            self.signals.commit()  # an update that took no optimizer step has changed nothing either way
            with self.timer("resharding_to_infer"):  # the weights for the next batches, checked where they land
                update_stats.update(self.batches.publish(self.model, self.step + 1))
        self.samples.rollout(self.step + 1, batch)
        return step_metrics(self.cfg, batch, self.step, self.sampler.epoch, {**gen_stats, **update_stats}, self.timer.timing(),
                            self.engine.name)  # fmt: skip

    @contextlib.contextmanager
    def _abandonable(self):
        """A stop signal before the step's first optimizer step (its rollout, which can wait on agent programs for
        rollout.agent_timeout_s; its log-prob passes; its update's micro-batches) abandons the step at once (one process
        only: no rank waits in a collective), so a preempted run exits within seconds: the steps trained so far are
        checkpointed as they were before this step began (its RNG and sampler too), and a resumed run redoes it."""
        before = {"rng": rng_state(), "sampler": self.sampler.state_dict()}
        self._phase = "collecting its batch"
        try:
            with self.signals.abandonable(not distributed.is_distributed()):
                yield
        except StepAbandoned as exc:
            self._save_trained(before)
            self.close()
            self.log(checkpoint.stopped_line(self.cfg, exc.signum, self.step, abandoned=self._phase))
            raise Stopped(exc.signum) from None

    def _collect(self):
        """The step's batch. When the data stops the run (dynamic sampling exhausted, every reward failing), the
        steps trained so far are checkpointed first, as they were before this step began."""
        before = {"rng": rng_state(), "sampler": self.sampler.state_dict()}
        try:
            return self.batches.next_batch(self.step, self.timer)
        except UserError as exc:
            if (path := self._save_trained(before)) is None:
                raise  # nothing trained yet, or this step's checkpoint exists
            raise UserError(*exc.problems, f"The {self.step} step(s) trained so far are saved in {path}; after the fix, the "
                            "same command continues from there (checkpoint.resume: auto).", title=exc.title) from None  # fmt: skip

    def _save_trained(self, before: dict) -> Path | None:
        """Checkpoint the steps trained so far, with the RNG and sampler of `before` (the step's start)."""
        if self.step == 0 or checkpoint.saved_at(self.cfg, self.step):
            return None  # nothing trained yet, or this step's checkpoint exists
        return checkpoint.save(self.cfg, {**self.state_dict(), **before})

    def close(self) -> None:
        """Release the run's resources (idempotent: the error and signal paths call it too)."""
        if self._closed:
            return
        self._closed = True
        self.logger.close()
        self.batches.close()
        self.run.close()  # the rewards' workers and the engine
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint holds; checkpoint.save owns the files."""
        critic = {"critic": self.critic.state_dict()} if self.critic is not None else {}
        return {"step": self.step, "model": self.model, "tokenizer": self.tokenizer, **self.actor.state_dict(), **critic,
                "sampler": self.sampler.state_dict(), "rng": rng_state(), "train_prompts": len(self.run.examples)}

    def load_state_dict(self, restored: checkpoint.Restored) -> None:
        """Put a checkpoint's pieces in place (checkpoint.resume read its files)."""
        checkpoint.load_model(self.model, restored)
        if restored.finetune:
            return checkpoint.report(self.cfg, restored, self.log)
        self.step = restored.step
        if restored.optimizer is not None:
            self.actor.load_state_dict({"optimizer": restored.optimizer, "scheduler": restored.scheduler})
        else:
            self.actor.skip_schedule_to(self.step)
        if self.critic is not None:
            self.critic.load(restored.critic_dir, restored.critic_optimizer, restored.critic_scheduler, self.step)
        if restored.rng is not None:
            set_rng_state(restored.rng)
        self.sampler.load_state_dict(restored.sampler)
        self.history.replay(restored.metrics, self.step)
        self.guards.replay(restored.metrics, self.step)  # the training rewards heldout_collapse compares
        checkpoint.report(self.cfg, restored, self.log)

    # -------------------------------------------------------------------------------- validation
    def validate(self, last: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        engine, agent = self.batches.validation_engine(self.model), self.cfg.rollout.takes_rows
        out = {}
        for name, examples in self.run.val_sets.items():
            out.update(evaluate(engine, self.tokenizer, self.run.reward_fn.score_rules, examples, self.cfg.eval, name, self.cfg.train.seed, agent,
                                record=self.samples.for_validation(self.step)))
        out["timing/eval"] = time.perf_counter() - start
        found = self.history.record(self.step, out)  # the headline metric (checkpoint.keep_best)
        checkpoint.keep_if_best(self.cfg, self.model, self.tokenizer, self.step, found)
        collapsed = self.guards.after_validation(self.history.points, found)  # held-out collapse: warns
        if (best := checkpoint.fell_below_best(self.cfg, found, last, collapsed)) is not None:
            self._back_off(best, found[1], out, last)
        return out

    def _back_off(self, best: dict, value: float, out: dict, last: bool) -> None:
        """checkpoint.back_off / end_with_best: validation fell below the best; back to the best weights
        (during the run at a smaller LR)."""
        checkpoint.load_best(self.cfg, self.model)
        self.batches.publish(self.model, self.step)  # the next batches are sampled from them
        self.history.restore(self.step, best["step"], best["value"])
        out.update({"training/back_off": 1.0, "training/back_off_to_step": float(best["step"])})
        lr = None if last else self.actor.scale_lr(self.cfg.checkpoint.back_off_lr_factor)
        self.log(checkpoint.back_off_line(best, value, self.step, lr))


def train(cfg: Config, console: Any = None) -> dict[str, float]:
    """Run a full training job; returns the last step's metrics plus the final validation."""
    return Trainer(cfg, console).fit()
