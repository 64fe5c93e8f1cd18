"""The memory estimate of check-config (postrl.memory): parameter counts and every part, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from postrl.cli import main
from postrl.memory import QWEN25, Shape, activation_bytes_per_token_layer, estimate, find_shape, known_shape, shape_from_config

# h 8, 2 layers, 2 heads of 4, 1 kv head (k = 4), MLP 16, vocab 10, tied embeddings, q/k/v biases.
# One block: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 64 + 32 + 32 + 64 = 192, biases 8 + 4 + 4 = 16,
# MLP 3 x 8 x 16 = 384, two norms 2 x 8 = 16: 608. Model: embedding 10 x 8 = 80 (the head shares
# it), 2 x 608 = 1216, final norm 8: 1304.
SMALL = Shape(hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10, tied=True)


def test_parameter_counts_by_hand_and_the_published_totals():
    assert SMALL.block_params() == 608
    assert SMALL.params() == 1304
    # Hugging Face's counts of the published checkpoints (model.num_parameters()).
    assert QWEN25["0.5b"].params() == 494_032_768
    assert QWEN25["7b"].params() == 7_615_616_512
    assert known_shape("Qwen/Qwen2.5-7B-Instruct") is QWEN25["7b"]
    assert known_shape("Qwen/Qwen2.5-1.5B") is QWEN25["1.5b"]
    assert known_shape("Qwen/Qwen2.5-VL-7B-Instruct") is None  # a vision tower beside the 7B text model


def test_the_shape_of_a_config_json_counts_the_real_model(tiny_model_path):
    import torch  # noqa: F401

    from postrl.models import load_model

    shape, source = find_shape(tiny_model_path)
    assert source.endswith("config.json")
    assert shape.params() == sum(p.numel() for p in load_model(tiny_model_path).parameters())
    assert shape_from_config({"model_type": "qwen3_moe", "hidden_size": 8, "num_experts": 4}) is None


def test_every_part_of_the_estimate_by_hand():
    """SMALL (P = 1304) on 2 devices with FSDP2, bf16 (b = 2), micro-batch of 100 tokens (40 responses).

    parameters 4 P / 2 = 2608; gradients 2608; optimizer 8 P / 2 = 5216; compute weights: two gathered
    bf16 blocks 2 x 2 x 608 = 2432; bf16 reference 2 P / 2 = 1304.
    A = b (5h + 3k + 4i) + 8h = 2 (40 + 12 + 64) + 64 = 296 bytes per token per layer;
    activations 100 tokens x 2 layers x 296 = 59,200; logits in bf16 and their gradient 2 x 40 x 10 x 2
    = 1,600, plus three fp32 chunks of 16 tokens: 12 x 16 x 10 = 1,920; 3,520 in all.
    update = 2608 + 2608 + 5216 + 2432 + 1304 + 59200 + 3520 = 76,888.
    HF rollout: KV cache 2 L k b = 2 x 2 x 4 x 2 = 32 bytes per token x 3 sequences x 50 tokens = 4,800,
    plus the compute weights 2432; rollout = 2608 + 5216 + 1304 + 2432 + 4800 = 16,360.
    """
    common = dict(world=2, strategy="fsdp2", compute_bytes=2, micro_tokens=100, response_tokens=40, use_ref=True, logprob_chunk_tokens=16)
    est = estimate(SMALL, gradient_checkpointing=False, engine="hf", rollout_sequences=3, sequence_len=50, **common)
    assert activation_bytes_per_token_layer(SMALL, 2) == 296
    assert (est.params, est.grads, est.optimizer, est.compute_weights, est.reference) == (2608, 2608, 5216, 2432, 1304)
    assert (est.activations, est.logits) == (59_200, 3_520)
    assert est.update == 76_888 and est.rollout == 16_360 and est.peak == 76_888
    # A chunk larger than the micro-batch's responses is the responses: 1,600 + 12 x 40 x 10 = 6,400.
    assert estimate(SMALL, gradient_checkpointing=False, **{**common, "logprob_chunk_tokens": 1024}).logits == 6_400
    # Checkpointing keeps each layer's bf16 input (100 x 2 x 2 x 8 = 3,200) plus one layer (100 x 296).
    ckpt = estimate(SMALL, gradient_checkpointing=True, **common)
    assert ckpt.activations == 3_200 + 29_600
    # One device: autocast keeps bf16 copies of every weight (2 P = 2608) and an fp32 residual stream
    # (100 x 2 x 4 x 8 = 6,400); nothing is sharded. vLLM takes its share of the device for rollout.
    one = estimate(SMALL, gradient_checkpointing=True, **{**common, "world": 1}, engine="vllm", gpu_memory_utilization=0.5, device_bytes=1000)
    assert (one.params, one.optimizer, one.compute_weights, one.reference) == (5216, 10432, 2608, 2608)
    assert one.activations == 6_400 + 29_600
    assert one.rollout == 5216 + 10432 + 2608 + 500
    # DDP replicates; fp32 needs no compute copies; no KL (or an offloaded reference) costs nothing.
    ddp = estimate(SMALL, gradient_checkpointing=False, **{**common, "strategy": "ddp", "compute_bytes": 4, "use_ref": False})
    assert (ddp.params, ddp.compute_weights, ddp.reference) == (5216, 0, 0)
    assert estimate(SMALL, gradient_checkpointing=False, ref_offload=True, **common).reference == 0


@pytest.mark.parametrize("devices, verdict", [(8, "fits in 80 GiB"), (1, "does NOT fit in 80 GiB")])
def test_check_config_reports_the_memory_of_the_7b_recipe(capsys, devices, verdict):
    """configs/qwen25_7b_grpo.yaml validates without the model or data on disk and says whether it fits."""
    root = Path(__file__).resolve().parents[1]
    code = main(["check-config", str(root / "configs/qwen25_7b_grpo.yaml"), "--no-path-check", "--device-memory", "80",
                 f"cluster.devices_per_node={devices}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "7.62B parameters" in out and "optimizer (AdamW: 2 fp32 moments)" in out and verdict in out


def test_without_a_gpu_the_verdict_says_which_size_it_assumed(capsys):
    """On a machine without CUDA the fit verdict is for 80 GiB GPUs, and says so; --device-memory is
    the user's own figure and needs no such note."""
    import torch

    root = Path(__file__).resolve().parents[1]
    recipe = ["check-config", str(root / "configs/qwen25_7b_grpo.yaml"), "--no-path-check"]
    assert main(recipe) == 0
    default = capsys.readouterr().out
    assert main([*recipe, "--device-memory", "80"]) == 0
    given = capsys.readouterr().out
    assert "no GPU on this machine: 80 GiB GPUs assumed" in default or torch.cuda.is_available()
    assert "assumed" not in given and "fits in 80 GiB" in given


def test_a_local_config_json_wins_over_the_table(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": True}  # fmt: skip
    d = tmp_path / "Qwen2.5-7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    shape, _ = find_shape(str(d))
    assert shape == SMALL
