"""Checkpoints, exact resume, export and evaluation (docs/checkpoints.md).

All runs use the random-init tiny model on CPU. A module-scoped GRPO run of 2 steps (checkpoints at
steps 1 and 2, validation with sampling at both) serves the layout, resume-semantics, export and
`postrl eval` tests; the bit-exact resume and the SIGKILL tests make their own runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fixed_batch, masked_logprobs, quiet_console, run_postrl, tiny_cfg, tiny_train_args
from verifiers_for_tests import length_parity

from postrl import checkpoint
from postrl.checks import load_config
from postrl.errors import UserError
from postrl.evaluate import pass_at_k, report_ks
from postrl.metrics import read_jsonl
from postrl.models import build_sequences
from postrl.rewards.registry import register
from postrl.trainer import Trainer

# The same verifier as 'verifiers_for_tests:length_parity', registered in-process so that these
# runs do not start verifier worker processes (seconds each on a loaded 2-core machine).
register("ckpt_length_parity", in_process=True)(length_parity)
PARITY = "reward.verifiers=[ckpt_length_parity]"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _output(trainer: Trainer) -> str:
    return trainer.console.file.getvalue()


def _steps(run_dir: Path) -> dict[int, dict]:
    """Training rows of metrics.jsonl by step (a resumed run appends; the last row of a step wins)."""
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/all" in r}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing/") and not k.endswith("_tps")}


def _close(trainer: Trainer) -> None:
    trainer.logger.close()
    trainer.run.reward_fn.close()


# --------------------------------------------------------------------------------- exact resume


class _Stop(Exception):
    """Raised right after a chosen checkpoint is written: the run stops there, as if killed."""


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """6 steps == 3 steps, stop, resume, 3 more: all parameters bitwise, AdamW state, and every logged metric
    except timing/throughput. DAPO with dynamic sampling (gen_batch_size 5 > global 4, a verifier that makes a
    third of the groups uniform, so nearly every step refills), cosine LR with warmup, two optimizer steps per batch (old log-probs), KL to a
    reference model and validation between steps: every piece of state must line up."""
    common = (
        "algorithm.name=dapo", "reward.verifiers=[verifiers_for_tests:parity_unless_multiple_of_three]",
        "algorithm.overlong_buffer.len=4", "train.gen_batch_size=5",
        "train.mini_batch_size=2", "algorithm.kl.coef=0.05", "train.lr=2e-3", "train.warmup_steps=2",
        "train.lr_schedule=cosine", "train.min_lr_ratio=0.1", "train.total_steps=6", "train.deterministic=true",
        "checkpoint.save_freq=3", "eval.freq=2", "eval.max_prompts=4", "train.seed=2",
    )  # fmt: skip
    full = Trainer(tiny_cfg(tmp_path / "full", *common), quiet_console())
    full.fit()

    first = Trainer(tiny_cfg(tmp_path / "split", *common), quiet_console())
    real_step = first.train_step

    def step_unless_stopped():
        if first.step == 3:  # after step 3 was logged and checkpointed
            raise _Stop
        return real_step()

    first.train_step = step_unless_stopped
    with pytest.raises(_Stop):
        first.fit()
    _close(first)
    del first

    resumed = Trainer(tiny_cfg(tmp_path / "split", *common), quiet_console())
    assert resumed.step == 3, _output(resumed)
    assert "resumed from" in _output(resumed) and "warning" not in _output(resumed)
    resumed.fit()

    a, b = dict(full.model.named_parameters()), dict(resumed.model.named_parameters())
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"parameters differ after resume: {differ[:5]}"
    sa, sb = full.actor.optimizer.state_dict(), resumed.actor.optimizer.state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert sa["param_groups"] == sb["param_groups"]
    assert full.sampler.state_dict() == resumed.sampler.state_dict()

    rows_a, rows_b = _steps(tmp_path / "full" / "run"), _steps(tmp_path / "split" / "run")
    assert sorted(rows_a) == sorted(rows_b) == [1, 2, 3, 4, 5, 6]
    for step in rows_a:
        ca, cb = _comparable(rows_a[step]), _comparable(rows_b[step])
        assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k)}
    # the run really exercised what it claims to
    assert any(r["dapo/kept_groups_ratio"] < 1 for r in rows_a.values())
    assert any(r["dapo/num_gen_batches"] > 1 for s, r in rows_a.items() if s > 3), "resume must cross a refill"
    assert len({r["actor/lr"] for r in rows_a.values()}) >= 5  # warmup, then cosine
    assert any(k.startswith("val/") for k in rows_a[4])
    # keep_last (default 2): iter 3 and 6 remain, and the tracker names 6
    ckpts = tmp_path / "split" / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000003", "iter_0000006", checkpoint.TRACKER]
    assert (ckpts / checkpoint.TRACKER).read_text().strip() == "6"


# --------------------------------------------------------------------------------- crash safety


@pytest.mark.slow
def test_sigkill_while_saving_resumes_from_the_previous_checkpoint(tmp_path):
    """A run SIGKILLed in the middle of writing checkpoint 2 leaves checkpoint 1 as the one resume picks;
    the partial directory is never read, and the resumed run completes and cleans it up."""
    args = tiny_train_args(tmp_path, "logging.sinks=[jsonl]", "reward.verifiers=[acc_for_dapo]", "checkpoint.save_freq=1",
                           "train.total_steps=3", "train.deterministic=true")  # fmt: skip
    proc = run_postrl(*args, env={checkpoint.CRASH_ENV: "2"}, timeout=600, start_new_session=True)
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]

    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / checkpoint.TRACKER).read_text().strip() == "1"
    assert (ckpts / "iter_0000001" / checkpoint.STATE_FILE).is_file()
    assert not (ckpts / "iter_0000002").exists()
    partial = ckpts / ".tmp_iter_0000002"
    assert (partial / "model" / "config.json").is_file(), "the crash hook fires after the weights are written"
    assert not (partial / checkpoint.STATE_FILE).exists()

    cfg = load_config(args[1], args[2:])  # the same run (train CONFIG OVERRIDES), resumed in this process
    assert checkpoint.find_resume_dir(cfg) == ckpts / "iter_0000001"
    resumed = Trainer(cfg, quiet_console())
    assert resumed.step == 1
    resumed.fit()
    assert resumed.step == 3
    assert (ckpts / checkpoint.TRACKER).read_text().strip() == "3"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000002", "iter_0000003", checkpoint.TRACKER]
    assert sorted(_steps(tmp_path / "run")) == [1, 2, 3]


def test_a_crash_between_rename_and_tracker_keeps_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    """The tracker is written last: a checkpoint renamed into place but not yet named is not resumed from."""
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    cfg = tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}", "checkpoint.keep_last=0")
    tr = Trainer(cfg, quiet_console())
    assert tr.step == 2
    tr.step = 3

    def crash(path, text):
        raise KeyboardInterrupt("killed before the tracker was written")

    monkeypatch.setattr(checkpoint, "_write_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tr.cfg, tr.state_dict())
    monkeypatch.undo()
    assert (root / "iter_0000003" / checkpoint.STATE_FILE).is_file()
    assert checkpoint.find_resume_dir(cfg) == root / "iter_0000002"
    _close(tr)


# ------------------------------------------------------------------------ the shared 2-step run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """GRPO, 2 steps, a checkpoint after each (keep all), validation with 4 samples at steps 1 and 2."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = tiny_cfg(
        tmp, PARITY, "train.total_steps=2", "train.lr=2e-3", "checkpoint.save_freq=1", "checkpoint.keep_last=0",
        "eval.freq=1", "eval.after_train=true", "eval.n_samples=4", "eval.temperature=1.0", "eval.max_prompts=6",
    )  # fmt: skip
    tr = Trainer(cfg, quiet_console())
    tr.fit()
    return {"trainer": tr, "cfg": cfg, "run": tmp / "run", "ckpts": Path(cfg.checkpoint.dir)}


