"""Precision and memory on CPU: bf16 compute with fp32 master weights, gradient checkpointing.

CPU autocast runs bf16 matmuls like a GPU does (to bf16 rounding), so the numerics of `model.dtype:
bfloat16` are checked here; tests/test_gpu.py repeats the end-to-end checks on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_overrides

from postrl.checks import load_config
from postrl.runtime import init_runtime

# The tests wrap optimizer.step to read the gradients; the LR scheduler notices and says so.
pytestmark = pytest.mark.filterwarnings("ignore:.*optimizer.step.*:UserWarning")


def test_autocast_is_off_in_float32_and_on_for_bfloat16():
    fp32, bf16 = init_runtime("cpu", "float32"), init_runtime("cpu", "bfloat16")
    assert not fp32.amp and bf16.amp
    x = torch.randn(4, 4)
    with fp32.autocast():
        assert (x @ x).dtype == torch.float32  # the default path: no autocast at all
    with bf16.autocast():
        assert (x @ x).dtype == torch.bfloat16  # compute in bf16 (log-probs: models.response_logprobs casts to fp32)


def _first_update(tmp_path, dtype: str, batch=None, *extra: str):
    """One trainer; its first update on `batch` (collected here when None). Returns what the tests compare."""
    from postrl.trainer import Trainer

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path / dtype, "reward.verifiers=[verifiers_for_tests:vowel_share]", f"model.dtype={dtype}",
            "algorithm.kl.coef=0.01", "train.total_steps=1", *extra,
        ),
    )  # fmt: skip
    tr = Trainer(cfg)
    if batch is None:
        batch, _ = tr.experience.collect(tr.step, tr.timer)
    packed = tr.actor.pack(batch, tr.experience.advantages(batch))
    logp = tr.actor.compute_logprobs(tr.model, packed)
    packed.tensors["ref_logp"] = tr.actor.compute_logprobs(tr.ref_model, packed)
    grads: list[torch.Tensor] = []
    step = tr.actor.optimizer.step

    def capture_then_step():
        grads.extend(p.grad.detach().clone() for p in tr.actor.params)
        step()

    tr.actor.optimizer.step = capture_then_step
    stats = tr.actor.update(packed, use_ref=True)
    tr.close()
    return tr, batch, packed.tensors["response_mask"].bool(), logp, stats, grads


def test_bfloat16_keeps_fp32_masters_and_its_first_step_matches_fp32(tmp_path):
    """The same batch through a float32 and a bfloat16 trainer from the same weights.

    Tolerances: bf16 keeps 8 significant bits, a relative rounding of u = 2^-8 = 3.9e-3 per value.
    The tiny model's logits are O(1), so a token's log-prob moves by a few u at most: 2e-2 (5 u).
    The gradient norm sums thousands of products whose rounding errors average out: 1% (2.5 u); so
    does the entropy, a mean over the vocabulary and the tokens: 0.1%. Measured: max log-prob gap
    5e-3, gradient norms 2e-4 apart, entropies 5e-7 apart.
    """
    tr32, batch, mask, logp32, s32, g32 = _first_update(tmp_path, "float32")
    tr16, _, _, logp16, s16, g16 = _first_update(tmp_path, "bfloat16", batch)
    assert logp16.dtype == torch.float32  # log-probs, ratios and losses are fp32 under bf16 compute
    assert float((logp32 - logp16)[mask].abs().max()) < 2e-2
    assert 0 < float((logp32 - logp16)[mask].abs().max())  # bf16 really ran
    assert s16["actor/grad_norm"] == pytest.approx(s32["actor/grad_norm"], rel=1e-2)
    assert s16["actor/entropy"] == pytest.approx(s32["actor/entropy"], rel=1e-3)
    assert s16["actor/pg_loss"] == pytest.approx(s32["actor/pg_loss"], abs=1e-6)  # ratio 1: -mean(A) either way
    # Masters, their gradients and AdamW's moments stay fp32; the frozen reference holds bf16 weights.
    assert {p.dtype for p in tr16.model.parameters()} == {torch.float32}
    assert {g.dtype for g in g16} == {torch.float32} and len(g16) == len(g32)
    moments = [v for state in tr16.actor.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    assert {p.dtype for p in tr16.ref_model.parameters()} == {torch.bfloat16}
    assert s16["actor/kl_loss"] < 1e-4  # the bf16 reference vs the autocast policy: a rounding-sized KL
    assert s32["actor/kl_loss"] == 0.0  # float32: the reference is an exact copy


def test_float16_scales_the_loss_so_small_gradients_survive(tmp_path, monkeypatch):
    """model.dtype float16: fp16's 5-bit exponent flushes gradient values below 6e-8 and rounds those
    below 6e-5 coarsely, so the loss is scaled (2^16) before backward and the gradients unscaled before
    clipping (torch's GradScaler). The same batch as fp32: with the scaler, every gradient tensor
    within 1% of fp32 (measured: 2.4e-3 at worst); the same update with the scaler off is several
    times further off (measured: 3.2e-2), which is what the scaler is for."""
    import postrl.actor

    _, batch, mask, logp32, s32, g32 = _first_update(tmp_path, "float32")
    _, _, _, logp16, s16, g16 = _first_update(tmp_path, "float16", batch)
    assert s16["actor/loss_scale"] == 2.0**16 and "actor/loss_scale" not in s32
    assert float((logp32 - logp16)[mask].abs().max()) < 1e-2  # fp16 keeps 11 significant bits
    assert s16["actor/grad_norm"] == pytest.approx(s32["actor/grad_norm"], rel=1e-3)

    def worst(grads):
        return max(float((g - ref).norm() / ref.norm()) for g, ref in zip(grads, g32) if ref.norm() > 0)

    no_scaler = lambda model, dtype, device: torch.amp.GradScaler(device.type, enabled=False)  # noqa: E731
    monkeypatch.setattr(postrl.actor.distributed, "grad_scaler", no_scaler)
    *_, g16_unscaled = _first_update(tmp_path / "unscaled", "float16", batch)
    assert worst(g16) < 1e-2 and worst(g16_unscaled) > 5 * worst(g16), (worst(g16), worst(g16_unscaled))


def test_a_float16_overflow_skips_the_step_halves_the_scale_and_resumes_with_it(tmp_path):
    """A loss scale so large that the scaled gradients overflow fp16: the optimizer step is skipped
    (the weights stay as they were), the scale halves, no warning is printed (this is the scaler's
    normal back-off), and the scale travels with the optimizer state into a resumed actor."""
    from postrl.trainer import Trainer

    cfg = load_config(None, tiny_overrides(tmp_path, "reward.verifiers=[verifiers_for_tests:vowel_share]", "model.dtype=float16"))
    tr = Trainer(cfg)
    said = []
    tr.actor.log = said.append
    tr.actor.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    batch, _ = tr.experience.collect(tr.step, tr.timer)
    before = [p.detach().clone() for p in tr.actor.params]
    stats = tr.actor.update(tr.actor.pack(batch, tr.experience.advantages(batch)))
    tr.close()
    assert stats["actor/loss_scale"] == 2.0**39 and not torch.isfinite(torch.tensor(stats["actor/grad_norm"]))
    assert all(torch.equal(a, p) for a, p in zip(before, tr.actor.params)) and said == []
    again = Trainer(load_config(None, tiny_overrides(tmp_path / "again", "model.dtype=float16")))
    again.close()
    assert again.actor.scaler.get_scale() == 2.0**16
    again.actor.load_state_dict(tr.actor.state_dict())
    assert again.actor.scaler.get_scale() == 2.0**39


def test_the_bfloat16_reference_rotates_positions_like_the_policy(tmp_path):
    """The frozen reference holds bf16 weights, but RoPE's inverse frequencies stay fp32, as
    from_pretrained(dtype=bf16) keeps them: rounded to bf16 (relative error up to 2^-9), position p
    would turn by up to p / 512 radians too far or too little, and past a few hundred tokens the KL
    would be taken against a reference that reads every token at the wrong place."""
    from postrl.trainer import Trainer

    tr = Trainer(load_config(None, tiny_overrides(tmp_path, "model.dtype=bfloat16", "algorithm.kl.coef=0.01")))
    tr.close()
    assert {p.dtype for p in tr.ref_model.parameters()} == {torch.bfloat16}
    x = torch.zeros(1, 1, dtype=torch.bfloat16)  # rotary_emb reads only its dtype and device
    positions = torch.arange(4096)[None]

    def angles(model):
        cos, sin = model.model.rotary_emb(x, positions)
        return cos.float(), sin.float()

    (cos_ref, sin_ref), (cos_pol, sin_pol) = angles(tr.ref_model), angles(tr.model)
    assert torch.equal(cos_ref, cos_pol) and torch.equal(sin_ref, sin_pol)
    # What the whole-model cast would have done (the frequencies as bf16): the late positions point elsewhere.
    rounded = copy.deepcopy(tr.ref_model).to(torch.bfloat16)
    assert rounded.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    cos_bad, _ = angles(rounded)
    assert float((cos_bad - cos_pol)[0, :64].abs().max()) < 0.05  # near the start, close
    assert float((cos_bad - cos_pol)[0, -512:].abs().max()) > 0.5  # at 4k tokens, other angles


def test_gradient_checkpointing_gives_the_same_gradient(tmp_path):
    """model.gradient_checkpointing recomputes each decoder layer in backward (its MLP's forward runs
    twice) and changes no number: the same batch gives the same gradients to 1e-6 (fp32)."""
    calls = []

    def run(batch, *extra):
        from postrl.trainer import Trainer

        cfg = load_config(None, tiny_overrides(tmp_path / str(len(calls)), "reward.verifiers=[verifiers_for_tests:vowel_share]",
                                               "train.total_steps=1", *extra))  # fmt: skip
        tr = Trainer(cfg)
        if batch is None:
            batch, _ = tr.experience.collect(tr.step, tr.timer)
        packed = tr.actor.pack(batch, tr.experience.advantages(batch))
        mlp = tr.model.model.layers[0].mlp  # counted by its forward: checkpoint's recompute runs no module hooks
        count, forward = [0], mlp.forward

        def counting(*args, **kwargs):
            count[0] += 1
            return forward(*args, **kwargs)

        mlp.forward = counting
        grads = []
        tr.actor.optimizer.step = lambda: grads.extend(p.grad.detach().clone() for p in tr.actor.params)
        tr.actor.update(packed)
        tr.close()
        calls.append(count[0])
        return batch, grads

    batch, plain = run(None)
    _, ckpt = run(batch, "model.gradient_checkpointing=true")
    assert calls[1] == 2 * calls[0]  # checkpointing really ran: every layer forward recomputed once
    assert len(plain) == len(ckpt) > 10
    worst = max(float((a - b).abs().max()) for a, b in zip(plain, ckpt))
    assert worst <= 1e-6, worst
