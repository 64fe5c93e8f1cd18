"""Model-based rewards: a reward model (sequence classification, one logit) scoring prompt + response.

The RM is a plain Hugging Face `AutoModelForSequenceClassification` with `num_labels=1`, the format
of the public reward models (Skywork-Reward, the OpenRLHF / TRL RewardTrainer outputs) and of
`postrl rm`. It is frozen: loaded once in eval mode, scored under `no_grad`, never checkpointed.

Each sample is rendered from text, not from the policy's token ids: the prompt messages of its row
(`data.prompt_key`) plus the response as the assistant turn, through the RM's own tokenizer and chat
template. So an RM with another tokenizer than the policy's is re-tokenised as a matter of course.
Too long a rendering is cut from the left: the end of the response, where the answer is, stays.

A scorer here is anything with `name`, `weight`, `normalize` and `score(responses, ground_truths, rows) ->
ModelScores`; `RewardFunction` adds `weight x (normalised) score` to the rule verifiers' weighted
sum and records the raw score under `name` (rm_score, judge_score) as a per-sample metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from postrl.untrusted import clean_text
from postrl.utils import get_dotted

NORM_EPS = 1e-6


@dataclass
class ModelScores:
    """A scorer's raw score per sample, and named counts to log (e.g. reward/judge_unparsed)."""

    scores: list[float]
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # one line per sample that got no score (it has fail_score)


class ModelScorer(Protocol):
    """What `RewardFunction` needs of a model-based reward."""

    name: str  # per-sample metric of the raw score (rm_score, judge_score)
    weight: float
    normalize: bool
    fail_score: float  # what a sample without a score gets (a non-finite score, an unparsed judgement)
    failure_fix: str  # the Fix: of the error that stops a run whose scorer fails (nearly) always

    def score(self, responses: list[str], ground_truths: list[str], rows: list[dict]) -> ModelScores: ...

    def close(self) -> None: ...


def prompt_messages(row: dict, prompt_key: str) -> list[dict]:
    """The chat messages of a row's prompt (a plain string becomes one user message; none: no messages)."""
    prompt = get_dotted(row, prompt_key)
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def render(tokenizer: Any, messages: list[dict], response: str) -> str:
    """Prompt + response as the model reads a conversation: its chat template, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    return "\n".join([m["content"] for m in messages] + [response])


def encode(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Right-padded ids of `texts`, each cut from the left to `max_length` tokens.

    Right padding: a sequence-classification head reads the last non-pad token of each row.
    """
    ids = [tokenizer(clean_text(t), add_special_tokens=False)["input_ids"][-max_length:] for t in texts]  # a tokenizer raises on lone surrogates
    L = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(ids), L), pad, dtype=torch.long)
    attention = torch.zeros((len(ids), L), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        attention[i, : len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": attention}


def sequence_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """r_B: the logit of each row at its last real token (right-padded rows).

    Read here rather than from the model's own `logits[:, 0]`, which finds the last token by the pad id
    and so misreads a row whose text ends in the pad token (EOS used as pad).
    """
    base = getattr(model, model.base_model_prefix)
    hidden_BTH = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    last_B = batch["attention_mask"].sum(dim=1) - 1
    logits_BT = model.score(hidden_BTH).squeeze(-1)  # one label
    return logits_BT[torch.arange(len(last_B), device=logits_BT.device), last_B].float()


def load_reward_model(path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """(model, tokenizer) of a one-logit sequence-classification model, with a pad token set."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from postrl.errors import UserError

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load a reward model from '{path}' ({exc}). Fix: point reward.reward_model.path at a Hugging Face "
            "sequence-classification model directory (e.g. the output of `postrl rm`) or hub id."
        ) from None
    if model.config.num_labels != 1:
        raise UserError(
            f"reward model '{path}' has {model.config.num_labels} output labels; a reward model has one (its score). "
            "Fix: use a reward model (AutoModelForSequenceClassification with num_labels=1), e.g. one trained by `postrl rm`."
        )
    if not hasattr(model, "score"):
        raise UserError(
            f"reward model '{path}' ({type(model).__name__}) has no `score` head, the layout of the decoder reward "
            "models (Qwen2/Llama/Mistral...ForSequenceClassification). Fix: use a decoder reward model."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval().requires_grad_(False), tokenizer


def normalized(scores: Sequence[float], mean: float, std: float) -> list[float]:
    return [(s - mean) / (std + NORM_EPS) for s in scores]


def global_mean_std(scores: Sequence[float]) -> tuple[float, float]:
    """Mean and std of `scores` over every rank's slice (each rank scores its own prompts)."""
    from postrl import distributed

    n, s, sq = distributed.all_reduce_sum([float(len(scores)), float(sum(scores)), float(sum(x * x for x in scores))])
    if n == 0:
        return 0.0, 1.0
    mean = s / n
    return mean, math.sqrt(max(sq / n - mean * mean, 0.0))


class RewardModel:
    """A frozen reward model scoring responses in micro-batches (`reward.reward_model`)."""

    name = "rm_score"
    fail_score = 0.0
    failure_fix = (
        "load the reward model in float32 or bfloat16 (reward.reward_model.dtype; float16 overflows easily), and check "
        "that its weights are intact"
    )

    def __init__(self, cfg: Any, device: torch.device, prompt_key: str = "prompt", dtype: torch.dtype = torch.float32):
        self.cfg, self.weight, self.normalize = cfg, float(cfg.weight), bool(cfg.normalize)
        self.prompt_key = prompt_key
        self.device = device if cfg.device == "auto" else torch.device(cfg.device)
        self.home = torch.device("cpu") if cfg.offload else self.device
        self.model, self.tokenizer = load_reward_model(cfg.path, dtype)
        self.model.to(self.home)

    def texts(self, responses: list[str], rows: list[dict]) -> list[str]:
        return [render(self.tokenizer, prompt_messages(r, self.prompt_key), c) for c, r in zip(responses, rows)]

    @torch.no_grad()
    def score(self, responses: list[str], ground_truths: list[str], rows: list[dict]) -> ModelScores:
        texts = self.texts(responses, rows)
        out: list[float] = []
        self.model.to(self.device)
        try:
            for lo in range(0, len(texts), self.cfg.micro_batch_size):
                batch = encode(self.tokenizer, texts[lo : lo + self.cfg.micro_batch_size], self.cfg.max_length)
                out += sequence_scores(self.model, {k: v.to(self.device) for k, v in batch.items()}).tolist()
        finally:
            self.model.to(self.home)
        return ModelScores(out)

    def close(self) -> None:
        self.model = None