def test_checkpoint_layout(trained):
    root = trained["ckpts"]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000002", checkpoint.TRACKER]
    assert (root / checkpoint.TRACKER).read_text() == "2\n"
    ck = root / "iter_0000002"
    for name in ("model/config.json", "model/model.safetensors", "model/tokenizer.json", "model/generation_config.json",
                 "optimizer/rank0.pt", "scheduler.pt", "rng_rank0.pt", "dataloader.pt", "trainer_state.json", "config.yaml"):  # fmt: skip
        assert (ck / name).is_file(), name
    state = checkpoint.describe(ck)
    assert state["step"] == 2 and state["world_size"] == 1 and state["batch"]["global_batch_size"] == 4
    # the resolved config round-trips
    saved = load_config(ck / "config.yaml")
    assert saved.model_dump() == trained["cfg"].model_dump()
    sampler = torch.load(ck / "dataloader.pt", weights_only=False)["sampler"]
    assert sampler["position"] == 2 * 4  # two steps of 4 prompts, GRPO draws exactly one generation batch


def test_resume_picks_the_tracker_iteration_and_restores_every_piece(trained, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    (root / checkpoint.TRACKER).write_text("1\n")  # the user goes back one iteration
    tr = Trainer(tiny_cfg(tmp_path, PARITY, "train.total_steps=2", "train.lr=2e-3", f"checkpoint.dir={root}"), quiet_console())
    assert tr.step == 1
    assert "iter_0000002 exist(s); this run will overwrite them" in _output(tr)
    ck = root / "iter_0000001"
    weights = _safetensors(ck / "model")
    for name, p in tr.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]) or name == "lm_head.weight", name
    saved_opt = torch.load(ck / "optimizer" / "rank0.pt", weights_only=False)
    assert all(torch.equal(v, saved_opt["state"][0][k]) for k, v in tr.actor.optimizer.state_dict()["state"][0].items())
    assert tr.actor.scheduler.last_epoch == 1
    assert tr.sampler.state_dict()["position"] == 4
    assert torch.equal(torch.get_rng_state(), torch.load(ck / "rng_rank0.pt", weights_only=False)["torch"])
    _close(tr)

    # resume: <path> names an iteration directly, or a checkpoint root (its tracker decides)
    for resume, step in ((root / "iter_0000002", 2), (root, 1)):
        cfg = tiny_cfg(tmp_path, PARITY, "checkpoint.dir=" + str(tmp_path / "elsewhere"), f"checkpoint.resume={resume}")
        assert checkpoint.find_resume_dir(cfg) == checkpoint.iter_dir(root, step)
    assert checkpoint.find_resume_dir(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}", "checkpoint.resume=none")) is None


