"""The pieces of the guides' tables: records of a conversion, rules, value translations, what postrl offers instead."""

from __future__ import annotations

import re
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
TOOLS = "postrl names the tools in rollout.multi_turn.tools ('builtin:python', 'builtin:calculator' or package.module:function, schema from its hints; docs/agents.md)"
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
    notes: list[str] = field(default_factory=list)  # read, nothing to convert, said so (the shell's variables, ...)
    refused: list[str] = field(default_factory=list)  # values that cannot be read as the file means, with their line
    lines: dict[str, int] = field(default_factory=dict)  # source key -> its line in the file
    rest: list[str] = field(default_factory=list)  # command-line overrides not in the file's dialect (postrl keys)

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
    strict: bool = False  # a value the rule cannot translate is refused (it decides what is trained), not listed


def to(key: str, note: str = "") -> Rule:
    return Rule(key, note)


def via(fn: Fn, note: str = "", strict: bool = False) -> Rule:
    return Rule(fn, note, strict)


def drop(instead: str) -> Rule:
    return Rule(None, instead)


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


class BadValue(ValueError):
    """A value that is not what its key takes (a boolean written with extra text, ...)."""


def _bool(v: Any) -> bool:
    """A boolean as YAML and Hydra write it; anything else is a BadValue, never a silent False."""
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise BadValue(f"{v!r} is not a boolean (true / false)")


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
             "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "reinforce_plus_plus_seq": "reinforce_plus_plus_seq",
             "drgrpo": "drgrpo", "gae": "gae"}  # fmt: skip
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
    "gsm8k": "gsm8k", "geo3k": "geo3k", "verl_default": "verl_default",
}  # fmt: skip


def _filter_metric(v: Any) -> dict:
    """A verifier name (MindSpeed's filter_groups_metric, or its logged <algo>/<verifier>_rewards/mean) is that
    verifier's score; verl's acc / score / seq_reward / seq_final_reward are postrl's acc / score / seq_reward."""
    m = re.fullmatch(r"[A-Za-z_]+/(?P<verifier>.+)_rewards/mean", str(v))
    name = m["verifier"] if m else str(v)
    if name in VERIFIERS:
        return {"algorithm.filter_groups.metric": VERIFIERS[name]}
    return {"algorithm.filter_groups.metric": {"seq_final_reward": "seq_reward"}.get(name, name)}


# verl's reward managers. naive and dapo score each row by its data_source (verl's default_compute_score):
# postrl's `verl_default` verifier does the same (DAPO-17k's math_dapo rows get DAPO's +1/-1 rule, geo3k's
# rows the geo3k rule, ...); dapo adds the overlong buffer (reward_model.overlong_buffer.*).
REWARD_MANAGER = "naive / dapo: scored by data_source as verl does (postrl's verl_default verifier); prime, batch and custom managers are not offered"


def _reward_manager(v: Any) -> dict | None:
    return {"reward.verifiers": [{"name": "verl_default", "weight": 1.0}]} if v in ("naive", "dapo") else None


def _devices(v: Any) -> dict:
    """A device count in the cluster's shape: whole nodes of 8 above 8 devices, else one node."""
    n = int(v)
    if n > 8 and n % 8 == 0:
        return {"cluster.nnodes": n // 8, "cluster.devices_per_node": 8}
    return {"cluster.nnodes": 1, "cluster.devices_per_node": n}
