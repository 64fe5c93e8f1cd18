"""Token helpers that the core (experience.py, evaluate.py) and the agent wrappers (agents/) share: what the
policy wrote in a completion, the ids that end a turn, and a generate call that hands an agent engine its
prompts' dataset rows. They stand below agents/ so the core imports nothing from it.
"""

from __future__ import annotations

from typing import Any

from postrl.rollout.base import Completion, SamplingParams, eos_token_ids
from postrl.toolcall import call_end_id


def end_ids(model: Any, tokenizer: Any) -> tuple[set[int], int | None]:
    """The EOS ids that end a completion (the model's and the tokenizer's; the tokenizer's alone without a model)
    and the one-token `</tool_call>` id or None (toolcall.call_end_id): the agent loop and the endpoint stop on them."""
    eos = set(eos_token_ids(model, tokenizer)) if model is not None else {tokenizer.eos_token_id}
    return eos, call_end_id(tokenizer)


def model_text(tokenizer: Any, completion: Completion) -> str:
    """What the policy wrote in a completion (its tokens only, special tokens skipped): what verifiers read."""
    mask = completion.loss_mask
    ids = completion.token_ids if mask is None else [i for i, m in zip(completion.token_ids, mask) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


def model_tokens(completion: Completion) -> int:
    """The number of tokens the policy sampled in a completion."""
    return len(completion.token_ids) if completion.loss_mask is None else sum(completion.loss_mask)


def generate_for(engine: Any, examples: list, params: SamplingParams, agent: bool = False) -> list[Completion]:
    """`engine.generate` on prompt examples (data/dataset.py's PromptExample); with `agent`
    (rollout.takes_rows: the engine is an AgentLoop or the endpoint's AgentGateway) it also gets their dataset rows, from which
    environments reset."""
    prompts = [e.prompt_ids for e in examples]
    mm = [e.multi_modal for e in examples] if any(e.multi_modal for e in examples) else None  # images, for VLMs
    if agent:
        return engine.generate(prompts, params, multi_modal=mm, rows=[e.row for e in examples])
    return engine.generate(prompts, params, multi_modal=mm)
