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
import signal
import time
from pathlib import Path
from typing import Any

import torch

from postrl import checkpoint, distributed, guards, lora
from postrl.assembly import build_run
from postrl.placement.source import open_source
from postrl.config import Config
from postrl.held import reference, teacher
from postrl.held.critic import CRITIC_DIR
from postrl.errors import Stopped, UserError
from postrl.evaluate import ValidationHistory, evaluate
from postrl.batch import Batch
from postrl.experience import batch_metrics, staleness_metrics
from postrl.metrics import MetricsLogger, Timer, plot_logged, progress_bar, read_jsonl, step_line, throughput, val_line
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
        self.algo_name = cfg.algorithm.name
        self.G = cfg.rollout.n_samples_per_prompt
        # runtime -> policy -> prompts -> reference -> actor (+ critic) -> validation -> rewards -> engine -> Experience
        run = build_run(cfg, "trainer", self.log, runtime=rt)
        self.run, self.policy, self.actor, self.critic = run, run.policy, run.actor, run.critic
        self.ref_model, self.teacher = run.ref_model, run.teacher
        self.model, self.tokenizer, self.model_path = self.policy.model, self.policy.tokenizer, self.policy.path
        self.train_examples, self.sampler, self.val_sets = run.examples, run.sampler, run.val_sets
        self.reward_fn, self.engine, self.experience = run.reward_fn, run.engine, run.experience
        if lora.is_lora(self.model):
            self.log(lora.summary(self.model))
            lora.turn_off_best_weights(cfg.checkpoint, self.log)
        self.logger = MetricsLogger(cfg.logging.dir, cfg.logging.sinks, cfg.model_dump(mode="json"), enabled=rt.is_main,
                                    metric_names=cfg.logging.metric_names, algo=self.algo_name)  # fmt: skip
        self.step, self.timer, self._closed, self.signals = 0, Timer(), False, StopOnSignal()
        self._phase = ""  # what the step in flight was doing, for the message of a stop signal that abandons it
        self.guards = guards.Guards(cfg, self.log)
        self.history = ValidationHistory(cfg.checkpoint.keep_best)  # the headline validation metric
        self.samples = SampleWriter(cfg, self.tokenizer, self.log, enabled=rt.is_main)  # <logging.dir>/samples/*.jsonl
        restored = checkpoint.resume(cfg, len(self.train_examples), self.log)
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
        if cfg.eval.before_train and self.step == 0 and self.val_sets:
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
                if cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0:
                    with self.timer("save"):
                        checkpoint.save(cfg, self.state_dict())
                    metrics["timing/save"] = self.timer.seconds.pop("save")
                self.logger.log(self.step, metrics)
                if self.step % cfg.logging.log_interval == 0:
                    progress.console.print(step_line(metrics, self.algo_name, self.step))
                progress.update(task, completed=self.step)
                last = metrics
                if distributed.all_reduce_max(stop.signum):  # every rank stops after the same step
                    self._stop_for_signal(stop.signum)
        final: dict[str, float] = {}
        if cfg.eval.after_train and self.val_sets:
            final = self.validate(last=True)
            self.logger.log(self.step, final)
            self.log(val_line("after RL", final))
        if cfg.checkpoint.save_final and not (cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0):
            checkpoint.save(cfg, self.state_dict())
        best_dir = Path(cfg.checkpoint.dir) / checkpoint.BEST if cfg.checkpoint.keep_best else None
        if (summary := self.history.summary(best_dir)) is not None:
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
            teacher.score(self.teacher, self.actor, self.model, local, self.runtime, self.timer)  # timing/teacher
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
        return self._step_metrics(batch, gen_stats, update_stats)

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
            done = f"stopped after step {self.step} with a checkpoint in {self.cfg.checkpoint.dir}" if self.step else "stopped before any step"
            self.log(f"[yellow]{signal.Signals(exc.signum).name} received: {done}; step {self.step + 1}, which was {self._phase}, "
                     "was abandoned; run the same command again to continue (checkpoint.resume: auto).[/yellow]")  # fmt: skip
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
        if self.step == 0 or self.cfg.checkpoint.save_freq and self.step % self.cfg.checkpoint.save_freq == 0:
            return None  # nothing trained yet, or this step's checkpoint exists
        return checkpoint.save(self.cfg, {**self.state_dict(), **before})

    def _stop_for_signal(self, signum: int) -> None:
        """Preemption (SIGTERM) or Ctrl-C: checkpoint the finished step, release everything, exit cleanly."""
        cfg = self.cfg
        if not (cfg.checkpoint.save_freq and self.step % cfg.checkpoint.save_freq == 0):
            checkpoint.save(cfg, self.state_dict())
        self.close()
        name = signal.Signals(signum).name if signum > 0 else "a stop signal"
        self.log(
            f"[yellow]{name} received: stopped after step {self.step} with a checkpoint in {cfg.checkpoint.dir}; "
            "run the same command again to continue (checkpoint.resume: auto).[/yellow]"
        )
        raise Stopped(signum)

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
        return {
            "step": self.step,
            "model": self.model,
            "tokenizer": self.tokenizer,
            **self.actor.state_dict(),
            **({"critic": self.critic.state_dict()} if self.critic is not None else {}),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "train_prompts": len(self.train_examples),
        }

    def load_state_dict(self, restored: checkpoint.Restored) -> None:
        if restored.finetune or not lora.is_lora(self.model):
            checkpoint.load_weights(self.model, restored.model_dir)  # LoRA finetune: they become the frozen base
        else:  # LoRA resume: model.path's base, the checkpoint's adapters
            checkpoint.load_adapter(self.model, restored.path / lora.ADAPTER_DIR)
        if restored.finetune:
            self.log(f"finetune: loaded the weights of {restored.path}; starting a fresh run at step 0")
            return
        self.step = restored.step
        if restored.optimizer is not None:
            self.actor.load_state_dict({"optimizer": restored.optimizer, "scheduler": restored.scheduler})
        else:
            self.actor.skip_schedule_to(self.step)
        if self.critic is not None:
            self.critic.load(restored.path / CRITIC_DIR, restored.critic_optimizer, restored.critic_scheduler, self.step)
        if restored.rng is not None:
            set_rng_state(restored.rng)
        self.sampler.load_state_dict(restored.sampler)
        metrics_path = Path(self.cfg.logging.dir) / "metrics.jsonl"
        if metrics_path.exists():
            rows = read_jsonl(metrics_path)
            self.history.replay(rows, self.step)
            self.guards.replay(rows, self.step)  # the training rewards heldout_collapse compares
        self.log(f"resumed from {restored.path} at step {self.step}")
        if self.step >= self.cfg.train.total_steps:
            self.log(
                f"[yellow]nothing to train: the checkpoint is at step {self.step} and train.total_steps is "
                f"{self.cfg.train.total_steps}. To start over, use a new logging.dir or checkpoint.resume=none; "
                "to train on, raise train.total_steps.[/yellow]"
            )

    # ----------------------------------------------------------------------------------- metrics
    def _step_metrics(self, batch: Batch, gen_stats: dict, update_stats: dict) -> dict[str, float]:
        cfg, name = self.cfg, self.algo_name
        m: dict[str, float] = {"training/step": self.step + 1, "training/epoch": self.sampler.epoch}
        m.update(batch_metrics(batch, name, self.G))
        m.update(staleness_metrics(batch.versions, self.step))
        m.update(gen_stats)
        m.update(update_stats)
        timing = self.timer.timing()
        m.update(timing)
        m.update(throughput(m["response_length/total_mean"], m["prompt_length/mean"], cfg.train.global_batch_size,
                            self.G, cfg.world_size, timing, self.engine.name))  # fmt: skip
        return m

    # -------------------------------------------------------------------------------- validation
    def validate(self, last: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        engine, agent = self.batches.validation_engine(self.model), self.cfg.rollout.takes_rows
        out = {}
        for name, examples in self.val_sets.items():
            out.update(evaluate(engine, self.tokenizer, self.reward_fn.score_rules, examples, self.cfg.eval, name, self.cfg.train.seed, agent,
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
        checkpoint.load_weights(self.model, Path(self.cfg.checkpoint.dir) / checkpoint.BEST / "model")
        self.batches.publish(self.model, self.step)  # the next batches are sampled from them
        self.history.restore(self.step, best["step"], best["value"])
        out.update({"training/back_off": 1.0, "training/back_off_to_step": float(best["step"])})
        fell = f"{best['metric']} fell to {value:.1%} at step {self.step}, {best['value'] - value:.1%} below the best {best['value']:.1%}"
        if last:
            self.log(f"[yellow]end_with_best: {fell}; the run ends with step {best['step']}'s weights.[/yellow]")
            return
        lr = self.actor.scale_lr(self.cfg.checkpoint.back_off_lr_factor)
        self.log(f"[yellow]back-off: {fell}: the weights are step {best['step']}'s again, the peak lr {lr:.2g} from here.[/yellow]")


def train(cfg: Config, console: Any = None) -> dict[str, float]:
    """Run a full training job; returns the last step's metrics plus the final validation."""
    return Trainer(cfg, console).fit()
