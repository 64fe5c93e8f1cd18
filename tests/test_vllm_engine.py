"""The vLLM rollout engine (src/postrl/rollout/vllm.py) on the tiny Qwen2, CPU fp32.

One engine is shared by the module (vLLM start-up is the slow part). The fixture builds it from the
initial model, then takes one real optimizer step on the HF model and syncs it, so every test runs
on weights that exist only in memory; the first test checks that the sync is what made them match.
Skipped only when vLLM cannot be imported here.
"""

from __future__ import annotations

import pytest
import torch

import postrl.rollout.vllm as vllm_mod  # imports without vLLM; vLLM itself is imported below
import postrl.rollout.vllm_platform as vllm_platform
from postrl.config import RolloutConfig
from postrl.rollout.base import SamplingParams
from postrl.runtime import ACCELERATORS

try:
    vllm_platform.import_vllm()
except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - only on machines without a working vLLM
    pytest.skip(f"vLLM is unavailable here: {exc}", allow_module_level=True)

from postrl.models import build_sequences, load_model, load_tokenizer, response_logprobs  # noqa: E402
from postrl.rollout.hf import HFEngine  # noqa: E402

LOGPROB_ATOL = 1e-4  # fp32 on both sides; measured ~1e-6


def _prompts(tokenizer, k: int) -> list[list[int]]:
    out = []
    for a in range(k):
        msgs = [{"role": "user", "content": f"Tom has {a + 3} apples and buys {2 * a + 1} more. How many now?"}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _trainer_logprobs(model, prompts, completions, pad_id: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = build_sequences([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions], pad_id)
    with torch.no_grad():
        logp_BT, _ = response_logprobs(
            model, seqs["input_ids"], seqs["attention_mask"], seqs["position_ids"], seqs["response_mask"].shape[1], temperature
        )
    return logp_BT, seqs["response_mask"].bool()


def _engine_logprobs(completions, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, c in enumerate(completions):
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        out[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
    return out


@pytest.fixture(scope="module")
def setup(tiny_model_path):
    model = load_model(tiny_model_path)
    tokenizer = load_tokenizer(tiny_model_path)
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    engine = vllm_mod.VLLMEngine(model, tokenizer, RolloutConfig(kv_cache_space_gb=0.5, max_num_seqs=256))
    # The engine shares the trainer's process: it must leave its threads and random streams alone
    # (vLLM itself drops torch to one thread, stubs out set_num_threads and reseeds everything).
    assert torch.get_num_threads() == threads
    assert torch.set_num_threads is torch._C.set_num_threads
    assert torch.equal(torch.get_rng_state(), rng)
    prompts = _prompts(tokenizer, 6)
    stale = engine.generate(prompts, SamplingParams(temperature=0.8, max_tokens=16, n=2, seed=11))
    assert torch.equal(torch.get_rng_state(), rng)

    # One real training step (SFT cross-entropy with a large LR so the change is visible), then sync.
    model.train()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in prompts[:2]:
        ids = torch.tensor([p + tokenizer.encode("= 42") + [tokenizer.eos_token_id]])
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    engine.sync_weights(model)
    yield {"model": model, "tokenizer": tokenizer, "engine": engine, "prompts": prompts, "stale": stale}
    engine.close()  # also drops the one-rank process group vLLM made, so later tests start clean
    assert not torch.distributed.is_initialized()


def test_logprobs_match_trainer_after_update(setup):
    model, tok, engine, prompts = setup["model"], setup["tokenizer"], setup["engine"], setup["prompts"]
    # Before the sync, the engine sampled from the old weights: the updated model disagrees.
    before, mask = _trainer_logprobs(model, prompts, setup["stale"], tok.pad_token_id, 0.8)
    assert (before - _engine_logprobs(setup["stale"], before))[mask].abs().max() > 1e-2

    worst = 0.0
    for temperature in (1.0, 0.6, 1.3):
        comps = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=24, n=4, seed=5))
        logp_BT, mask = _trainer_logprobs(model, prompts, comps, tok.pad_token_id, temperature)
        diff = (logp_BT - _engine_logprobs(comps, logp_BT))[mask].abs().max().item()
        worst = max(worst, diff)
        assert diff < LOGPROB_ATOL, f"temperature {temperature}: max |vLLM - trainer| log-prob = {diff:.2e}"
    print(f"max abs log-prob diff vLLM vs trainer: {worst:.2e}")


def test_layout_and_seeds(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=123)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=124))
    assert len(a) == len(prompts) * 3
    assert [x.prompt_index for x in a] == [i // 3 for i in range(len(a))], "prompt-major: sample k of prompt i at i*n+k"
    assert [x.token_ids for x in a] == [x.token_ids for x in b], "same seed, same completions"
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c], "another seed, other completions"
    # The n samples of one prompt are distinct draws, not copies.
    assert len({tuple(x.token_ids) for x in a[:3]}) == 3


