"""The update against TRL's: the same batch through TRL's GRPOTrainer loss code (DAPO token-mean,
clip 0.2 / 0.28, no KL) and through postrl's actor gives the same loss value and the same gradient.
Runs where TRL is installed (the `bench` extra); skipped otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import quiet_console, tiny_overrides

from postrl.checks import load_config
from postrl.batch import Batch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_dapo_loss_and_gradient_equal_trls_on_one_batch(tmp_path, temperature):
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(
        tmp_path, "algorithm.name=dapo", "algorithm.overlong_buffer.enable=false", "algorithm.filter_groups.enable=false",
        f"rollout.temperature={temperature}", "reward.verifiers=[verifiers_for_tests:length_parity]", "train.micro_batch_size=64", "train.grad_clip=1e9",  # gradients compared unclipped
    ))  # fmt: skip
    tr = Trainer(cfg, quiet_console())
    tr.close()
    g = torch.Generator().manual_seed(0)
    B, P, T = 8, 6, 7  # equal prompt lengths: TRL derives positions from the padded layout, postrl from the mask
    prompts = torch.randint(3, 200, (B, P), generator=g)
    lengths = [7, 3, 5, 7, 2, 6, 4, 7]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    adv_B = torch.tensor([1.2, -0.7, 0.3, -1.1, 0.9, -0.2, 0.5, -0.9])
    trl_model = copy.deepcopy(tr.model)

    batch = Batch(
        prompt_ids=prompts.tolist(), response_ids=responses, loss_masks=[[1] * n for n in lengths], turns=[1] * B,
        finished=[True] * B, scores=[0.0] * B, rewards=[0.0] * B,
        verifier_metrics=[{}] * B, engine_logprobs=[None] * B, multi_modal=[None] * B,
    )  # fmt: skip
    stats = tr.actor.update(tr.actor.pack(batch, adv_B))
    ours = {n: p.grad.clone() for n, p in tr.model.named_parameters()}

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=B, num_generations=4,
        max_completion_length=T, temperature=temperature, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0,
        report_to=[], logging_steps=1,
    )  # fmt: skip
    data = datasets.Dataset.from_list([{"prompt": "x"}] * B)
    trainer = trl.GRPOTrainer(model=trl_model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=data, processing_class=tr.tokenizer)  # fmt: skip
    completion_ids = torch.full((B, T), tr.tokenizer.pad_token_id)
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(responses):
        completion_ids[i, : len(r)] = torch.tensor(r)
        completion_mask[i, : len(r)] = 1
    inputs = {
        "prompt_ids": prompts, "prompt_mask": torch.ones(B, P, dtype=torch.long), "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": adv_B, "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": None,
    }  # fmt: skip
    trl_model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop; one accumulation window here
    loss = trainer._compute_loss(trl_model, inputs)
    loss.backward()
    assert stats["actor/pg_loss"] == pytest.approx(float(loss), abs=1e-6)
    worst = max(float((p.grad - ours[n]).abs().max()) for n, p in trl_model.named_parameters())
    assert worst <= 1e-6, worst
