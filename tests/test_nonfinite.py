"""Non-finite forensics (postrl.nonfinite): a NaN injected into one layer's forward is traced to that layer and row;
the step is skipped and counted; K such steps in a row stop the run with a message naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from postrl.assembly import build_run
from postrl.checks import load_config
from postrl.errors import UserError
from postrl.metrics import Timer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROW = 2  # the row the injected NaN lands in


@pytest.fixture(scope="module")
def run_and_batch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    cfg = load_config(
        "configs/tiny_grpo.yaml",
        tiny_overrides(tmp, "train.use_remove_padding=false", "train.micro_batch_size=16", "train.max_nonfinite_steps=2"),
    )
    run = build_run(cfg, "trainer")
    batch, _ = run.experience.collect(0, Timer())
    adv = torch.arange(batch.size, dtype=torch.float32) / batch.size - 0.5  # non-zero advantages: every row has a gradient
    yield cfg, run, batch, adv
    run.close()


def nan_in_row(module, args, out):
    """A real forward hook: NaN in one row of the layer's output (only where the batch holds that row)."""
    hidden = out[0] if isinstance(out, tuple) else out
    if hidden.shape[0] > ROW:
        hidden = hidden.clone()
        hidden[ROW] = float("nan")
    return (hidden, *out[1:]) if isinstance(out, tuple) else hidden


def test_a_nan_in_one_layer_is_traced_to_that_layer_and_row_and_the_step_is_skipped(run_and_batch):
    cfg, run, batch, adv = run_and_batch
    actor, model = run.actor, run.policy.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = model.model.layers[1].mlp.register_forward_hook(nan_in_row)
    try:
        stats = actor.update(actor.pack(batch, adv))
    finally:
        handle.remove()
    assert stats["actor/nonfinite_steps"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the optimizer step was not skipped"
    lines = [json.loads(line) for line in (Path(run.cfg.logging.dir) / "nonfinite" / "step_1.jsonl").read_text().splitlines()]
    head, mb, rows = lines[0], lines[1], lines[2:]
    assert head["step"] == 1 and head["streak"] == 1 and head["micro_batches"] == 1
    assert mb["first_forward"]["module"] == "model.layers.1.mlp" and mb["first_forward"]["rows"] == [ROW]
    assert mb["first_forward"]["inputs_finite"] is True and mb["first_forward"]["kind"] == "nan"
    assert mb["first_backward"] is not None and mb["params_count"] > 0
    assert [r["row"] for r in rows] == [ROW]
    tok = run.policy.tokenizer
    assert rows[0]["response"] == tok.decode(batch.response_ids[ROW])
    assert rows[0]["prompt"] == tok.decode(batch.prompt_ids[ROW])

    # a finite step resets the streak and trains
    stats = actor.update(actor.pack(batch, adv))
    assert stats["actor/nonfinite_steps"] == 1.0 and actor.nonfinite.streak == 0
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    # train.max_nonfinite_steps (2) such steps in a row stop the run, naming the file and what it saw
    handle = model.model.layers[1].mlp.register_forward_hook(nan_in_row)
    try:
        actor.update(actor.pack(batch, adv))
        with pytest.raises(UserError) as err:
            actor.update(actor.pack(batch, adv))
    finally:
        handle.remove()
    message = str(err.value)
    assert "2 training steps in a row" in message and "nonfinite/step_4.jsonl" in message
    assert actor.nonfinite.total == 3


def test_likely_causes_name_a_zero_length_response_and_a_learning_rate_spike(tmp_path):
    from postrl.nonfinite import NonFiniteWatch

    cfg = load_config("configs/tiny_grpo.yaml", tiny_overrides(tmp_path, "train.lr=1e-5"))
    watch = NonFiniteWatch(cfg, tokenizer=None, log=lambda m: None)
    watch.records = [{"first_forward": {"kind": "inf"}, "largest_finite_activation": {"value": 6e4}, "rows": [{"model_tokens": 0}]}]
    causes = watch.causes(lr=1e-4, prev_lr=1e-5, dtype=torch.float16)
    assert len(causes) == 3
    assert causes[0].startswith("an overflowing dtype") and causes[1].startswith("a zero-length response")
    assert causes[2].startswith("a learning-rate spike")
    watch.records[0]["first_forward"]["kind"] = "nan"  # a NaN and values far from bf16's limit: no overflow
    assert watch.causes(lr=1e-5, prev_lr=1e-5, dtype=torch.bfloat16) == ["a zero-length response (1 row(s) without a sampled token: a per-sequence mean divides by 0)"]
