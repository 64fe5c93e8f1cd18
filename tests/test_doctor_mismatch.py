"""`postrl doctor --mismatch`: deliberately mismatched engines are named as such; matched float32 engines agree within
the guards' float32 tolerance; the per-step metrics carry verl's names and numbers."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import run_postrl, tiny_overrides

from postrl.algorithms.mismatch import mismatch_metrics, mismatch_sums
from postrl.checks import load_config
from postrl.cli import main
from postrl.diagnose.mismatch import diagnose_mismatch
from postrl.rollout import Completion, EngineCapabilities, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScoredHFEngine:
    """A real HF `generate` engine with weights of its own that reports its sampling log-probs (generate's scores), at
    a temperature of its own when `temperature` is given: the engine side of a deliberate mismatch."""

    name = "scored-hf"
    capabilities = EngineCapabilities(reports_logprobs=True, shares_trainer_model=False, can_sleep=False)

    def __init__(self, model: torch.nn.Module, tokenizer, temperature: float | None = None):
        self.model, self.tokenizer, self.temperature = model.eval(), tokenizer, temperature

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, multi_modal=None) -> list[Completion]:
        from postrl.models import left_pad

        t = self.temperature or params.temperature
        ids, attn = left_pad(prompts, self.tokenizer.pad_token_id)
        torch.manual_seed(params.seed or 0)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=t, top_p=1.0, top_k=0,
            max_new_tokens=params.max_tokens, num_return_sequences=params.n, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        P = ids.shape[1]
        logp_SBV = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores])  # processed: softmax(z / t)
        completions = []
        for row in range(out.sequences.shape[0]):
            tokens = out.sequences[row, P:].tolist()
            end = tokens.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in tokens else len(tokens)
            tokens = tokens[:end]
            lp = [float(logp_SBV[s, row, tok]) for s, tok in enumerate(tokens)]
            completions.append(Completion(row // params.n, tokens, finished=tokens[-1:] == [self.tokenizer.eos_token_id], logprobs=lp))
        return completions

    @torch.no_grad()
    def probe_logprobs(self, token_ids):
        x = torch.tensor([token_ids])
        logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), -1)
        return logp.gather(1, x[0, 1:, None]).squeeze(1).tolist()

    def probe_routing(self, token_ids, top_k):
        return None

    def generate_continuing(self, requests, on_finish, seed=None):
        raise NotImplementedError

    def sync_weights(self, model):
        """Deliberately nothing: this engine keeps the weights it was built with."""

    def set_threads(self, n):
        pass

    def pop_metrics(self):
        return {}

    def sleep(self):
        pass

    def close(self):
        pass


def scored(temperature: float | None = None, noise: float = 0.0):
    """build_run's `wrap`: the run's engine replaced by a ScoredHFEngine on a copy of the policy (weights perturbed by
    `noise` x their own scale: stale weights)."""

    def wrap(engine, run):
        model = copy.deepcopy(run.policy.model)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=g))
        return ScoredHFEngine(model, run.policy.tokenizer, temperature)

    return wrap


def config(tmp_path, *extra):
    return load_config("configs/tiny_grpo.yaml", tiny_overrides(tmp_path, "train.global_batch_size=2", *extra))


def test_an_engine_sampling_at_another_temperature_is_named(tmp_path):
    cfg = config(tmp_path, "rollout.temperature=0.6")
    r = diagnose_mismatch(cfg, wrap=scored(temperature=1.0), log=lambda m: None)
    assert r["verdict"]["kind"] == "sampling_temperature", r["verdict"]
    assert r["temperature_fit"]["best"] == pytest.approx(1.0)
    assert r["temperature_fit"]["gap_at_best"] < 1e-4 < 1e-2 < r["gap"]["mean"]
    assert "temperature about 1" in r["verdict"]["summary"] and "rollout.temperature" in r["verdict"]["fix"]


def test_an_engine_with_stale_weights_is_named(tmp_path):
    cfg = config(tmp_path)
    r = diagnose_mismatch(cfg, wrap=scored(noise=0.2), log=lambda m: None)
    assert r["verdict"]["kind"] == "stale_weights", r["verdict"]
    assert r["probe"]["max"] > 1e-2 and r["gap"]["max"] > 1e-2
    shares = r["corrections"]
    assert set(shares) >= {"TIS", "MIS", "Seq-MIS", "IcePop"}
    assert all(0.0 <= v["tokens"] <= 1.0 and 0.0 <= v["sequences"] <= 1.0 for k, v in shares.items() if isinstance(v, dict))


def test_matched_float32_engines_agree_within_the_guards_tolerance(tmp_path):
    cfg = config(tmp_path)
    assert cfg.model.dtype == "float32"
    r = diagnose_mismatch(cfg, wrap=scored(), full_distribution=True, log=lambda m: None)
    assert r["verdict"]["kind"] == "rounding", r["verdict"]
    assert r["tolerance"] == {"value": 1e-3, "statistic": "max", "dtype": "float32"}
    assert r["gap"]["max"] < 1e-3 and r["probe"]["max"] < 1e-3
    assert r["full_distribution"] == {"available": False, "why": r["full_distribution"]["why"]}  # sampled tokens only
    assert len(r["worst"]) == 10 and all(w["gap"] < 1e-3 for w in r["worst"])
    assert sum(b["tokens"] for b in r["by_position"]) == sum(b["tokens"] for b in r["by_frequency"]) == r["tokens"]


def test_the_cli_replays_the_hf_engine_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["doctor", "--mismatch", "--full-distribution", "configs/tiny_grpo.yaml", *tiny_overrides(tmp_path, "train.global_batch_size=2"), "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["verdict"]["kind"] == "rounding" and r["gap"]["max"] < 1e-3 and r["probe"] is None
    fd = r["full_distribution"]
    assert fd["available"] and fd["overlap"] == 1.0 and fd["kl_max"] < 1e-6
    printed = capsys.readouterr().out
    assert "verdict" in printed and "the 10 worst tokens" in printed


def test_step_metrics_carry_verls_names_and_hand_computed_values():
    p = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])  # trainer
    q = torch.tensor([[math.log(0.4), math.log(0.2), -3.0]])  # engine; the third token is masked out
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(*mismatch_sums(p, q, mask))
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.075)  # |0.5 - 0.4|, |0.25 - 0.2|
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(2 * 0.025**2))  # Bessel: / (n - 1)
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)  # y = 0.8 x
    assert m["rollout_corr/kl"] == pytest.approx(math.log(0.8))  # mean of q - p
    assert m["rollout_corr/k3_kl"] == pytest.approx(0.25 - math.log(1.25))  # exp(r) - r - 1 at r = p - q = log 1.25
    assert m["rollout_corr/training_ppl"] == pytest.approx(math.sqrt(8))  # exp(-mean log p) of the one sequence
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(1 / math.sqrt(0.08))


def test_the_update_logs_them_from_the_old_logprobs_without_another_pass(tmp_path):
    from postrl.assembly import build_run
    from postrl.metrics import Timer

    cfg = config(tmp_path)
    run = build_run(cfg, "trainer")
    try:
        batch, _ = run.experience.collect(0, Timer())
        actor = run.actor
        assert actor.on_policy  # the update pass's own log-probs are the old ones
        own = actor.compute_logprobs(run.policy.model, actor.pack(batch, torch.zeros(batch.size)))
        batch.engine_logprobs = [(own[i, : len(r)] - 0.1).tolist() for i, r in enumerate(batch.response_ids)]  # engine: 0.1 lower
        m = actor.update(actor.pack(batch, torch.zeros(batch.size)))
    finally:
        run.close()
    assert m["rollout_corr/kl"] == pytest.approx(-0.1, abs=1e-4)
    assert m["rollout_corr/k3_kl"] == pytest.approx(math.exp(0.1) - 0.1 - 1, abs=1e-4)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(m["rollout_corr/training_ppl"] * math.exp(0.1), rel=1e-3)
    assert m["training/rollout_actor_probs_pearson_corr"] > 0.99
    assert 0 < m["training/rollout_probs_diff_mean"] <= m["training/rollout_probs_diff_max"]


@pytest.mark.slow
def test_vllm_float32_agrees_with_the_trainer_token_by_token_and_over_the_top_k(tmp_path):
    """vLLM's sampling log-probs (and, with --full-distribution, its top-k at each position: logprobs=k) against the
    trainer's old-log-prob pass, both float32 on CPU: rounding, within the guards' float32 tolerance."""
    import postrl.rollout.vllm_platform as vllm_platform

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - machines without a working vLLM
        pytest.skip(f"vLLM is unavailable here: {exc}")
    cfg = config(tmp_path, "rollout.engine=vllm")
    r = diagnose_mismatch(cfg, full_distribution=True, top_k=10, log=lambda m: None)
    assert r["engine"]["name"] == "vllm" and r["verdict"]["kind"] == "rounding", r["verdict"]
    assert r["gap"]["max"] < 1e-3 and r["probe"]["max"] < 1e-3
    fd = r["full_distribution"]
    assert fd["available"] and fd["topk"] == 10 and fd["overlap"] >= 0.9 and fd["kl_mean"] < 1e-3
    assert r["step_metrics"]["training/rollout_actor_probs_pearson_corr"] > 0.99


@pytest.mark.slow
def test_the_doctor_on_a_pool_whose_trainer_imports_ray_through_vllm_keeps_its_cluster_on_loopback(tmp_path):
    """The doctor builds the trainer's vLLM engine (which imports ray) before the pool starts its Ray cluster: Ray's
    switch for a one-machine cluster, read at import, must be set before that (else the pool refuses to start a
    cluster on the LAN address, and the doctor could not run on a pool)."""
    out = tmp_path / "m.json"
    args = tiny_overrides(tmp_path, "train.global_batch_size=2", "rollout.engine=vllm", "rollout.placement=pool", "rollout.pool.replicas=1")
    p = run_postrl("doctor", "--mismatch", "configs/tiny_grpo.yaml", *args, "--json", str(out),
                   env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": None}, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["engine"]["placement"] == "pool" and r["engine"]["name"] == "vllm"
    assert r["verdict"]["kind"] == "rounding" and r["gap"]["max"] < 1e-3, r["verdict"]