def test_finetune_and_load_switches(trained, tmp_path):
    root = trained["ckpts"]
    ck = root / "iter_0000002"
    base = (PARITY, f"checkpoint.dir={root}")

    ft = Trainer(tiny_cfg(tmp_path, *base, "checkpoint.finetune=true"), quiet_console())
    assert ft.step == 0 and ft.actor.optimizer.state_dict()["state"] == {} and ft.sampler.state_dict()["position"] == 0
    assert torch.equal(ft.model.model.norm.weight, _safetensors(ck / "model")["model.norm.weight"])
    _close(ft)

    no_opt = Trainer(tiny_cfg(tmp_path, *base, "checkpoint.load_optimizer=false", "train.lr_schedule=cosine", "train.total_steps=4"), quiet_console())
    assert no_opt.step == 2 and no_opt.actor.optimizer.state_dict()["state"] == {}
    assert no_opt.actor.scheduler.last_epoch == 2  # the LR schedule continues at the resumed step
    assert no_opt.actor.optimizer.param_groups[0]["lr"] == pytest.approx(no_opt.cfg.train.lr * 0.5)  # cosine half-way
    _close(no_opt)

    # This loop never draws from the global RNGs (generation is seeded per call, no dropout), so give
    # the checkpoint a distinct RNG state to tell restored from freshly seeded.
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    state = torch.load(root / "iter_0000002" / "rng_rank0.pt", weights_only=False)
    state["torch"] = torch.Generator().manual_seed(123).get_state()
    torch.save(state, root / "iter_0000002" / "rng_rank0.pt")
    base = (PARITY, f"checkpoint.dir={root}")
    no_rng = Trainer(tiny_cfg(tmp_path, *base, "checkpoint.load_rng=false"), quiet_console())
    assert no_rng.step == 2 and not torch.equal(torch.get_rng_state(), state["torch"])
    _close(no_rng)
    with_rng = Trainer(tiny_cfg(tmp_path, *base), quiet_console())
    assert torch.equal(torch.get_rng_state(), state["torch"])
    _close(with_rng)



