"""The pieces of the guides' tables: records of a conversion, rules, value translations, what postrl offers instead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


PARALLEL = "FSDP2 shards parameters, gradients and optimizer state over every rank, so model-parallel sizes are unnecessary (train.strategy: fsdp2; rollout.tensor_parallel_size for vLLM)"
FUSED = "a fused kernel switch: postrl runs the Hugging Face model's own modules; model.attn_implementation (auto) picks flash attention where it is installed"
MEGATRON = "a Megatron-LM training switch with no meaning for a Hugging Face model trained with FSDP2 / DDP"
ARCH = "model architecture: postrl reads it from the model's config.json (model.path)"
PLACEMENT = "Ray placement of separate workers: postrl colocates every role (rollout, reference, actor) on each device"
ASCEND = "an Ascend / MindSpeed runtime switch; on Ascend postrl runs the NPU through torch.distributed (train.device: npu)"
GAE = "a critic setting postrl does not map: set its critic section (critic.lr, critic.cliprange_value, critic.warmup_steps, critic.model_path)"
LOGGING = "logging detail; postrl logs its metrics to logging.sinks (logging.metric_names picks the guide's names)"
WRAP = "postrl shards one FSDP2 unit per transformer block (the model's _no_split_modules, as verl's default transformer-layer policy); a size-based wrap policy is not offered"
DATA = "postrl trains on parquet / JSONL in the verl schema: run `postrl preprocess` (e.g. `postrl preprocess math_17k`) and set data.train_files"


@dataclass
class Mapped:
    source: str
    value: Any
    targets: dict[str, Any]
    note: str = ""


@dataclass
class Unmapped:
    source: str
    value: Any
    instead: str


@dataclass
class Conversion:
    dialect: str
    tree: dict = field(default_factory=dict)
    mapped: list[Mapped] = field(default_factory=list)
    unmapped: list[Unmapped] = field(default_factory=list)

    def flat(self) -> dict[str, Any]:
        """The translated postrl keys in order, dotted (a later source key wins, as on a command line)."""
        out: dict[str, Any] = {}
        for m in self.mapped:
            out.update(m.targets)
        return out


# A rule: a postrl key (the value as is), a function value -> {postrl key: value} (or None: not
# mapped, with the rule's note), or `drop(why)`.
Fn = Callable[[Any], "dict[str, Any] | None"]


@dataclass(frozen=True)
class Rule:
    to: str | Fn | None
    note: str = ""


def to(key: str, note: str = "") -> Rule:
    return Rule(key, note)


def via(fn: Fn, note: str = "") -> Rule:
    return Rule(fn, note)


def drop(instead: str) -> Rule:
    return Rule(None, instead)


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def _if_true(key: str, value: Any) -> Fn:
    return lambda v: {key: value} if _bool(v) else {}


def _negate(key: str) -> Fn:
    return lambda v: {key: not _bool(v)}


def _engine(v: Any) -> dict | None:
    return {"rollout.engine": {"vllm": "vllm", "hf": "hf"}[v]} if v in ("vllm", "hf") else None


def _strategy(v: Any) -> dict | None:
    return {"train.strategy": "fsdp2"} if v in ("fsdp", "fsdp2") else None


def _schedule(v: Any) -> dict | None:
    return {"train.lr_schedule": v} if v in ("constant", "cosine") else None


KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _kl(v: Any) -> dict | None:
    return {"algorithm.kl.estimator": KL_TYPES[v]} if v in KL_TYPES else None


def _adv(v: Any) -> dict | None:
    names = {"grpo": "grpo", "group_norm": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
             "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "drgrpo": "drgrpo", "gae": "gae"}  # fmt: skip
    return {"algorithm.adv_estimator": names[v]} if v in names else None


def _save_freq(v: Any) -> dict:
    return {"checkpoint.save_freq": int(v)} if int(v) >= 0 else {"checkpoint.save_freq": -1}


def _test_freq(v: Any) -> dict:
    return {"eval.freq": max(int(v), 0)}


def _sinks(v: Any) -> dict:
    known = ("console", "tensorboard", "wandb", "swanlab")
    return {"logging.sinks": ["console", "jsonl"] + [s for s in _as_list(v) if s in known and s != "console"]}


def _resume_mode(v: Any) -> dict | None:
    return {"checkpoint.resume": {"auto": "auto", "disable": "none"}[v]} if v in ("auto", "disable") else None


# Verifier names of the guides -> postrl's (MindSpeed-RL's rule verifiers; verl's reward managers).
VERIFIERS = {
    "math_17k_acc": "math_17k_acc", "acc_for_dapo": "acc_for_dapo", "base_acc": "base_acc", "format": "format",
    "strict_format": "strict_format", "math_verify_reward": "math_verify", "math_verify": "math_verify",
    "gsm8k": "gsm8k", "geo3k": "geo3k",
}  # fmt: skip


def _filter_metric(v: Any) -> dict:
    # A verifier name (MindSpeed) or verl's acc / score: the accuracy of the first accuracy verifier has
    # the same zero-spread groups as acc_for_dapo's +1/-1 score or math_17k_acc's 1/0.
    return {"algorithm.filter_groups.metric": "acc" if v in VERIFIERS or v in ("acc", "score", "seq_reward", "seq_final_reward") else v}
