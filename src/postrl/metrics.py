"""Metric names, throughput formulas and sinks (console line, JSONL, TensorBoard, W&B, SwanLab).

Names follow the guides (docs/metrics.md) so dashboards carry over:
timing/*, actor/*, <algo>/rewards/*, <algo>/score/*, response_length/*, prompt_length/*,
dapo/num_gen_batches, dapo/kept_groups_ratio, e2e_tps, update_tps, vllm_tps (rollout_tps), val/<ds>/*.
`logging.metric_names: mindspeed | verl` renames them at the sinks (`rename_metrics`; docs/metrics.md).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("postrl.metrics")

TIMING_KEYS = (
    "all", "rollout", "reward", "old_log_p", "reference_model", "ref_onload", "ref_offload", "adv", "update",
    "resharding_to_infer", "resharding_to_train", "save", "eval", "wait_rollout", "teacher",
)  # fmt: skip

# ------------------------------------------------------------------------------ the guides' names
# logging.metric_names: the loop computes postrl's names; the sinks write the guide's (docs/metrics.md).
# postrl name -> the names written instead ("{algo}" is algorithm.name). Names not listed pass unchanged.
# MindSpeed keeps postrl's names (they are MindSpeed-RL's) and adds MindSpeed-MM's; verl replaces them.
GUIDE_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "mindspeed": {
        "actor/grad_norm": ("actor/grad_norm", "grad_norm"),
        "actor/lr": ("actor/lr", "{algo}/lr"),
        "timing/reward": ("timing/reward", "timing/rule_reward", "timing/non_overlap_rule_reward"),
        # postrl runs the phases one after another, so none overlaps another: non-overlap time = phase time.
        "timing/reference_model": ("timing/reference_model", "timing/non_overlap_reference_model"),
        "timing/adv": ("timing/adv", "timing/non_overlap_adv"),
        "timing/resharding_to_infer": ("timing/resharding_to_infer", "timing/reshard_to_infer"),
        "timing/resharding_to_train": ("timing/resharding_to_train", "timing/reshard_to_train"),
    },
    "verl": {
        # verl's rollout worker times its generate_sequences call and the weight reshard inside it as well.
        "timing/rollout": ("timing_s/gen", "timing_s/generate_sequences"),
        "timing/reward": ("timing_s/reward",),
        "timing/old_log_p": ("timing_s/old_log_prob",),
        "timing/reference_model": ("timing_s/ref",),
        "timing/adv": ("timing_s/adv",),
        "timing/update": ("timing_s/update_actor",),
        "timing/resharding_to_infer": ("timing_s/update_weights", "timing_s/reshard"),
        "timing/save": ("timing_s/save_checkpoint",),
        "timing/eval": ("timing_s/testing",),
        "timing/all": ("timing_s/step", "perf/time_per_step"),
        "{algo}/score/mean": ("critic/score/mean",),
        "{algo}/score/max": ("critic/score/max",),
        "{algo}/score/min": ("critic/score/min",),
        "{algo}/rewards/mean": ("critic/rewards/mean",),
        "{algo}/rewards/max": ("critic/rewards/max",),
        "{algo}/rewards/min": ("critic/rewards/min",),
        "total_tokens": ("perf/total_num_tokens",),
        "e2e_tps": ("perf/throughput", "e2e_tps"),
        # on-policy distillation (verl's distillation losses log under actor/distillation/*)
        "distill/reverse_kl": ("actor/distillation/loss",),
        "distill/teacher_topk_mass": ("actor/distillation/teacher_mass",),
    },
}


def guide_names(names: str, algo: str) -> dict[str, tuple[str, ...]]:
    """The renaming of one logging.metric_names mode, with the algorithm's prefix filled in."""
    return {k.format(algo=algo): tuple(n.format(algo=algo) for n in v) for k, v in GUIDE_NAMES.get(names, {}).items()}


