"""The memory estimate of check-config (postrl.memory): parameter counts and every part, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from postrl.cli import main
from postrl.memory import (
    QWEN3_MOE,
    QWEN25,
    GiB,
    Shape,
    activation_bytes_per_token_layer,
    estimate,
    find_shape,
    known_shape,
    shape_from_config,
)

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
    # MoE the estimate cannot describe: a shared expert (Qwen2-MoE), dense layers between sparse ones.
    assert shape_from_config({"model_type": "qwen2_moe", "hidden_size": 8, "num_experts": 4, "shared_expert_intermediate_size": 8}) is None
    assert shape_from_config({"model_type": "qwen3_moe", "hidden_size": 8, "num_experts": 4, "mlp_only_layers": [0]}) is None


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


# A tiny Qwen3-MoE: h 16, 2 layers, 4 heads of 8 (q 32), 2 kv heads (k 16), 4 experts of width 8, top-2,
# vocab 20, untied. Attention q 16x32 + k 16x16 + v 16x16 + o 32x16 = 1536, q / k norms 2 x 8 = 16, router
# 16 x 4 = 64, experts 4 x 3 x 16 x 8 = 1536, two norms 32: a block of 3184 (active: 2 experts, 768: 2416).
# Model: embeddings 2 x 20 x 16 = 640, 2 blocks, final norm 16: 7024 (active 5488).
MOE = Shape(hidden=16, layers=2, heads=4, kv_heads=2, intermediate=32, vocab=20, tied=False, qkv_bias=False,
            head_dim=8, qk_norm=True, experts=4, experts_per_token=2, expert_intermediate=8)  # fmt: skip


def test_moe_parameters_total_and_active_by_hand_and_the_published_totals():
    import transformers

    assert (MOE.block_params(), MOE.block_params(active=True)) == (3184, 2416)
    assert (MOE.params(), MOE.params(active=True)) == (7024, 5488)
    # The same shape as transformers builds it (its config names the experts num_local_experts).
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=32,
        moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, vocab_size=20, tie_word_embeddings=False,
    )  # fmt: skip
    assert shape_from_config(cfg.to_dict()) == MOE
    assert transformers.AutoModelForCausalLM.from_config(cfg).num_parameters() == 7024
    # Qwen's model cards: Qwen3-30B-A3B 30.5B total / 3.3B activated, Qwen3-235B-A22B 235B / 22B.
    assert (QWEN3_MOE["30b-a3b"].params(), QWEN3_MOE["30b-a3b"].params(active=True)) == (30_532_122_624, 3_353_032_704)
    assert (QWEN3_MOE["235b-a22b"].params(), QWEN3_MOE["235b-a22b"].params(active=True)) == (235_093_634_560, 22_190_763_520)
    assert known_shape("Qwen/Qwen3-VL-30B-A3B-Instruct") is QWEN3_MOE["30b-a3b"]
    assert known_shape("Qwen/Qwen3-30B-A3B-Instruct-2507") is QWEN3_MOE["30b-a3b"]


def test_moe_activations_and_sequence_parallel_by_hand():
    """MoE per token and layer (b = 2): attention 2h + 3q + 3k = 32 + 96 + 48 = 176; the MLP K (2h + 4 i_e)
    + E = 2 x 64 + 4 = 132; 2 x 308 = 616, + 8h = 128, + the router's fp32 softmax 4E = 16, + Qwen3's q / k
    norm inputs 4 (32 + 16) = 192: 952. Sequence parallel 4 on 400 tokens (160 responses): each rank holds
    100 tokens and 40 responses, the same activations and logits as one rank with a 100-token micro-batch."""
    assert activation_bytes_per_token_layer(MOE, 2) == 952
    common = dict(world=4, strategy="fsdp2", compute_bytes=2, gradient_checkpointing=False, use_ref=False, logprob_chunk_tokens=16)
    sp = estimate(MOE, micro_tokens=400, response_tokens=160, sequence_parallel=4, **common)
    one = estimate(MOE, micro_tokens=100, response_tokens=40, **common)
    assert sp.activations == one.activations == 100 * 2 * 952
    assert sp.logits == one.logits == 2 * 40 * 20 * 2 + 12 * 16 * 20
    assert sp.micro_tokens == 100 and sp.params == 4 * 7024 / 4  # the weights stay sharded over all 4 devices
    # FSDP2 gathers whole blocks, every expert: 2 x 2 x 3184.
    assert sp.compute_weights == 12_736


def _check_config(capsys, recipe: str, *overrides: str) -> str:
    root = Path(__file__).resolve().parents[1]
    assert main(["check-config", str(root / "configs" / recipe), "--no-path-check", "--device-memory", "80", *overrides]) == 0
    return capsys.readouterr().out


def _row(out: str, label: str) -> float:
    """The GiB figure of the estimate's row that starts with `label`."""
    line = next(ln for ln in out.splitlines() if ln.strip().startswith(label))
    return float(line.split()[-2])