class _RunsCode:
    """A pickle payload: unpickling it calls os.mkdir(marker), which is how a checkpoint from someone else runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_checkpoint_state_loads_without_running_code(trained, tmp_path):
    ck = trained["ckpts"] / "iter_0000002"
    for f in sorted(ck.rglob("*.pt")):  # what postrl writes is tensors, numbers and containers only
        assert isinstance(torch.load(f, weights_only=True), dict), f
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    marker = tmp_path / "code_ran"
    for name, way in (("optimizer/rank0.pt", "checkpoint.load_optimizer: false"), ("rng_rank0.pt", "checkpoint.load_rng: false"),
                      ("dataloader.pt", "checkpoint.finetune: true")):
        target = root / "iter_0000002" / name
        good = target.read_bytes()
        torch.save({"state": {}, "payload": _RunsCode(marker)}, target)
        with pytest.raises(checkpoint.Untrusted, match="loading it could run code from the file") as err:
            Trainer(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}"), quiet_console())
        assert str(target) in str(err.value) and way in str(err.value) and "posix.mkdir" in str(err.value)
        assert not marker.exists()
        target.write_bytes(good)
    # The way out the message names: the weights only (safetensors), a fresh run.
    torch.save({"sampler": _RunsCode(marker)}, root / "iter_0000002" / "dataloader.pt")
    ft = Trainer(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}", "checkpoint.finetune=true"), quiet_console())
    assert ft.step == 0 and not marker.exists()
    _close(ft)


def test_an_rng_file_of_the_first_format_still_resumes(trained, tmp_path):
    """The first format kept numpy's RNG key as a numpy array: it loads (numpy's number arrays allowed, nothing else)."""
    import numpy as np

    from postrl.runtime import rng_state

    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    np.random.seed(7)
    old = rng_state()  # the tuple numpy returns, array and all, as the first format saved it
    old["torch"] = torch.Generator().manual_seed(321).get_state()
    torch.save(old, root / "iter_0000002" / "rng_rank0.pt")
    expected = np.random.rand(4)  # what numpy draws next from the saved state
    np.random.seed(0)
    tr = Trainer(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}"), quiet_console())
    assert tr.step == 2 and torch.equal(torch.get_rng_state(), old["torch"])
    assert np.array_equal(np.random.rand(4), expected)
    _close(tr)

def test_changed_settings_on_resume_warn_and_name_the_override(trained, tmp_path):
    out = Trainer(
        tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={trained['ckpts']}", "train.global_batch_size=2", "train.lr=1e-3"),
        quiet_console(),
    )
    text = _output(out)
    assert "train.global_batch_size 4 -> 2" in text and "train.global_batch_size=4" in text, text
    assert "train.lr 0.002 -> 0.001" in text
    assert out.actor.optimizer.param_groups[0]["lr"] == 1e-3  # the config's LR applies; the moments are kept
    assert out.actor.optimizer.state_dict()["state"] != {}
    _close(out)


def test_ref_model_path_loads_the_reference(trained, tmp_path):
    ref_dir = trained["ckpts"] / "iter_0000001" / "model"
    tr = Trainer(
        tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={trained['ckpts']}", "algorithm.kl.coef=0.1", f"checkpoint.ref_model_path={ref_dir}"),
        quiet_console(),
    )
    assert tr.step == 2
    w1, w2 = _safetensors(ref_dir), _safetensors(trained["ckpts"] / "iter_0000002" / "model")
    assert torch.equal(tr.ref_model.model.norm.weight, w1["model.norm.weight"])
    assert torch.equal(tr.model.model.norm.weight, w2["model.norm.weight"])
    _close(tr)


def test_unusable_resume_targets_fail_clearly(trained, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(trained["ckpts"], root)
    (root / checkpoint.TRACKER).write_text("7\n")
    with pytest.raises(UserError, match="names iteration 7.*found: iter_0000001, iter_0000002"):
        checkpoint.find_resume_dir(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}"))
    (root / checkpoint.TRACKER).unlink()
    with pytest.raises(UserError, match="no latest_checkpointed_iteration.txt"):
        checkpoint.find_resume_dir(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}"))
    with pytest.raises(UserError, match="neither a checkpoint"):
        checkpoint.find_resume_dir(tiny_cfg(tmp_path, PARITY, f"checkpoint.resume={tmp_path}"))
    assert checkpoint.find_resume_dir(tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={tmp_path / 'new'}")) is None


def test_rotation_keeps_the_last_n_and_never_a_half_deleted_checkpoint(trained, tmp_path):
    root = tmp_path / "ckpts"
    tr = trained["trainer"]
    cfg = tiny_cfg(tmp_path, PARITY, f"checkpoint.dir={root}", "checkpoint.keep_last=2")
    saved_cfg, saved_step = tr.cfg, tr.step
    try:
        tr.cfg = cfg
        for step in (1, 2, 3):
            tr.step = step
            checkpoint.save(tr.cfg, tr.state_dict())
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000003", checkpoint.TRACKER]
        # going back: iteration 2 is re-saved in place; 3 (ahead of the run) is kept until overwritten
        (root / ".tmp_iter_0000009").mkdir()  # debris of a crashed save
        tr.step = 2
        checkpoint.save(tr.cfg, tr.state_dict())
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000003", checkpoint.TRACKER]
        assert (root / checkpoint.TRACKER).read_text().strip() == "2"
    finally:
        tr.cfg, tr.step = saved_cfg, saved_step


# ----------------------------------------------------------------------------------------- export


def _batch(trainer: Trainer) -> dict[str, torch.Tensor]:
    return fixed_batch(trainer.tokenizer, [e.prompt_ids for e in trainer.run.val_sets["arithmetic"][:3]])


def test_export_is_a_plain_hf_model_with_the_trainers_logprobs(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from postrl.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(trained["ckpts"]), str(out)]) == 0  # the root: the tracker's iteration (2)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == trained["trainer"].tokenizer.eos_token
    tr = trained["trainer"]  # the in-memory policy after the last step
    t = _batch(tr)
    assert torch.equal(masked_logprobs(model, t), masked_logprobs(tr.model, t))
    with pytest.raises(UserError, match="not empty"):
        checkpoint.export(trained["ckpts"], out)
    with pytest.raises(UserError, match="not a model directory or a postrl checkpoint"):
        checkpoint.export(tmp_path / "nothing", tmp_path / "x")


def test_export_writes_the_runs_dtype(trained, tmp_path):
    """Checkpoints hold the fp32 masters; a bf16 run exports bf16 (`--dtype auto`, from the
    iteration's config.yaml), as the published Qwen weights are: every floating tensor is the bf16
    rounding of its master, the file half the size, config.json says bfloat16, and from_pretrained
    loads bf16 weights (RoPE's frequencies, not saved, stay fp32). A float32 run is copied byte for
    byte (the test above: the trainer's log-probs exactly)."""
    import shutil

    import yaml
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from postrl.cli import main

    iteration = tmp_path / "iter_0000002"  # the iteration as a bf16 run would have written it
    shutil.copytree(trained["ckpts"] / "iter_0000002", iteration)
    run = yaml.safe_load((iteration / "config.yaml").read_text())
    run["model"]["dtype"] = "bfloat16"
    (iteration / "config.yaml").write_text(yaml.safe_dump(run))
    out = tmp_path / "bf16"
    assert main(["export", str(iteration), str(out)]) == 0
    masters, weights = load_file(iteration / "model/model.safetensors"), load_file(out / "model.safetensors")
    assert masters.keys() == weights.keys() and {t.dtype for t in masters.values()} == {torch.float32}
    for name, master in masters.items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], master.to(torch.bfloat16)), name
    size = (out / "model.safetensors").stat().st_size / (iteration / "model/model.safetensors").stat().st_size
    assert 0.49 < size < 0.51
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16 and model.model.rotary_emb.inv_freq.dtype == torch.float32
    # --dtype names one: back to float32 here (the bf16 values, widened), whatever the run used.
    assert main(["export", str(out), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert {t.dtype for t in load_file(tmp_path / "fp32/model.safetensors").values()} == {torch.float32}


VLLM_SCRIPT = """
import json, sys
try:
    import vllm
except Exception as exc:  # noqa: BLE001
    print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
llm = vllm.LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
               enable_chunked_prefill=False, max_num_batched_tokens=4096, max_num_seqs=16,
               logprobs_mode="processed_logprobs", seed=0)
prompts = json.loads(sys.argv[2])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3))
print(json.dumps([[list(o.outputs[0].token_ids), [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]]
                  for o in outs]))
"""


@pytest.mark.slow
def test_vllm_loads_the_export_directly(trained, tmp_path):
    """vllm.LLM(model=<export>) reads the real weights (no postrl code involved) and samples with the log-probs
    the trainer computes for the same tokens (fp32, 1e-4 as in test_vllm_engine.py)."""
    out = checkpoint.export(trained["ckpts"], tmp_path / "exported")
    tr = trained["trainer"]
    prompts = [e.prompt_ids for e in tr.run.val_sets["arithmetic"][:3]]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(out), json.dumps(prompts)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if isinstance(result, dict):
        pytest.skip(f"vLLM is unavailable here: {result['unavailable']}")
    t = build_sequences(prompts, [tokens for tokens, _ in result], tr.tokenizer.pad_token_id)
    mask = t["response_mask"].bool()
    vllm_logp = torch.zeros_like(t["response_mask"], dtype=torch.float32)
    for i, (_, logps) in enumerate(result):
        vllm_logp[i, : len(logps)] = torch.tensor(logps)
    torch.testing.assert_close(vllm_logp[mask], masked_logprobs(tr.model, t)[mask], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------- evaluation


def test_pass_at_k_is_the_unbiased_estimator():
    # 4 samples, 1 right: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(6) == [1, 2, 4, 6]


def _eval_cli(capsys, *args: str) -> dict[str, float]:
    from postrl.cli import main

    capsys.readouterr()
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_postrl_eval_reports_the_trainers_validation(trained, capsys):
    """Same checkpoint, same numbers: `postrl eval` of iteration 1 and 2 equals what the trainer logged."""
    rows = read_jsonl(trained["run"] / "metrics.jsonl")
    logged = {1: next(r for r in rows if r["step"] == 1 and "val/arithmetic/acc_mean@4" in r)}
    logged[2] = next(r for r in rows if r["step"] == 2 and "val/arithmetic/acc_mean@4" in r)
    for step in (1, 2):
        assert 0 < logged[step]["val/arithmetic/acc_mean@4"] < 1  # mean@4 and pass@k are not trivial here
    ck1 = trained["ckpts"] / "iter_0000001"
    by_checkpoint = _eval_cli(capsys, str(ck1))  # the checkpoint with its own resolved config
    by_config = _eval_cli(capsys, str(ck1 / "config.yaml"), "--model", str(trained["ckpts"]))  # root -> iter 2
    for step, got in ((1, by_checkpoint), (2, by_config)):
        want = {k: v for k, v in logged[step].items() if k.startswith("val/")}
        assert set(got) == set(want) == {
            "val/arithmetic/acc_mean@4", "val/arithmetic/pass@1", "val/arithmetic/pass@2", "val/arithmetic/pass@4",
            "val/arithmetic/score_mean", "val/arithmetic/response_length_mean",
        }  # fmt: skip
        assert got == want, step
    assert by_checkpoint != by_config  # the two iterations differ, so the equality above means something


def _safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))