def rename_metrics(metrics: dict[str, float], names: str, algo: str) -> dict[str, float]:
    """postrl's metrics under the names of logging.metric_names (postrl: unchanged)."""
    if names == "postrl":
        return metrics
    table = guide_names(names, algo)
    out: dict[str, float] = {}
    for k, v in metrics.items():
        for name in table.get(k, (k,)):
            out[name] = v
        if names == "mindspeed":  # MindSpeed-RL logs each verifier's mean score as <algo>/<verifier>_rewards/mean
            head, _, tail = k.partition("/")
            verifier = tail.removesuffix("/mean")
            if head == algo and tail.endswith("/mean") and "/" not in verifier and verifier not in _NOT_VERIFIERS:
                out[f"{algo}/{verifier}_rewards/mean"] = v
    return out


_NOT_VERIFIERS = frozenset({"rewards", "score", "acc", "rm_score"})  # <algo>/<name>/mean that are not a verifier's score


def lookup(row: dict, name: str, algo: str, default: float | None = None) -> float | None:
    """A postrl metric from a metrics.jsonl row written under any logging.metric_names."""
    if name in row:
        return row[name]
    for mode in GUIDE_NAMES:
        for alias in guide_names(mode, algo).get(name, ()):
            if alias in row:
                return row[alias]
    return default


