"""One training step through the Tinker API (`postrl serve-tinker`) next to postrl's own trainer, same batch.

The batch: B sequences of P prompt + R response tokens on the model (LoRA rank r, all linear layers), advantages
on the response tokens. Timed, each the median of --repeats steps after one warm-up:

- sdk:    the official `tinker` SDK against the server in this process: forward_backward(importance_sampling)
          + optim_step, both awaited (HTTP, protobuf, futures included);
- engine: the same two calls on the server's Engine directly (the compute without the service);
- postrl: postrl's own Actor.update on the same rows (one mini-batch, one epoch, vanilla loss, AdamW).

    python benchmarks/tinker_step.py [--model builtin:tiny-qwen2] [--batch 8] [--prompt 64] [--response 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import torch


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-qwen2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    import tinker
    from tinker import types

    from postrl.actor import Actor
    from postrl.batch import Batch
    from postrl.checks import load_config
    from postrl.models import load_policy
    from postrl.runtime import init_runtime
    from postrl.serve import serve
    from postrl.serve.wire import Datum, FwdBwd

    B, P, R = a.batch, a.prompt, a.response
    cfg = load_config(None, [
        f"model.path={a.model}", f"model.lora_rank={a.rank}", "model.lora_alpha=32", "model.target_modules=all-linear",
        "rollout.n_samples_per_prompt=2", f"rollout.max_tokens={R}", f"train.global_batch_size={B // 2}",
        f"train.micro_batch_size={B}", "train.lr=1e-5", "logging.progress=false", "data.builtin.train_size=8", "data.builtin.val_size=4",
        "rollout.engine=hf",  # nothing is sampled: no vLLM to start
    ])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    policy = load_policy(cfg.model)
    V = policy.model.get_input_embeddings().num_embeddings
    prompts = [torch.randint(3, V, (P,), generator=g).tolist() for _ in range(B)]
    responses = [torch.randint(3, V, (R,), generator=g).tolist() for _ in range(B)]
    adv_B = torch.randn(B, generator=g)

    # postrl's own trainer
    actor = Actor(cfg, policy, policy.model, init_runtime("cpu", "float32"), log=lambda *_: None)
    batch = Batch(prompt_ids=prompts, response_ids=responses, loss_masks=[[1] * R] * B, turns=[1] * B, finished=[True] * B,
                  scores=[0.0] * B, rewards=[0.0] * B, verifier_metrics=[{}] * B, engine_logprobs=[None] * B, multi_modal=[None] * B)  # fmt: skip
    t_postrl = median_time(lambda: actor.update(actor.pack(batch, adv_B)), a.repeats)

    # the Tinker server, in this process
    stop, ready = threading.Event(), []
    key = "tml-benchmark-key-000"
    with tempfile.TemporaryDirectory() as state:
        th = threading.Thread(target=serve, args=(cfg,), kwargs=dict(host="127.0.0.1", port=0, api_key=key, state_dir=state, stop=stop,
                              log=lambda *_: None, ready=lambda port, service: ready.append((port, service))), daemon=True)  # fmt: skip
        th.start()
        while not ready:
            th.join(0.05)
        port, service = ready[0]
        tc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=key).create_lora_training_client(base_model=a.model, rank=a.rank).result()
        datums, raw = [], []
        for p, r, adv in zip(prompts, responses, adv_B.tolist()):
            seq = p + r
            inputs = {"target_tokens": seq[1:], "logprobs": [0.0] * (P - 1) + [-5.0] * R, "advantages": [0.0] * (P - 1) + [adv] * R}
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
            raw.append(Datum(seq[:-1], {k: torch.tensor(v) for k, v in inputs.items()}))
        adam = types.AdamParams(learning_rate=1e-5)

        def sdk_step():
            f = tc.forward_backward(datums, "importance_sampling")
            o = tc.optim_step(adam)
            f.result(), o.result()

        t_sdk = median_time(sdk_step, a.repeats)
        engine = service.engine
        req = FwdBwd(tc.model_id, "importance_sampling", {}, raw, False)

        def engine_step():
            engine.forward_backward(req)
            engine.optim_step(tc.model_id, adam.model_dump())

        t_engine = median_time(lambda: service.jobs.call(engine_step), a.repeats)
        stop.set()
        th.join(60)
    tokens = B * (P + R)
    print(f"{a.model}, LoRA rank {a.rank}, {B} sequences x ({P} + {R}) tokens, {a.threads} thread(s), median of {a.repeats}:")
    for name, t in (("tinker SDK -> serve-tinker", t_sdk), ("serve-tinker engine alone", t_engine), ("postrl Actor.update", t_postrl)):
        print(f"  {name:28s} {t * 1000:8.1f} ms   {tokens / t:9.0f} tokens/s")


if __name__ == "__main__":
    main()