def test_check_config_estimates_the_30b_a3b_moe_recipe(capsys):
    """configs/qwen3_vl_30b_a3b_dapo.yaml: P = 30,532,122,624 over 16 devices with FSDP2, bf16, checkpointing on,
    micro-batch 1 x (1024 + 2048) = 3072 tokens, 2048 responses, no KL.
    masters 4 P / 16 = 7,633,030,656 B = 7.11 GiB; optimizer twice that 14.22 GiB; two gathered bf16 blocks
    2 x 2 x 623,120,640 = 2.32 GiB. A (b = 2) = 2 (2h + 3q + 3k + K (2h + 4 i_e) + E) + 8h + 4E + 4 (q + k)
    = 2 (4096 + 12288 + 1536 + 8 x 7168 + 128) + 16384 + 512 + 18432 = 186,112; activations 3072 x 48 x 2 x 2048
    + 3072 x 186,112 = 1,175,715,840 B = 1.09 GiB; logits 2 x 2048 x 151,936 x 2 + 12 x 1024 x 151,936
    = 3,111,649,280 B = 2.90 GiB."""
    out = _check_config(capsys, "qwen3_vl_30b_a3b_dapo.yaml")
    assert "30.53B parameters (3.35B active: 8 of 128 experts per token; every expert sharded by fsdp2)" in out
    assert _row(out, "parameters (fp32 masters)") == round(7_633_030_656 / GiB, 2) == 7.11
    assert _row(out, "optimizer") == 14.22 and _row(out, "compute weights") == round(4 * 623_120_640 / GiB, 2) == 2.32
    assert _row(out, "activations (3,072 tokens") == round(1_175_715_840 / GiB, 2) == 1.09
    assert _row(out, "log-prob logits (2,048") == round(3_111_649_280 / GiB, 2) == 2.90
    assert "fits in 80 GiB" in out
    # On 2 devices the sharded state alone is 16 P / 2 = 227 GiB: the verdict says so, and what to change.
    two = _check_config(capsys, "qwen3_vl_30b_a3b_dapo.yaml", "cluster.devices_per_node=2")
    assert "does NOT fit in 80 GiB" in two and "Fix: more devices" in two