class Timer:
    """Accumulates wall time per name; `timing()` returns the timing/<name> metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def timing(self) -> dict[str, float]:
        return {f"timing/{k}": self.seconds.get(k, 0.0) for k in TIMING_KEYS}


def throughput(
    response_length_mean: float,
    prompt_length_mean: float,
    global_batch_size: int,
    n_samples: int,
    world_size: int,
    timing: dict[str, float],
    engine: str,
) -> dict[str, float]:
    """The guides' e2e_tps / update_tps / vllm_tps: tokens per device per second of each phase."""
    tokens = (response_length_mean + prompt_length_mean) * global_batch_size * n_samples / world_size

    def per(seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0

    rollout_tps = per(timing["timing/rollout"])
    return {
        "total_tokens": tokens * world_size,  # prompt + response tokens of the step's batch, all ranks
        "e2e_tps": per(timing["timing/all"]),
        "update_tps": per(timing["timing/update"]),
        f"{engine}_tps": rollout_tps,
        "vllm_tps": rollout_tps,
        "rollout_tps": rollout_tps,
    }


def summary_stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


class MetricsLogger:
    """Writes one JSON object per step to <dir>/metrics.jsonl and optional external sinks."""

    def __init__(
        self, log_dir: str | Path, sinks: list[str], config_dict: dict | None = None, enabled: bool = True,
        metric_names: str = "postrl", algo: str = "grpo",
    ):  # fmt: skip
        self.dir = Path(log_dir)
        self.metric_names, self.algo = metric_names, algo
        self.enabled = enabled
        self.sinks = sinks
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._swanlab = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in sinks:
            path = self.dir / "metrics.jsonl"
            drop_torn_tail(path)  # else the next line would be glued to the torn one
            self._jsonl = open(path, "a")
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        if "wandb" in sinks:
            import wandb

            self._wandb = wandb.init(project="postrl", dir=str(self.dir), config=config_dict)
        if "swanlab" in sinks:
            import swanlab

            self._swanlab = swanlab.init(project="postrl", logdir=str(self.dir), config=config_dict)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics = rename_metrics(metrics, self.metric_names, self.algo)
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(metrics, step=step)
        if self._swanlab:
            self._swanlab.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a metrics file, one JSON object per line.

    A run killed while writing leaves a torn last line: it is skipped with a warning (it held at most
    one step, which the resumed run logs again). A bad line anywhere else means the file was edited
    or damaged, and is a UserError naming the file and the line.
    """
    from postrl.errors import UserError

    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(no, line) for no, line in enumerate(lines, start=1) if line.strip()]
    rows = []
    for k, (no, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as exc:
            if k == len(numbered) - 1:
                log.warning("%s: skipped the torn last line %d (%d characters; a run stopped mid-write).", path, no, len(line))
                break
            raise UserError(
                f"{path} line {no} is not a JSON object ({exc}). A metrics file holds one object per line, "
                "and only the last line can be torn by a run that was stopped. Fix: delete or repair that line."
            ) from None
        rows.append(row)
    return rows


def drop_torn_tail(path: str | Path) -> int:
    """Before appending to a JSONL file: cut off an unterminated last line that is not valid JSON
    (a write torn by a kill), or end a complete one with its newline. Returns the bytes cut."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1  # 0 when the torn line is the only one
    try:
        json.loads(data[keep:])
    except ValueError:
        with open(path, "r+b") as f:
            f.truncate(keep)
        log.warning("%s: removed a torn last line (%d bytes; a run stopped mid-write).", path, len(data) - keep)
        return len(data) - keep
    with open(path, "ab") as f:
        f.write(b"\n")
    return 0


def plot_run(metrics_path: str | Path, out_png: str | Path, algo: str) -> Path:
    """Reward, accuracy and response length over steps, plus validation accuracy, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Rows in postrl's names, whatever logging.metric_names the run wrote them under.
    wanted = (f"{algo}/rewards/mean", f"{algo}/acc/mean", "response_length/mean")
    rows = [{**r, **{k: lookup(r, k, algo) for k in wanted if lookup(r, k, algo) is not None}} for r in read_jsonl(metrics_path)]
    train = [r for r in rows if f"{algo}/rewards/mean" in r]
    val = [(r["step"], k, v) for r in rows for k, v in r.items() if k.startswith("val/") and k.endswith("acc_mean@1")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [r[f"{algo}/rewards/mean"] for r in train], label="reward (shaped)")
    axes[0].plot(steps, [r.get(f"{algo}/acc/mean", 0) for r in train], label="train acc")
    axes[0].set_title("training reward")
    axes[0].legend()
    axes[1].plot(steps, [r["response_length/mean"] for r in train])
    axes[1].set_title("response length (tokens)")
    for ax in axes[:2]:  # where validation ran: read the training curves against the held-out points
        for s in sorted({s for s, _, _ in val}):
            ax.axvline(s, color="grey", linestyle=":", linewidth=0.8)
    for name in sorted({k for _, k, _ in val}):
        pts = [(s, v) for s, k, v in val if k == name]
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for s, v in pts:
            axes[2].annotate(f"{v:.1%}", (s, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        b = max(pts, key=lambda p: (p[1], -p[0]))
        axes[2].plot([b[0]], [b[1]], marker="*", markersize=14, color="gold", markeredgecolor="black", linestyle="none")
    backs = [r["step"] for r in rows if r.get("training/back_off")]
    if backs:  # checkpoint.back_off / end_with_best put the best weights back here
        axes[2].plot(backs, [min(v for _, _, v in val)] * len(backs), marker="x", color="red", linestyle="none", label="back to best")
    axes[2].set_title("held-out accuracy (star: best)")
    if val:
        axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def step_line(m: dict[str, float], algo: str, step: int) -> str:
    """The console line of a training step."""
    return (
        f"step {step:>4} | reward {m[f'{algo}/rewards/mean']:+.3f} acc {m.get(f'{algo}/acc/mean', 0):.3f} "
        f"| len {m['response_length/mean']:.1f} | kept {m[f'{algo}/kept_groups_ratio']:.2f} "
        f"({m[f'{algo}/num_gen_batches']:.0f} gen) | pg {m['actor/pg_loss']:+.4f} ent {m['actor/entropy']:.3f} "
        f"clip {m['actor/pg_clipfrac']:.3f} | {m['timing/all']:.1f}s {m['e2e_tps']:.0f} tok/s"
    )


def val_line(when: str, m: dict[str, float]) -> str:
    """The console line of a validation: each set's accuracy."""
    accs = [f"{k.split('/')[1]} {v * 100:.1f}%" for k, v in m.items() if k.startswith("val/") and "acc_mean@" in k]
    return f"[bold]held-out accuracy {when}:[/bold] " + ", ".join(accs)



def progress_bar(console: Any, enabled: bool):
    """The training loop's rich progress bar (transient: the step lines stay, the bar goes)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console, disable=not enabled, transient=True,
    )  # fmt: skip


def plot_logged(logging_cfg: Any, algo: str, log) -> None:
    """Plot the run's metrics.jsonl to training.png next to it, when the jsonl sink wrote one."""
    metrics_path = Path(logging_cfg.dir) / "metrics.jsonl"
    if "jsonl" in logging_cfg.sinks and metrics_path.exists():
        png = plot_run(metrics_path, Path(logging_cfg.dir) / "training.png", algo)
        log(f"metrics: {metrics_path}; plot: {png}")
