"""LoRA adapters (model.lora_rank, src/postrl/lora.py): what trains, the reference, merged weights, checkpoints.

All on the random-init tiny model on CPU. A module-scoped 3-step GRPO run with adapters, a KL term and
a checkpoint after every step serves the checkpoint, export and resume tests. The vLLM weight sync of
merged weights is checked by the sync guard test (tests/test_guards.py, the `lora` case); 2-rank FSDP2
by tests/test_distributed.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixed_batch, masked_logprobs, quiet_console, tiny_cfg, tiny_overrides
from verifiers_for_tests import length_parity

from postrl import checkpoint, distributed, lora
from postrl.checks import load_config
from postrl.config import ModelConfig
from postrl.errors import UserError
from postrl.memory import QWEN25, estimate
from postrl.metrics import read_jsonl
from postrl.models import load_model, load_policy
from postrl.rewards.registry import register
from postrl.trainer import Trainer

register("lora_length_parity", in_process=True)(length_parity)  # no verifier worker processes
LORA = ("reward.verifiers=[lora_length_parity]", "model.lora_rank=4", "model.lora_alpha=8")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _plain(path: str) -> torch.nn.Module:
    return load_model(path, "float32").eval()


def _adapted(path: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model with rank-4 adapters whose lora_B is not zero (a trained-looking adapter)."""
    model = _plain(path)
    lora.apply(model, rank=4, alpha=8, target_modules="all-linear")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 42, 9, 88, 3, 61, 27, 14, 100, 7, 55]])


# ------------------------------------------------------------------------------ the adapted model


def test_merged_weights_load_into_a_plain_model_that_computes_like_the_adapted_one(tiny_model_path):
    model = _adapted(tiny_model_path)
    state = dict(distributed.full_state_dict(model))
    plain = _plain(tiny_model_path)
    assert state.keys() == plain.state_dict().keys() - {"lm_head.weight"} | ({"lm_head.weight"} & state.keys())
    plain.load_state_dict(state, strict=False)
    gap = float((_logits(plain, IDS) - _logits(model, IDS)).abs().max())
    assert gap < 1e-5, gap  # float rounding of (W + s B A) x against W x + s B (A x)
    assert float((_logits(_plain(tiny_model_path), IDS) - _logits(model, IDS)).abs().max()) > 1e-2  # the adapters act
    # by hand, for one projection: W + (alpha / r) B A
    q = model.model.layers[1].self_attn.q_proj
    by_hand = q.base_layer.weight + (8 / 4) * q.lora_B.default.weight @ q.lora_A.default.weight
    assert torch.allclose(state["model.layers.1.self_attn.q_proj.weight"], by_hand, atol=1e-7)
    assert torch.equal(state["model.layers.1.self_attn.q_proj.bias"], q.base_layer.bias)


def test_with_adapters_off_the_model_is_its_base_exactly(tiny_model_path):
    model = _adapted(tiny_model_path)
    base = _logits(_plain(tiny_model_path), IDS)
    with lora.disabled(model) as ref:
        assert torch.equal(_logits(ref, IDS), base)
    assert not torch.equal(_logits(model, IDS), base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the adapters train again after the block


def test_a_lora_policy_trains_fp32_adapters_on_a_frozen_base_in_the_compute_dtype(tiny_model_path):
    cfg = ModelConfig(path=tiny_model_path, dtype="bfloat16", lora_rank=4, lora_alpha=8)
    model = load_policy(cfg, dtype="float32").model  # float32 is the masters' dtype; LoRA's base needs none
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert {p.dtype for p in trained.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    # rank x (in + out) for each of the 7 projections of every layer, as the memory estimate counts them
    c = model.config
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    h, i = c.hidden_size, c.intermediate_size
    per_layer = 4 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert sum(p.numel() for p in trained.values()) == c.num_hidden_layers * per_layer
    assert "trainable parameters" in lora.summary(model)


def test_unknown_target_modules_are_refused_with_the_names_that_exist(tiny_model_path):
    cfg = ModelConfig(path=tiny_model_path, lora_rank=4, target_modules=["qkv"])
    with pytest.raises(UserError, match=r"model.target_modules \['qkv'\].*q_proj"):
        load_policy(cfg)


def test_the_vision_tower_of_a_vlm_gets_no_adapters_while_frozen():
    cfg = ModelConfig(path="builtin:tiny-qwen2.5-vl", lora_rank=4)
    model = load_policy(cfg).model
    adapted = [n for n, p in model.named_parameters() if ".lora_" in n]
    assert adapted and not any("visual" in n for n in adapted)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "visual" in n)


def test_memory_estimate_of_the_7b_recipe_on_one_gpu_fits_with_lora_only():
    shape = QWEN25["7b"]
    adapters = shape.adapter_params(64)
    assert adapters == 28 * 64 * (7 * 3584 + 2 * 3584 + 2 * 512 + 3 * 18944)  # 161.5M
    common = dict(world=1, strategy="fsdp2", compute_bytes=2, gradient_checkpointing=True, micro_tokens=16384,
                  response_tokens=8192, engine="vllm", gpu_memory_utilization=0.6)  # fmt: skip
    full = estimate(shape, use_ref=True, **common)
    adapted = estimate(shape, use_ref=False, adapter_params=adapters, **common)  # the base is the reference
    P = shape.params()
    assert adapted.params == 2 * P + 4 * adapters and adapted.grads == 4 * adapters and adapted.optimizer == 8 * adapters
    assert adapted.reference == 0 and adapted.compute_weights == 2 * adapters
    gib = 80 * (1 << 30)
    assert full.peak > gib >= adapted.peak


# ------------------------------------------------------------------------------ a run with adapters


def _cfg(tmp_path: Path, *extra: str):
    return tiny_cfg(tmp_path, *LORA, *extra)


COMMON = ("algorithm.kl.coef=0.05", "train.lr=2e-2", "train.total_steps=3", "checkpoint.save_freq=1",
          "checkpoint.keep_last=0", "train.deterministic=true")  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    cfg = _cfg(tmp, *COMMON)
    tr = Trainer(cfg, quiet_console())
    base = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    tr.fit()
    return {"trainer": tr, "cfg": cfg, "base": base, "ckpts": Path(cfg.checkpoint.dir), "tmp": tmp}


def _steps(cfg) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(Path(cfg.logging.dir) / "metrics.jsonl") if "timing/all" in r}


