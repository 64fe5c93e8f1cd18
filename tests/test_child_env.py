"""Child processes start from the allowlisted environment (children.py, DESIGN.md section 13): with
HF_TOKEN and a cloud key in the trainer's environment and a Hugging Face token file in its HOME, a verifier
pool worker (a real spawned process) sees neither, finds the caches by path, and gets the names the user listed;
the pool replicas' Ray runtime environment blanks every other name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def env_probe(completion: str, ground_truth: str, row: dict) -> dict:
    """A verifier that reports what its process sees (runs in the verifier pool's worker)."""
    import huggingface_hub

    home = Path(os.environ.get("HOME", "/nonexistent"))
    return {"score": 1.0, "hf_token": float("HF_TOKEN" in os.environ), "aws": float("AWS_SECRET_ACCESS_KEY" in os.environ),
            "token_file": float((home / ".cache" / "huggingface" / "token").exists()),
            "hub_token": float(huggingface_hub.get_token() is not None), "home_moved": float(str(home) != row["home"]),
            "listed": float(os.environ.get("MY_VERIFIER_KEY") == "listed"),
            "hub_cache": float(os.environ.get("HF_HUB_CACHE") == row["hub_cache"]),
            "threads": float(os.environ.get("OMP_NUM_THREADS") == "1")}  # fmt: skip


@pytest.fixture
def trainer_secrets(tmp_path, monkeypatch) -> Path:
    """The trainer's environment as a user's often is: tokens in variables, a token file under HOME."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_secret_from_file")
    for name, value in {"HF_TOKEN": "hf_secret", "AWS_SECRET_ACCESS_KEY": "aws_secret", "HOME": str(home),
                        "MY_VERIFIER_KEY": "listed", "OMP_NUM_THREADS": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def test_a_verifier_worker_sees_no_token_and_an_empty_home(trainer_secrets):
    from postrl.rewards.pool import Call, VerifierPool

    pool = VerifierPool(1, 60.0, passthrough=("MY_VERIFIER_KEY",))
    try:
        row = {"hub_cache": str(trainer_secrets / ".cache" / "huggingface" / "hub"), "home": str(trainer_secrets)}
        (out,) = pool.run([Call(env_probe, "x", "1", row)])
    finally:
        pool.close()
    assert out.status == "ok", out
    assert out.result.metrics == {"hf_token": 0.0, "aws": 0.0, "token_file": 0.0, "hub_token": 0.0, "home_moved": 1.0, "listed": 1.0,
                                  "hub_cache": 1.0, "threads": 1.0, "acc": 1.0}  # fmt: skip
    # and without the listing, the user's name stays behind too
    pool = VerifierPool(1, 60.0)
    try:
        (out,) = pool.run([Call(env_probe, "x", "1", row)])
    finally:
        pool.close()
    assert out.result.metrics["listed"] == 0.0 and out.result.metrics["hf_token"] == 0.0


def test_the_rollout_processes_keep_engine_settings_but_no_credential(trainer_secrets, monkeypatch):
    from postrl.children import child_env
    from postrl.checks import load_config
    from postrl.placement.pool import _runtime_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_API_KEY", "vllm_secret")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "reward.env_passthrough=[MY_VERIFIER_KEY]"])
    env = child_env(["MY_VERIFIER_KEY"], rollout=True)
    assert (env["VLLM_ENABLE_V1_MULTIPROCESSING"], env["CUDA_VISIBLE_DEVICES"], env["MY_VERIFIER_KEY"]) == ("0", "1", "listed")
    assert not {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "VLLM_API_KEY", "HF_HOME"} & set(env)
    assert env["HOME"] != str(trainer_secrets) and not os.path.exists(os.path.join(env["HOME"], ".cache", "huggingface", "token"))
    assert env["HF_HUB_CACHE"] == str(trainer_secrets / ".cache" / "huggingface" / "hub")
    assert env["PYTHONUSERBASE"] == str(trainer_secrets / ".local")  # user-site packages stay found
    blanked = _runtime_env(cfg)["env_vars"]  # what a replica's Ray worker process starts with
    assert blanked["HF_TOKEN"] == blanked["AWS_SECRET_ACCESS_KEY"] == blanked["VLLM_API_KEY"] == ""
    assert not {"PATH", "VLLM_ENABLE_V1_MULTIPROCESSING", "CUDA_VISIBLE_DEVICES", "MY_VERIFIER_KEY"} & set(blanked)


def test_a_passthrough_name_that_is_not_a_variable_name_is_refused_by_check_config():
    from postrl.checks import load_config
    from postrl.errors import UserError

    for key in ("reward.env_passthrough", "rollout.agent_env_passthrough"):
        with pytest.raises(UserError, match="not the name of an environment variable"):
            load_config(None, ["model.path=builtin:tiny-qwen2", f"{key}=['MY KEY=1']"])


def _report() -> float:
    """Write what this process sees to $PROBE_OUT/<pid>.json (PROBE_OUT passes as a listed name)."""
    import json

    import huggingface_hub

    home = Path(os.environ.get("HOME", "/nonexistent"))
    seen = {"hf_token": "HF_TOKEN" in os.environ, "aws": "AWS_SECRET_ACCESS_KEY" in os.environ,
            "token_file": (home / ".cache" / "huggingface" / "token").exists(), "hub_token": huggingface_hub.get_token() is not None,
            "started_with": b"hf_secret" in Path("/proc/self/environ").read_bytes()}  # the environment its process was exec'd with
    (Path(os.environ["PROBE_OUT"]) / f"{os.getpid()}.json").write_text(json.dumps(seen))
    return 1.0


# Not importable by name (a lambda), so the registry runs it in the calling process: the rollout worker itself.
in_rollout_process = lambda completion, ground_truth, row: _report()  # noqa: E731


@pytest.mark.slow
def test_the_rollout_worker_itself_sees_no_token_and_no_token_file(trainer_secrets, tmp_path, monkeypatch):
    """A real async run (one step): a verifier that runs in the rollout worker's own process reports what that
    process sees; with HF_TOKEN, a cloud key and a token file under the trainer's HOME, it sees none, while the
    name listed in reward.env_passthrough reaches it. ~25 s."""
    import json

    from conftest import tiny_overrides

    from postrl.checks import load_config
    from postrl.trainer import Trainer

    out = tmp_path / "probe"
    out.mkdir()
    monkeypatch.setenv("PROBE_OUT", str(out))
    cfg = load_config(None, tiny_overrides(tmp_path, "rollout.mode=async", "train.total_steps=1", "reward.env_passthrough=[PROBE_OUT]",
                                           "reward.verifiers=[test_child_env:in_rollout_process]"))  # fmt: skip
    Trainer(cfg).fit()
    reports = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    assert reports and os.getpid() not in reports  # it ran in the worker, not here
    # (a process that multiprocessing spawned was exec'd with the trainer's environment: it scrubs its own at once)
    assert all({**r, "started_with": False} == CLEAN for r in reports.values()), reports


CLEAN = {"hf_token": False, "aws": False, "token_file": False, "hub_token": False, "started_with": False}


@pytest.mark.slow
def test_a_pool_replica_starts_without_the_trainers_token(trainer_secrets, tmp_path, monkeypatch):
    """A real pool run (one step, one replica, on a local Ray cluster that the run starts from this environment, so
    its raylet holds HF_TOKEN): the replica's process was started without it (its Ray runtime environment blanks
    every name outside the allowlist) and sees no token file. ~40 s."""
    import json

    from conftest import tiny_overrides

    from postrl.checks import load_config
    from postrl.local_cluster import import_ray
    from postrl.trainer import Trainer

    ray = import_ray(None)  # as the pool imports it: a cluster of the run's own, on loopback
    if ray.is_initialized():
        pytest.skip("a Ray cluster of another test is running in this process")
    out = tmp_path / "probe"
    out.mkdir()
    monkeypatch.setenv("PROBE_OUT", str(out))
    cfg = load_config(None, tiny_overrides(tmp_path, "rollout.placement=pool", "rollout.pool.replicas=1", "train.total_steps=1",
                                           "reward.env_passthrough=[PROBE_OUT]", "reward.verifiers=[test_child_env:in_rollout_process]"))  # fmt: skip
    try:
        Trainer(cfg).fit()
    finally:
        ray.shutdown()
        # Ray caches the cluster's auth token of this HOME (the fake one) for the process: a later test's cluster in this
        # worker, under the real HOME, would be refused with it (InvalidAuthToken)
        from ray._private.authentication_test_utils import reset_auth_token_state

        reset_auth_token_state()
    reports = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    assert reports and os.getpid() not in reports
    assert all(r == CLEAN for r in reports.values()), reports
