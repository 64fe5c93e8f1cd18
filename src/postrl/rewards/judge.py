"""An LLM judge (generative reward model): a second causal LM reads each response and writes a score.

`reward.judge` names the model, a prompt template ({prompt}, {response}, {ground_truth}) sent as a user
message through the judge's chat template, and `score_pattern`, a regex whose one group is the score.
The judge decodes greedily through a rollout engine built like the policy's (`postrl.rollout.build.build_engine`:
HF, or vLLM; the run's trust_remote_code, runtime and seed; never the agent loop) and is frozen. A judgement the pattern does not match, or whose group is not a finite number, scores
`fail_score` and is counted (reward/judge_unparsed): a judge that never answers in the expected form
would otherwise hand the policy a constant reward without anyone noticing; when (nearly) every judgement
of a batch is unparsed, the run stops, by the verifiers' rule (RewardFunction). The response is the
policy's text, read in at most the policy's token budget (`fit_response`), so a response that the
judge's tokenizer splits finer never makes a prompt longer than the judge's engine holds.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch

from postrl.rewards.reward_model import ModelScores, prompt_messages
from postrl.untrusted import clean_text

log = logging.getLogger("postrl.rewards")

UNPARSED_METRIC = "reward/judge_unparsed"


def parse_score(judgement: str, pattern: re.Pattern) -> float | None:
    """The number in the pattern's group at its first match, or None (no match, or not a finite number)."""
    m = pattern.search(judgement)
    if m is None or m.group(1) is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def fit_response(tokenizer: Any, response: str, max_tokens: int | None) -> str:
    """The policy's response as the judge reads it: lone surrogates replaced, cut from the left to `max_tokens`
    of the judge's tokens (the end, where the answer is, stays); None: as it is."""
    response = clean_text(response)
    if max_tokens is None:
        return response
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return response
    keep = max_tokens
    while keep > 0:  # a cut inside a character re-tokenises longer (U+FFFD): keep fewer, by the excess
        text = tokenizer.decode(ids[-keep:])
        excess = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - max_tokens
        if excess <= 0:
            return text
        keep -= excess
    return ""


def fill_template(template: str, messages: list[dict], response: str, ground_truth: str) -> str:
    prompt = "\n".join(m["content"] for m in messages)
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth)


class Judge:
    """Scores responses with a second model's greedy judgement (`reward.judge`)."""

    name = "judge_score"
    normalize = False

    def __init__(self, cfg: Any, device: torch.device, prompt_key: str = "prompt", run_cfg: Any = None,
                 runtime: Any = None):  # fmt: skip
        """`run_cfg`: the run's config (postrl.config.Config), whose rollout settings with `reward.judge.engine`
        build the judge's engine (`build_engine`), on `runtime`; None: the HF engine, no autocast."""
        from postrl.models import Policy, load_model, load_tokenizer, resolve_model_path
        from postrl.modality import TEXT
        from postrl.rollout.build import build_engine

        self.cfg, self.weight, self.prompt_key = cfg, float(cfg.weight), prompt_key
        self.fail_score = float(cfg.fail_score)
        self.failure_fix = (
            f"make reward.judge.score_pattern ({cfg.score_pattern!r}) match what the judge writes (see the example), "
            "say the expected form in reward.judge.prompt_template, or use a judge that follows instructions"
        )
        self.pattern = re.compile(cfg.score_pattern)
        path = resolve_model_path(cfg.path)
        self.tokenizer = load_tokenizer(path, key="reward.judge.path")
        model = load_model(path, key="reward.judge.path").to(device).eval().requires_grad_(False)
        if run_cfg is None:
            from postrl.rollout.hf import HFEngine

            self.engine = HFEngine(model, self.tokenizer)
        else:
            ro = run_cfg.rollout
            rollout = ro.model_copy(update={"engine": cfg.engine, "multi_turn": ro.multi_turn.model_copy(update={"enable": False})})
            self.engine = build_engine(
                run_cfg, Policy(model, self.tokenizer, path, TEXT), runtime, log.info, rollout=rollout,
                max_tokens=self.max_tokens(ro.max_tokens),
            )  # fmt: skip
        # The policy's response is read in at most the tokens of the policy's own budget (another tokenizer can
        # need more for the same text): the judge's prompt then always fits the length its engine was built for.
        self.response_tokens = None if run_cfg is None else run_cfg.rollout.max_tokens
        self.unparsed_total = 0
        self._warned = False

    def max_tokens(self, response_tokens: int) -> int:
        """What the judge's engine holds beyond data.max_prompt_length: the policy's response, the template and
        chat-template tokens around them, and the judgement."""
        around = len(self.prompt_ids("", "", {}))
        return response_tokens + around + self.cfg.max_tokens

    def prompt_ids(self, response: str, ground_truth: str, row: dict) -> list[int]:
        text = fill_template(self.cfg.prompt_template, prompt_messages(row, self.prompt_key), response, ground_truth)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def judgements(self, responses: list[str], ground_truths: list[str], rows: list[dict]) -> list[str]:
        from postrl.rollout import SamplingParams

        fitted = [fit_response(self.tokenizer, c, self.response_tokens) for c in responses]
        prompts = [self.prompt_ids(c, g, r) for c, g, r in zip(fitted, ground_truths, rows)]
        completions = self.engine.generate(prompts, SamplingParams(max_tokens=self.cfg.max_tokens, n=1, greedy=True))
        by_prompt = sorted(completions, key=lambda c: c.prompt_index)
        return self.tokenizer.batch_decode([c.token_ids for c in by_prompt], skip_special_tokens=True)

    def score(self, responses: list[str], ground_truths: list[str], rows: list[dict]) -> ModelScores:
        judgements = self.judgements(responses, ground_truths, rows)
        parsed = [parse_score(j, self.pattern) for j in judgements]
        unparsed = sum(p is None for p in parsed)
        if unparsed and not self._warned:
            self._warned = True
            example = next(j for j, p in zip(judgements, parsed) if p is None)
            log.warning(
                "reward: the judge's answer %r does not match reward.judge.score_pattern %r; it scores the fail "
                "score (%g), counted in %s from now on.", example[:200], self.cfg.score_pattern, self.cfg.fail_score,
                UNPARSED_METRIC,
            )  # fmt: skip
        self.unparsed_total += unparsed
        scores = [self.cfg.fail_score if p is None else p for p in parsed]
        failures = [f"judgement {j[:200]!r} does not match the score pattern" for j, p in zip(judgements, parsed) if p is None]
        return ModelScores(scores, {UNPARSED_METRIC: unparsed}, failures)

    def close(self) -> None:
        self.engine.close()