def test_continuous_batch_requests_with_their_own_seeds_sample_alike_whatever_the_batch(setup):
    """generate_continuing without a call seed (the endpoint's): each request draws from its own params.seed, so
    what it samples depends neither on the other requests of the batch, their order, nor when it joined."""
    engine, prompts = setup["engine"], setup["prompts"]

    def run(first, later, shift=0):
        requests = [(i, prompts[i], SamplingParams(temperature=1.0, max_tokens=12, n=1, seed=100 + i + shift)) for i in first + later]
        got, waiting = {}, requests[len(first) :]

        def on_finish(done):
            nonlocal waiting
            got.update((k, c.token_ids) for k, c in done)
            new, waiting = waiting, []
            return new  # the rest join after the first step that finished a request

        engine.generate_continuing(requests[: len(first)], on_finish, seed=None)
        return got

    together = run(list(range(6)), [])
    assert run([5, 4], [3, 2, 1, 0]) == together and run([0], [5, 1, 2]) == {i: together[i] for i in (0, 5, 1, 2)}
    assert len({tuple(t) for t in together.values()}) == 6
    other = run(list(range(6)), [], shift=1)  # another seed per request, other draws
    assert sum(other[i] != together[i] for i in range(6)) >= 5


def test_large_seeded_batch(setup):
    """192 seeded requests, 5k prompt tokens: more than one engine step takes (4096 tokens).

    With vLLM's chunked prefill the last request's prefill would be split and vLLM 0.32 on CPU
    crashes ("CPU Generator does not use offset"); the engine makes requests wait instead.
    """
    engine, tok = setup["engine"], setup["tokenizer"]
    prompts = _prompts(tok, 24)
    assert sum(map(len, prompts)) * 8 > 4096
    params = SamplingParams(max_tokens=3, n=8, seed=3)
    a = engine.generate(prompts, params)
    assert len(a) == 24 * 8
    assert [c.token_ids for c in a] == [c.token_ids for c in engine.generate(prompts, params)]


def test_stop_at_eos_and_max_tokens(setup):
    engine, prompts, tok = setup["engine"], setup["prompts"], setup["tokenizer"]
    eos = set(engine.eos_ids)
    assert tok.eos_token_id in eos
    max_tokens = 32
    # Flattened sampling (T = 2, vLLM's maximum) over ~380 tokens: some of 96 samples hit EOS, some not.
    comps = engine.generate(prompts, SamplingParams(temperature=2.0, max_tokens=max_tokens, n=16, seed=7))
    finished = [c for c in comps if c.finished]
    cut = [c for c in comps if not c.finished]
    assert finished and cut, (len(finished), len(cut))
    for c in finished:
        assert c.token_ids[-1] in eos, "a finished completion ends with its EOS token"
        assert not eos & set(c.token_ids[:-1]), "nothing is generated after EOS"
        assert len(c.token_ids) <= max_tokens
    for c in cut:
        assert len(c.token_ids) == max_tokens and not eos & set(c.token_ids)
    short = engine.generate(prompts, SamplingParams(max_tokens=3, n=2, seed=1))
    assert all(len(c.token_ids) <= 3 for c in short)


def test_greedy_equals_hf_greedy(setup):
    model, tok, engine, prompts = setup["model"], setup["tokenizer"], setup["engine"], setup["prompts"]
    params = SamplingParams(greedy=True, n=4, max_tokens=20)  # greedy means one completion per prompt
    ours = engine.generate(prompts, params)
    ref = HFEngine(model, tok).generate(prompts, params)
    assert len(ours) == len(prompts)
    assert [c.token_ids for c in ours] == [c.token_ids for c in ref]
    assert [c.finished for c in ours] == [c.finished for c in ref]
    # top_k = 1 and a tiny top_p leave only the argmax: sampling must then reproduce greedy.
    for params in (SamplingParams(top_k=1, max_tokens=20, seed=9), SamplingParams(top_p=1e-6, max_tokens=20, seed=9)):
        assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in ours]