def test_check_config_estimates_the_7b_recipe_at_32k_tokens_with_sequence_parallel_4(capsys):
    """configs/qwen25_7b_dapo_32k.yaml: a micro-batch of 4 x 8192 = 32,768 tokens (30,720 responses) split over 4
    ranks: 8192 tokens and 7680 responses each. A (7B, b = 2) = 2 (5 x 3584 + 3 x 512 + 4 x 18944) + 8 x 3584
    = 219,136; activations 8192 x 28 x 2 x 3584 + 8192 x 219,136 = 3,439,329,280 B = 3.20 GiB; logits
    2 x 7680 x 152,064 x 2 + 12 x 1024 x 152,064 = 6,539,968,512 B = 6.09 GiB. Without sequence parallelism the
    same micro-batch is 4 x 7680 = 30,720 responses on one rank: 4 x 4,671,406,080 + 1,868,562,432 B = 19.14 GiB."""
    out = _check_config(capsys, "qwen25_7b_dapo_32k.yaml")
    assert "Ulysses sequence parallel 4" in out
    assert _row(out, "activations (8,192 tokens / micro-batch / rank)") == round(3_439_329_280 / GiB, 2) == 3.20
    assert _row(out, "log-prob logits (7,680") == round(6_539_968_512 / GiB, 2) == 6.09
    # Qwen2.5-7B's 28 heads do not split over 8 ranks: the estimate says so and lists what does.
    eight = _check_config(capsys, "qwen25_7b_dapo_32k.yaml", "train.sequence_parallel_size=8")
    assert "does not divide its 28 attention heads" in eight and "Fix: choose one of [2, 4]" in eight
    alone = _check_config(capsys, "qwen25_7b_dapo_32k.yaml", "train.sequence_parallel_size=1", "train.max_token_len_per_device=32768")
    assert _row(alone, "log-prob logits (30,720") == round((4 * 4_671_406_080 + 1_868_562_432) / GiB, 2) == 19.14


def test_sequence_parallel_must_divide_the_world_size():
    from postrl.checks import load_config
    from postrl.errors import UserError

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(UserError, match=r"train.sequence_parallel_size \(3\) must divide the world size \(8 devices\)"):
        load_config(str(root / "configs/qwen25_7b_dapo_32k.yaml"), ["train.sequence_parallel_size=3"], check_paths=False)


def test_expert_parallelism_is_the_engines_tensor_parallel_group(capsys):
    from postrl.checks import load_config
    from postrl.errors import UserError

    root = Path(__file__).resolve().parents[1]
    recipe = str(root / "configs/qwen3_vl_30b_a3b_dapo.yaml")
    assert load_config(recipe, [], check_paths=False).rollout.expert_parallel_size == 8
    with pytest.raises(UserError, match=r"rollout.expert_parallel_size \(4\) must equal rollout.tensor_parallel_size \(8\)"):
        load_config(recipe, ["rollout.expert_parallel_size=4"], check_paths=False)
    # The critic does not split sequences: PPO with sequence parallelism is refused before anything starts.
    overrides = ["model.path=builtin:tiny-qwen2", "cluster.devices_per_node=2", "train.sequence_parallel_size=2", "algorithm.adv_estimator=gae"]
    assert main(["train", str(root / "configs/tiny_dapo.yaml"), *overrides]) != 0
    assert "the critic's value passes and update do not split sequences yet" in " ".join(capsys.readouterr().out.split())


def test_check_config_of_ppo_with_kl_in_the_reward_counts_the_critic_and_the_reference(capsys):
    """The 7B recipe as PPO (adv_estimator gae) with algorithm.use_kl_in_reward and no KL loss, on 8 devices
    with FSDP2 (s = 1/8), bf16: the trainer holds the reference (use_kl_in_reward loads it) and the critic
    (assembly.held_models). Qwen2.5-7B: P = 7,615,616,512, untied head V h = 152,064 x 3,584 = 544,997,376.
    reference 2 P / 8 = 1,903,904,128 B = 1.77 GiB; critic P_c = P - V h + h + 1 = 7,070,622,721,
    16 P_c / 8 = 14,141,245,442 B = 13.17 GiB (weights, gradients, AdamW)."""
    ppo = ("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl.coef=0", "cluster.devices_per_node=8")
    out = _check_config(capsys, "qwen25_7b_grpo.yaml", *ppo)
    assert _row(out, "reference model") == round(1_903_904_128 / GiB, 2) == 1.77
    assert _row(out, "critic (PPO value model") == round(14_141_245_442 / GiB, 2) == 13.17
    grpo = _check_config(capsys, "qwen25_7b_grpo.yaml", "algorithm.kl.coef=0", "cluster.devices_per_node=8")
    assert _row(grpo, "reference model") == 0 and "critic (PPO" not in grpo
    assert _row(out, "= update peak") == pytest.approx(_row(grpo, "= update peak") + 1.77 + 13.17, abs=0.02)


