"""The Tinker API (`postrl serve-tinker`, issue 61) driven by the official `tinker` SDK on the tiny model.

One server per sampler (vLLM where it starts, as `rollout.engine: auto` serves by default; HF generate), in this
process (its engine is reachable for the exactness checks), every test run against each; each test makes its
own training clients. The exactness tests compare the server's losses and gradients with postrl's formulas
and with Tinker's definitions written out by hand, on the same adapter and batch.
"""

from __future__ import annotations

import math
import threading

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "tml-test-key-0123456789"
BASE = "builtin:tiny-qwen2"


def _vllm_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module", params=["auto", "hf"], ids=["vllm", "hf"])
def server(request, tiny_model_path, tmp_path_factory):
    from postrl.agents.endpoint.server import HttpLimits
    from postrl.checks import load_config
    from postrl.serve import serve

    cfg = load_config(None, [f"model.path={BASE}", f"rollout.engine={request.param}"])
    stop, ready = threading.Event(), []
    thread = threading.Thread(
        target=serve, args=(cfg,), kwargs=dict(host="127.0.0.1", port=0, api_key=KEY, state_dir=tmp_path_factory.mktemp('tinker-state'), stop=stop, log=lambda *a: None, http=HttpLimits(max_body_bytes=2**20),
                                               ready=lambda port, service: ready.append((port, service))), daemon=True,
    )  # fmt: skip
    thread.start()
    while not ready and thread.is_alive():
        thread.join(0.05)
    assert ready, "the server did not start"
    port, service = ready[0]
    assert (service.engine.vllm is not None) == (request.param == "auto" and _vllm_here())  # the sampler under test
    yield f"http://127.0.0.1:{port}", service
    stop.set()
    thread.join(30)


@pytest.fixture(scope="module")
def client(server):
    return tinker.ServiceClient(base_url=server[0], api_key=KEY)


def tokenizer_of(path: str):
    from postrl.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(path))


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


SEQS = [[5, 17, 23, 41, 9, 12], [7, 3, 99, 14]]


def _ce_batch() -> list[types.Datum]:
    return [_datum(s, weights=[0.0] + [1.0] * (len(s) - 2)) for s in SEQS]


def test_health_capabilities_and_the_key(server, client):
    url, _ = server
    assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}
    caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    assert httpx.get(f"{url}/api/v1/get_server_capabilities").status_code == 401
    assert httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-wrong-key-000000"}).status_code == 401


def test_sdk_trains_a_lora_client_and_the_loss_falls(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    losses = []
    for _ in range(4):
        out = tc.forward_backward(_ce_batch(), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(out.metrics["loss:sum"])
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [len(s) - 1 for s in SEQS]
    assert losses[-1] < 0.7 * losses[0], losses
    assert tc.get_tokenizer().encode("12 + 3") == tokenizer_of(BASE).encode("12 + 3")  # offline: the served model's own


def test_sample_reports_the_trainers_logprobs(client):
    from postrl.diagnose.stats import gap_summary
    from postrl.diagnose.verdict import verdict

    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    tc.forward_backward(_ce_batch(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # the adapter is no longer zero
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 17, 23]
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=types.SamplingParams(max_tokens=6, seed=1)).result()
    assert len(res.sequences) == 3
    engine_lp, trainer_lp = [], []
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) and 1 <= len(seq.tokens) <= 6
        full = prompt + seq.tokens
        out = tc.forward([_datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result()
        trainer_lp += out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        engine_lp += seq.logprobs
    gap = gap_summary(torch.tensor(trainer_lp), torch.tensor(engine_lp))
    report = {"gap": gap, "tolerance": {"statistic": "max", "value": 1e-3, "dtype": "float32"}, "temperature_fit": None, "temperature": 1.0}
    assert verdict(report)["kind"] == "rounding", gap
    with_prompt = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2, seed=1), include_prompt_logprobs=True).result()
    forward = tc.forward([_datum(prompt, weights=[1.0] * (len(prompt) - 1))], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert with_prompt.prompt_logprobs[0] is None and with_prompt.prompt_logprobs[1:] == pytest.approx(forward, abs=1e-5)


def _grads(engine, model_id):
    return [p.grad.detach().clone() for p in engine.clients[model_id].params]


def _reference(engine, model_id, batch, loss_of):
    """Per datum, unpadded: the trainer's log-probs and `loss_of(logp_T, inputs)`, summed; (loss, adapter gradients)."""
    from postrl.algorithms import token_logprobs

    client = engine.clients[model_id]
    for p in client.params:
        p.grad = None
    engine._activate(client.adapter)
    total = 0.0
    for d in batch:
        ids = torch.tensor([d.model_input.to_ints()], device=engine.device)
        logits = engine.model(input_ids=ids).logits[0]
        logp, _ = token_logprobs(logits, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist(), device=engine.device))
        total = total + loss_of(logp, {k: torch.tensor(v.tolist(), device=engine.device) for k, v in d.loss_fn_inputs.items()})
    total.backward()
    engine._activate("__base__")
    grads = [p.grad.detach().clone() for p in client.params]
    for p in client.params:
        p.grad = None
    return float(total.detach()), grads


def _by_hand(name, config):
    """Tinker's definitions, written out (sums over tokens)."""
    def ce(logp, x):
        return -(x["weights"] * logp).sum()

    def is_(logp, x):
        return -(torch.exp(logp - x["logprobs"]) * x["advantages"]).sum()

    def ppo(logp, x):
        r = torch.exp(logp - x["logprobs"])
        lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.minimum(r * x["advantages"], torch.clamp(r, lo, hi) * x["advantages"]).sum()

    return {"cross_entropy": ce, "importance_sampling": is_, "ppo": ppo}[name]


def _postrl(name, config):
    """postrl's own formulas on one datum: the vanilla policy loss and seq-mean-token-sum aggregation."""
    from postrl import algorithms as algo

    def policy(logp, x, lo, hi):
        loss, _ = algo.get_policy_loss_fn("vanilla")(logp[None], x["logprobs"][None], x["advantages"][None], torch.ones_like(logp)[None],
                                                     clip_ratio_low=lo, clip_ratio_high=hi)  # fmt: skip
        return algo.aggregate_loss(loss, torch.ones_like(loss), "seq-mean-token-sum", num_seqs=1.0)

    return {
        "cross_entropy": lambda logp, x: algo.aggregate_loss(-logp[None], x["weights"][None], "seq-mean-token-sum", num_seqs=1.0),
        "importance_sampling": lambda logp, x: policy(logp, x, math.inf, math.inf),
        "ppo": lambda logp, x: policy(logp, x, 1 - config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2) - 1),
    }[name]