def test_sleep_and_wake_are_noops_on_cpu(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    engine.sleep()
    engine.wake_up()
    assert len(engine.generate(prompts[:1], SamplingParams(max_tokens=4, n=2, seed=0))) == 2


# ----------------------------------------------------------------------------- clear refusals


def test_unavailable_reasons_are_explained(monkeypatch, tiny_model_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(tiny_model_path)
    in_memory = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))  # fmt: skip
    with pytest.raises(vllm_mod.VLLMUnavailable, match="Hugging Face directory"):
        vllm_mod.VLLMEngine(in_memory, tok, RolloutConfig())

    model = load_model(tiny_model_path)
    monkeypatch.setattr(vllm_platform, "_cpu_flags", lambda: {"sse4_2", "avx"})
    monkeypatch.setattr(vllm_platform.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vllm_mod, "accelerator", lambda: ACCELERATORS["cpu"])  # the CPU path, on any machine
    with pytest.raises(vllm_mod.VLLMUnavailable, match="AVX2"):
        vllm_mod.VLLMEngine(model, tok, RolloutConfig())
    monkeypatch.undo()

    model.config.architectures = ["NotAModelForCausalLM"]
    with pytest.raises(vllm_mod.VLLMUnavailable, match="does not support the architecture"):
        vllm_mod.VLLMEngine(model, tok, RolloutConfig())
    model.config.architectures = ["Qwen2ForCausalLM"]

    with pytest.raises(vllm_mod.VLLMUnavailable, match="temperatures up to"):
        vllm_mod.VLLMEngine(model, tok, RolloutConfig(temperature=2.5))

    with pytest.raises(vllm_mod.VLLMUnavailable, match="kv_cache_space_gb"):
        vllm_mod.VLLMEngine(model, tok, RolloutConfig(kv_cache_space_gb=1e6))


def test_auto_falls_back_to_hf_and_vllm_errors(monkeypatch, tiny_model_path):
    from postrl.errors import UserError
    from postrl.rollout import make_engine

    def refuse(*args, **kwargs):
        raise vllm_mod.VLLMUnavailable("vLLM on CPU needs AVX2 (test)")

    monkeypatch.setattr(vllm_mod, "VLLMEngine", refuse)
    model, tok = load_model(tiny_model_path), load_tokenizer(tiny_model_path)
    said = []
    assert make_engine(RolloutConfig(engine="auto"), model, tok, log=said.append).name == "hf"
    assert "AVX2" in said[-1]
    with pytest.raises(UserError, match="AVX2"):
        make_engine(RolloutConfig(engine="vllm"), model, tok)


# ------------------------------------------------------------------------------- in the trainer


def test_tiny_dapo_run_with_vllm(tmp_path):
    from conftest import tiny_overrides

    from postrl.checks import load_config
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    overrides = tiny_overrides(
        tmp_path, "algorithm.name=dapo", "algorithm.overlong_buffer.len=4",
        "reward.verifiers=[verifiers_for_tests:length_parity]", "train.gen_batch_size=6", "train.lr=1e-3",
        "rollout.engine=vllm", "rollout.kv_cache_space_gb=0.25",
    )  # fmt: skip
    trainer = Trainer(load_config(None, overrides))
    assert trainer.engine.name == "vllm"
    try:
        trainer.fit()
    finally:
        trainer.engine.close()
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "timing/all" in r]
    assert len(steps) == 3
    for r in steps:
        # Only an engine that reports sampling log-probs (vLLM) produces this metric; after every
        # update the weights were synced, so vLLM and the trainer agree to float error on each step.
        assert r["rollout/logprob_diff_mean"] < 1e-4, r["rollout/logprob_diff_mean"]
        assert 1 <= r["response_length/mean"] <= 12
        assert r["vllm_tps"] > 0 and r["timing/resharding_to_infer"] > 0
        assert all(torch.isfinite(torch.tensor(v)) for k, v in r.items() if isinstance(v, float))