def test_check_config_counts_the_reward_model_the_judge_and_the_async_worker_copy(capsys):
    """The 7B recipe on one device, bf16, with what assembly.held_models lists besides: a Qwen2.5-1.5B reward
    model in bf16 (a sequence classifier: P = 1,543,714,304 tied, + h = 1,536 for the score head, no bias),
    2 x 1,543,715,840 = 3,087,431,680 B = 2.88 GiB; a Qwen2.5-0.5B judge in fp32, 4 x 494,032,768 =
    1,976,131,072 B = 1.84 GiB; async's worker copy of the policy in fp32, 4 x 7,615,616,512 =
    30,462,466,048 B = 28.37 GiB. All three are resident, so both peaks grow by their sum, 33.09 GiB."""
    base = ("cluster.devices_per_node=1",)
    held = ("reward.reward_model.path=Qwen/Qwen2.5-1.5B", "reward.reward_model.dtype=bfloat16",
            "reward.judge.path=Qwen/Qwen2.5-0.5B", "rollout.mode=async")  # fmt: skip
    alone = _check_config(capsys, "qwen25_7b_grpo.yaml", *base)
    out = _check_config(capsys, "qwen25_7b_grpo.yaml", *base, *held)
    assert _row(out, "reward model (bfloat16)") == round(3_087_431_680 / GiB, 2) == 2.88
    assert _row(out, "judge (float32)") == round(1_976_131_072 / GiB, 2) == 1.84
    assert _row(out, "async rollout worker's policy copy") == round(30_462_466_048 / GiB, 2) == 28.37
    grown = (3_087_431_680 + 1_976_131_072 + 30_462_466_048) / GiB
    for peak in ("= update peak", "rollout peak"):
        assert _row(out, peak) == pytest.approx(_row(alone, peak) + grown, abs=0.02)
    rows = alone[alone.index("memory per device"):]
    assert "reward model (" not in rows and "judge (" not in rows and "worker" not in rows
    # A reward model on a device of its own, or offloaded to host memory, adds nothing to this device.
    elsewhere = _check_config(capsys, "qwen25_7b_grpo.yaml", *base, held[0], "reward.reward_model.device=cuda:1")
    assert _row(elsewhere, "reward model (on cuda:1: not counted here)") == 0
    assert _row(elsewhere, "= update peak") == _row(alone, "= update peak")


def test_check_config_counts_the_distillation_teacher(capsys):
    """A Qwen2.5-1.5B teacher (P = 1,543,714,304, tied embeddings) beside the 7B recipe on one device, held as
    the KL reference is, in the compute dtype: 2 x 1,543,714,304 = 3,087,428,608 B = 2.88 GiB, resident in both
    phases; with train.ref_offload it waits in host memory and adds nothing here."""
    base = ("cluster.devices_per_node=1",)
    alone = _check_config(capsys, "qwen25_7b_grpo.yaml", *base)
    out = _check_config(capsys, "qwen25_7b_grpo.yaml", *base, "distill.teacher_path=Qwen/Qwen2.5-1.5B")
    assert _row(out, "teacher (bfloat16, frozen)") == round(3_087_428_608 / GiB, 2) == 2.88
    for peak in ("= update peak", "rollout peak"):
        assert _row(out, peak) == pytest.approx(_row(alone, peak) + 3_087_428_608 / GiB, abs=0.02)
    offloaded = _check_config(capsys, "qwen25_7b_grpo.yaml", *base, "distill.teacher_path=Qwen/Qwen2.5-1.5B", "train.ref_offload=true")
    assert _row(offloaded, "teacher (in host memory between passes: not counted here)") == 0