@pytest.mark.parametrize("name,config", [("cross_entropy", None), ("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})])
def test_losses_and_gradients_equal_postrls_formulas(server, client, name, config):
    _, service = server
    engine = service.engine
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    tc.forward_backward(_ce_batch(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # lora_B != 0: gradients reach both A and B
    g = torch.Generator().manual_seed(0)
    if name == "cross_entropy":
        batch = _ce_batch()
    else:  # old log-probs near the current ones, so some ratios clip and some do not
        batch = []
        for s in SEQS:
            cur = tc.forward([_datum(s, weights=[1.0] * (len(s) - 1))], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
            old = cur + 0.15 * torch.randn(len(s) - 1, generator=g)
            adv = torch.randn(len(s) - 1, generator=g)
            # built the way rl_loop.py builds them: prompt chunk + sampled chunk, TensorData.from_torch
            model_input = types.ModelInput.from_ints(s[:2]).append(types.EncodedTextChunk(tokens=s[2:-1]))
            inputs = {"target_tokens": torch.tensor(s[1:]), "logprobs": old, "advantages": adv}
            batch.append(types.Datum(model_input=model_input, loss_fn_inputs={k: types.TensorData.from_torch(v) for k, v in inputs.items()}))
    out = tc.forward_backward(batch, name, loss_fn_config=config).result()
    served_grads = service.jobs.call(lambda: _grads(engine, tc.model_id))
    ref_loss, ref_grads = service.jobs.call(lambda: _reference(engine, tc.model_id, batch, _postrl(name, config or {})))
    hand_loss, hand_grads = service.jobs.call(lambda: _reference(engine, tc.model_id, batch, _by_hand(name, config or {})))
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert ref_loss == pytest.approx(hand_loss, rel=1e-6, abs=1e-7)
    assert any(float(x.abs().max()) > 0 for x in served_grads)
    for s, r, h in zip(served_grads, ref_grads, hand_grads):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(r, h, rtol=1e-5, atol=1e-7)
    service.jobs.call(lambda: [setattr(p, "grad", None) for p in engine.clients[tc.model_id].params])


def test_a_large_forward_backward_runs_in_parts_with_the_same_result(server, client):
    """forward_backward runs its datums in forwards of about train.max_token_len_per_device tokens (an rl loop's
    64 x 200-token batch in one forward needs its logits, 64 x 200 x vocab floats, at once: the server was
    killed for memory); in parts the loss, the log-probs and the gradients are those of one forward."""
    _, service = server
    engine = service.engine
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    batch = [_datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS * 3]
    results, forwards = {}, []
    for budget in (4096, 1):  # all six datums in one forward; each alone
        service.jobs.call(lambda b=budget: setattr(engine, "micro_tokens", b))
        hook = engine.model.register_forward_hook(lambda *_: forwards.append(budget))
        out = tc.forward_backward(batch, "cross_entropy").result()
        hook.remove()
        results[budget] = (out.metrics["loss:sum"], [o["logprobs"].tolist() for o in out.loss_fn_outputs], service.jobs.call(lambda: _grads(engine, tc.model_id)))
        service.jobs.call(lambda: [setattr(p, "grad", None) for p in engine.clients[tc.model_id].params])
    service.jobs.call(lambda: setattr(engine, "micro_tokens", 4096))
    assert (forwards.count(4096), forwards.count(1)) == (1, 6)
    (loss1, lp1, g1), (loss6, lp6, g6) = results[4096], results[1]
    assert loss6 == pytest.approx(loss1, rel=1e-6) and loss1 > 0
    for a, b in zip(lp1, lp6):
        assert a == pytest.approx(b, abs=1e-5)
    for a, b in zip(g1, g6):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(a.abs().max()))  # float rounding of the summation order


def test_a_failing_request_is_its_futures_error_and_the_server_goes_on(client):
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="not served here"):
        tc.forward_backward(_ce_batch(), "stable_reinforce").result()
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 10**6], "weights": [1.0] * 3})]
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        tc.forward_backward(bad, "cross_entropy").result()
    short = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]})]
    with pytest.raises(tinker.RequestFailedError, match="shape"):
        tc.forward_backward(short, "cross_entropy").result()
    assert tc.forward_backward(_ce_batch(), "cross_entropy").result().metrics["loss:sum"] > 0  # still serving