def test_only_the_adapters_move_and_the_first_kl_is_exactly_zero(trained):
    tr = trained["trainer"]
    assert tr.ref_model is tr.model  # no copy of the base: the reference is the policy with adapters off
    now = dict(tr.model.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in trained["base"].items())  # the base is frozen
    assert all(float(now[n].detach().abs().max()) > 0 for n in now if ".lora_B." in n)  # lora_B started at 0 and trained
    steps = _steps(trained["cfg"])
    assert steps[1]["actor/kl_loss"] == 0.0  # lora_B = 0: the policy is its base, bit for bit
    assert steps[3]["actor/kl_loss"] > 0
    assert set(tr.actor.params) == {p for n, p in now.items() if ".lora_" in n}  # AdamW holds the adapters only


def _batch(tr: Trainer) -> dict[str, torch.Tensor]:
    return fixed_batch(tr.tokenizer, [e.prompt_ids for e in tr.run.examples[:3]])


def test_the_checkpoint_holds_a_plain_merged_model_and_a_peft_adapter(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from postrl.cli import main

    tr, ck = trained["trainer"], trained["ckpts"] / "iter_0000003"
    assert {p.name for p in (ck / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert checkpoint.describe(ck)["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
    t = _batch(tr)
    want = masked_logprobs(tr.model, t)
    merged = AutoModelForCausalLM.from_pretrained(ck / "model", dtype=torch.float32).eval()  # any HF reader
    assert float((masked_logprobs(merged, t) - want).abs().max()) < 1e-5
    out = tmp_path / "exported"  # export copies the merged model
    assert main(["export", str(trained["ckpts"]), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(masked_logprobs(exported, t), masked_logprobs(merged, t))
    # peft's own loader reads the adapter onto the base model
    peft_model = PeftModel.from_pretrained(_plain(tr.run.policy.path), str(ck / "adapter")).eval()
    assert float((masked_logprobs(peft_model, t) - want).abs().max()) < 1e-5


def test_a_resumed_lora_run_equals_the_uninterrupted_one(trained, tmp_path):
    """Resume at step 2 (model.path's base, the checkpoint's adapters, AdamW state, RNG), train step 3:
    the adapters and every logged number of step 3 equal the uninterrupted run's."""
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    (root / checkpoint.TRACKER).write_text("2\n")
    cfg = _cfg(tmp_path, *COMMON, f"checkpoint.dir={root}")
    tr = Trainer(cfg, quiet_console())
    assert tr.step == 2
    tr.fit()
    a, b = dict(trained["trainer"].model.named_parameters()), dict(tr.model.named_parameters())
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, differ[:5]
    skip = ("timing/", "perf/")
    one, two = _steps(trained["cfg"])[3], _steps(cfg)[3]
    assert {k: v for k, v in one.items() if not k.startswith(skip) and not k.endswith("_tps")} == {
        k: v for k, v in two.items() if not k.startswith(skip) and not k.endswith("_tps")
    }


def test_resuming_with_other_lora_settings_is_refused_and_finetune_takes_the_merged_weights(trained, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    with pytest.raises(UserError, match=r"trained LoRA adapters \(rank 4.*this run trains every weight.*model.lora_rank=4"):
        Trainer(load_config(None, tiny_overrides(tmp_path, *COMMON, f"checkpoint.dir={root}")))
    # finetune: a new run whose frozen base is the checkpoint's merged model, fresh adapters on top
    cfg = _cfg(tmp_path / "ft", *COMMON, f"checkpoint.dir={root}", "checkpoint.finetune=true", "model.lora_rank=2")
    tr = Trainer(cfg, quiet_console())
    try:
        assert tr.step == 0
        t = _batch(tr)
        gap = float((masked_logprobs(tr.model, t) - masked_logprobs(trained["trainer"].model, t)).abs().max())
        assert gap < 1e-5, gap
    finally:
        tr.close()


def test_sft_through_adapters_saves_a_plain_merged_model(tmp_path):
    """`postrl sft` with model.lora_rank: the loss falls while only the adapters train, and sft.output_dir
    holds a plain model (merged) whose log-probs are the adapted model's."""
    from transformers import AutoModelForCausalLM

    from postrl.sft import run_sft

    cfg = load_config(None, [
        "model.path=builtin:tiny-qwen2", "model.lora_rank=8", "model.lora_alpha=16", "sft.steps=30", "sft.warmup_steps=0",
        "sft.lr=1e-2", "sft.batch_size=16", "sft.eval_prompts=0", f"sft.output_dir={tmp_path}", "logging.progress=false",
    ])  # fmt: skip
    losses = []

    def record(module, args, out):  # the model's own loss at each step
        if module.training and getattr(out, "loss", None) is not None:
            losses.append(float(out.loss.detach()))

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        run_sft(cfg, quiet_console())
    finally:
        hook.remove()
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # measured: 5.66 -> 5.17
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert not any("lora" in n for n in saved.state_dict())
    base = _plain(load_policy(cfg.model).path)
    assert float((_logits(saved, IDS) - _logits(base, IDS)).abs().max()) > 1e-2  # the adapters' work is in it