def test_bad_bodies_are_refused_with_the_field_named(server, caplog):
    url, _ = server
    h = {"X-API-Key": KEY}
    r = httpx.post(f"{url}/api/v1/create_model", json={"session_id": "x", "model_seq_id": 0, "base_model": BASE, "oops": 1}, headers=h)
    assert r.status_code == 400 and "oops" in r.json()["detail"]
    assert "refused POST /api/v1/create_model (400): 'oops'" in caplog.text  # the log names what was refused and why
    assert httpx.post(f"{url}/api/v1/no_such_route", headers=h).status_code == 404
    assert "refused POST /api/v1/no_such_route (404)" in caplog.text
    r = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff\xfe not a protobuf", headers=h)
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/optim_step", content=b"[" * 10000 + b"]" * 10000, headers=h)
    assert r.status_code == 400 and "nests deeper" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/asample", content=b"x" * (2**20 + 1), headers=h)
    assert r.status_code == 413 and "over 1048576 bytes" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/optim_step", json={"model_id": "m", "adam_params": {"learning_rate": -1.0}}, headers=h)
    assert r.status_code == 400 and "AdamParams out of range" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": "nope"}, headers=h)
    assert r.status_code == 400 and "unknown request_id" in r.json()["detail"]


def test_a_future_outlives_the_client_that_made_it(server, client):
    """The raw protocol: one connection sends forward_backward and closes; another polls the future, twice."""
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    url, _ = server
    tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=_ce_batch(), loss_fn="cross_entropy"),
                                       model_id=tc.model_id, seq_id=1)  # fmt: skip
    h = {"X-API-Key": KEY}
    with httpx.Client() as first:
        rid = first.post(f"{url}/api/v1/forward_backward", content=forward_backward_request_to_proto(req).SerializeToString(), headers=h).json()["request_id"]
    results = []
    for _ in range(2):
        with httpx.Client(timeout=60) as again:
            while True:
                r = again.post(f"{url}/api/v1/retrieve_future", json={"request_id": rid}, headers={**h, "Accept": "application/x-protobuf"})
                if "protobuf" in r.headers["content-type"]:
                    break
                assert r.json()["type"] == "try_again"
        results.append(deserialize_forward_backward_output(r.content))
    assert results[0].metrics == results[1].metrics and results[0].metrics["loss:sum"] > 0


def test_loopback_unless_opted_in_and_a_key_the_sdk_accepts():
    from postrl.cli import main
    from postrl.serve import check_listen

    assert check_listen("127.0.0.1", False, KEY) == [] and check_listen("::1", False, KEY) == []
    assert check_listen("0.0.0.0", True, KEY) == []
    assert any("--allow-remote" in p for p in check_listen("0.0.0.0", False, KEY))
    assert any("tml-" in p for p in check_listen("127.0.0.1", False, "secret-key-123"))
    assert any("required" in p for p in check_listen("127.0.0.1", False, ""))
    assert main(["serve-tinker", "--host", "0.0.0.0", "--api-key", KEY, f"model.path={BASE}"]) == 2


def _train(tc, batch, steps_done: list) -> None:
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    steps_done.append(tc.model_id)


def _logprobs(tc, seqs) -> list[float]:
    out = tc.forward([_datum(s, weights=[1.0] * (len(s) - 1)) for s in seqs], "cross_entropy").result()
    return [x for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]


def test_two_training_clients_on_one_base_are_isolated(client):
    """Two adapters trained interleaved (forward_backward of one between the other's forward_backward and
    optim_step) end where each ends trained alone, and the base model is untouched."""
    x, y = [_datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS[:1]], [_datum(s, weights=[1.0] * (len(s) - 1)) for s in SEQS[1:]]
    base = client.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([5, 17])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    base_before = base.sample(prompt, 1, greedy).result().sequences[0].logprobs
    solo = {}
    for seed, batch in ((1, x), (2, y)):
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
        for _ in range(3):
            _train(tc, batch, [])
        solo[seed] = _logprobs(tc, SEQS)
    a = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    b = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    for _ in range(3):
        a.forward_backward(x, "cross_entropy").result()
        b.forward_backward(y, "cross_entropy").result()  # b's gradients must not reach a's adapter
        b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert _logprobs(a, SEQS) == pytest.approx(solo[1], abs=1e-6)
    assert _logprobs(b, SEQS) == pytest.approx(solo[2], abs=1e-6)
    assert max(abs(p - q) for p, q in zip(solo[1], solo[2])) > 1e-3  # the two runs do differ
    assert base.sample(prompt, 1, greedy).result().sequences[0].logprobs == pytest.approx(base_before, abs=1e-6)


def test_a_sampler_keeps_the_weights_it_was_given(server, client):
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    batch = _ce_batch()
    _train(tc, batch, [])
    saved = tc.save_weights_for_sampler(name="step1").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/step1"
    pinned = client.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints([5, 17, 23])
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    first = pinned.sample(prompt, 1, greedy).result().sequences[0]
    for _ in range(3):
        _train(tc, batch, [])
    again = pinned.sample(prompt, 1, greedy).result().sequences[0]
    assert again.tokens == first.tokens and again.logprobs == pytest.approx(first.logprobs, abs=1e-6)
    newer = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result().sequences[0]
    assert max(abs(p - q) for p, q in zip(newer.logprobs, first.logprobs)) > 1e-3
    info = tinker.RestClient(base_url=server[0], api_key=KEY).get_weights_info_by_tinker_path(saved.path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE, True, 4)


def test_a_saved_state_resumes_exactly(client):
    """Train 2 steps, save weights and optimizer, train 2 more; a client made from the save and trained the same
    2 steps ends at the same log-probs (AdamW's moments and step count came back too)."""
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    batch = _ce_batch()
    for _ in range(2):
        _train(tc, batch, [])
    path = tc.save_state("two").result().path
    assert path == f"tinker://{tc.model_id}/weights/two"
    for _ in range(2):
        _train(tc, batch, [])
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    weights_only = client.create_training_client_from_state(path).result()
    for _ in range(2):
        _train(resumed, batch, [])
        _train(weights_only, batch, [])
    assert _logprobs(resumed, SEQS) == pytest.approx(_logprobs(tc, SEQS), abs=1e-6)
    assert max(abs(p - q) for p, q in zip(_logprobs(weights_only, SEQS), _logprobs(tc, SEQS))) > 1e-4  # fresh moments differ


def test_a_saved_sampler_exports_to_a_plain_hf_directory(server, client, tmp_path):
    from transformers import AutoModelForCausalLM

    from postrl.algorithms import token_logprobs

    _, service = server
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
    _train(tc, _ce_batch(), [])
    path = tc.save_weights_for_sampler(name="export-me").result().path
    prompt = [5, 17, 23]
    seq = client.create_sampling_client(model_path=path).result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
    out = service.jobs.call(lambda: service.engine.export(path, tmp_path / "hf"))
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([prompt + seq.tokens])
    with torch.no_grad():
        logp, _ = token_logprobs(model(input_ids=ids[:, :-1]).logits[0], ids[0, 1:])
    assert logp[len(prompt) - 1 :].tolist() == pytest.approx(seq.logprobs, abs=1e-4)

    from postrl.cli import main  # the same through the command line

    assert main(["serve-tinker", f"model.path={BASE}", "--state-dir", str(service.engine.state_dir), "--export", path, "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_saved_weights_outlive_the_server(server, client):
    """A new server (a new Engine) on the same state directory samples from a saved sampler path with the same
    weights, and makes a training client from a saved state."""
    from postrl.serve.engine import Engine

    _, service = server
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    _train(tc, _ce_batch(), [])
    sampler_path = tc.save_weights_for_sampler(name="kept").result().path
    state_path = tc.save_state("kept").result().path
    prompt = [5, 17, 23]
    seq = client.create_sampling_client(model_path=sampler_path).result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, temperature=0.0)).result().sequences[0]
    other = Engine(BASE, BASE, service.engine.state_dir)
    (tokens, logprobs, _), = other.sample(other.sampler_for(None, sampler_path), prompt, 1, {"temperature": 0.0, "max_tokens": 5}, False)[0]
    assert tokens == seq.tokens and logprobs == pytest.approx(seq.logprobs, abs=1e-5)
    other.load_state("s:train:0", state_path, optimizer=True, create=True)
    assert other.clients["s:train:0"].steps == 1
    with pytest.raises(Exception, match="not a tinker://"):
        other.load_state("s:train:1", "tinker://../../etc/weights/x", optimizer=True, create=True)


def test_samplers_beyond_the_limit_are_released_and_named_ones_come_back(server, client):
    _, service = server
    engine = service.engine
    limit = engine.max_samplers
    service.jobs.call(lambda: setattr(engine, "max_samplers", 2))
    try:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=13).result()
        _train(tc, _ce_batch(), [])
        prompt, greedy = types.ModelInput.from_ints([5, 17, 23]), types.SamplingParams(max_tokens=4, temperature=0.0)
        unnamed = tc.save_weights_and_get_sampling_client().result()
        named_path = tc.save_weights_for_sampler(name="lru").result().path
        named = client.create_sampling_client(model_path=named_path).result()
        first = named.sample(prompt, 1, greedy).result().sequences[0]
        for _ in range(2):  # two newer samplers push both out
            tc.save_weights_and_get_sampling_client().result()
        assert len(engine.held) == 2
        with pytest.raises(tinker.RequestFailedError, match="released"):
            unnamed.sample(prompt, 1, greedy).result()
        again = named.sample(prompt, 1, greedy).result().sequences[0]  # reloaded from the state directory
        assert again.tokens == first.tokens and again.logprobs == pytest.approx(first.logprobs, abs=1e-6)
    finally:
        service.jobs.call(lambda: setattr(engine, "max_samplers", limit))


def test_a_stopping_server_cuts_the_running_sample_short(server, client):
    """SIGTERM sets `stopping`: the sample running ends at its next token (or engine step) with SamplingStopped
    instead of running to max_tokens, and the sampler is whole afterwards (vLLM holds no stale request)."""
    from postrl.rollout.base import SamplingStopped

    _, service = server
    engine = service.engine
    sampler = engine.sampler_for(BASE, None)
    long = {"max_tokens": 400, "temperature": 1.0, "seed": 4}
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_outcome(lambda: engine.sample(sampler, [5, 17, 23], 4, long, False))))
    try:
        service.jobs.call(worker.start)  # on the engine thread's turn: nothing else samples meanwhile
        engine.stopping.set()  # before or while it samples: either way it must not run to the end
        worker.join(120)
    finally:
        engine.stopping.clear()
    assert isinstance(outcome[0], SamplingStopped), outcome
    again = service.jobs.call(lambda: engine.sample(sampler, [5, 17, 23], 2, {"max_tokens": 3, "seed": 4}, False))
    assert [len(tokens) for tokens, _, _ in again[0]] == [3, 3]


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at which
        return exc


def test_a_stopping_server_fails_its_queued_work_instead_of_running_it():
    from postrl.errors import UserError
    from postrl.serve.app import Jobs, Limits

    jobs, started, release, ran = Jobs(Limits()), threading.Event(), threading.Event(), []
    running = jobs.get(jobs.submit(lambda: (started.set(), release.wait(30))))
    assert started.wait(30)
    queued = [jobs.get(jobs.submit(lambda i=i: ran.append(i))) for i in range(3)]
    assert jobs.cancel_queued("the server is stopping") == 3
    release.set()
    running.result(30)
    assert jobs.call(lambda: "saved") == "saved" and ran == []  # work submitted after the cancel still runs
    for f in queued:
        with pytest.raises(UserError):
            f.result(1)
    jobs.close()
