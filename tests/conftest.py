"""Shared fixtures and helpers: the tiny model (built once per cache), the tiny run (its overrides, config and Trainer),
`postrl` run as a user runs it in a child process, and test-only user verifiers on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Test verifiers live in tests/verifiers_for_tests.py and are named 'verifiers_for_tests:fn', as a
# user would name theirs; worker processes find them through PYTHONPATH.
sys.path.insert(0, str(TESTS))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray reads this at import (a single-machine cluster, loopback only); postrl sets it before it imports ray, but a test
# module that imports a library importing ray first (the Tinker cookbook's dependencies) would leave a later test's
# local cluster on the LAN address, which local_cluster refuses. Set it for every worker before any import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Tiny models gain nothing from a second intra-op thread, and with verifier workers, vLLM and
# subprocess tests beside them two threads per process oversubscribe a 2-core machine badly
# (measured: a 3-step run took 82 s with 2 threads under load, 5 s with 1).
os.environ["OMP_NUM_THREADS"] = "1"


# The files that hold the suite's longest tests (see `pytest --durations`), run first: with two workers
# (`make test`, files kept whole) the quick files then fill in around them instead of one long file running alone
# at the end.
FIRST = ("test_learning.py", "test_learning_tools.py", "test_critic.py", "test_gpu_check.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first; tests marked `gpu` are skipped, not failed, where CUDA is absent."""
    import torch

    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker itself, not `"gpu" in item.keywords`: keywords hold the names of the parent
        # directories too, so a checkout in a folder named gpu would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """CI's log counts the sandbox's containment tests that could not run on this machine (test_sandbox.py
    probes at collection; the -ra lines above give each reason)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "containment: " in str(r.longrepr)]
    if skipped:
        reasons = sorted({str(r.longrepr[2]).split("containment: ", 1)[-1] for r in skipped if isinstance(r.longrepr, tuple)})
        terminalreporter.write_line(f"containment: {len(skipped)} tests could not run here: {'; '.join(reasons)}")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tiny runs: on a shared 2-core machine, two spinning threads make
    them ~10x slower. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from postrl.builtin.tiny import build_tiny_model

    return str(build_tiny_model())


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(directory)` run once per test session, by whichever test worker (`make test` runs two) asks first;
    the others wait on a lock and reuse what it wrote. The directory is under the session's shared base temp."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one per worker under xdist
    out, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory) -> Path:
    """The `make run` SFT stage, whole (configs/tiny_sft.yaml): the warm start of the learning tests (DAPO, GRPO,
    LoRA, PPO, the reward model's and the judge's), trained once per session."""
    from postrl.checks import load_config
    from postrl.sft import run_sft

    def build(out: Path) -> None:
        configs = TESTS.parent / "configs"
        run_sft(load_config(configs / "tiny_sft.yaml", ["sft.eval_prompts=0", f"sft.output_dir={out}", f"logging.dir={out}"]))

    return built_once(tmp_path_factory, "sft", build) / "model"


def tiny_overrides(tmp_path: Path, *extra: str) -> list[str]:
    """Overrides for a fast trainer run on the random-init tiny model."""
    return [
        "model.path=builtin:tiny-qwen2",
        "rollout.engine=hf",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_tokens=12",
        "data.builtin.train_size=200",
        "data.builtin.val_size=16",
        "train.global_batch_size=4",
        "train.micro_batch_size=8",
        "train.total_steps=3",
        "eval.before_train=false",
        "eval.after_train=false",
        "logging.progress=false",
        f"logging.dir={tmp_path / 'run'}",
        "checkpoint.save_final=false",
        *extra,
    ]


AGENT_RECIPE = TESTS.parent / "examples/openai_agent/tiny_tool_dapo_agent.yaml"


def tiny_agent_overrides(run_dir: Path, program: str, *extra: str) -> list[str]:
    """Overrides that shorten AGENT_RECIPE (the calculator task with a plain openai-client program behind postrl's
    endpoint) to 2 steps of 2 prompts x 2 samples on the random tiny tools model with HF rollout, `program`
    ('path/to/file.py:function') as rollout.agent, no dynamic sampling, no checkpoint; metrics in `run_dir`."""
    return [
        "model.path=builtin:tiny-qwen2-tools", "rollout.engine=hf", "rollout.n_samples_per_prompt=2", f"rollout.agent={program}",
        "algorithm.filter_groups.enable=false", "algorithm.overlong_buffer.len=4", "train.global_batch_size=2",
        "train.gen_batch_size=2", "train.micro_batch_size=4", "train.total_steps=2", "train.warmup_steps=0", "eval.freq=0",
        f"logging.dir={run_dir}", "logging.progress=false", "checkpoint.keep_best=null", "checkpoint.save_final=false", *extra,
    ]  # fmt: skip


def tiny_cfg(tmp_path: Path, *extra: str):
    """The tiny trainer run's config (tiny_overrides), its metrics in <tmp_path>/run/metrics.jsonl only."""
    from postrl.checks import load_config

    return load_config(None, tiny_overrides(tmp_path, "logging.sinks=[jsonl]", *extra))


def tiny_trainer(tmp_path: Path, *extra: str):
    """A Trainer on tiny_cfg that prints into a quiet console (its text: `tr.console.file.getvalue()`)."""
    from postrl.trainer import Trainer

    return Trainer(tiny_cfg(tmp_path, *extra), quiet_console())


def tiny_train_args(tmp_path: Path, *extra: str) -> list[str]:
    """`postrl train` arguments for the tiny run (tiny_overrides): a config file naming the model, written into
    `tmp_path`, and the overrides."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("model: {path: builtin:tiny-qwen2}\n")
    return ["train", str(cfg_file), *tiny_overrides(tmp_path, *extra)]


def start_postrl(*args: str, env: dict[str, str | None] | None = None, **popen) -> subprocess.Popen:
    """`postrl ARGS` started in a fresh process, as a user runs it: one torch thread, a wide console (COLUMNS=1000:
    no message is wrapped mid-phrase), `env` over this process's environment (None: the variable unset), stdout
    and stderr piped as text; `popen` adds to or replaces Popen's options (start_new_session, cwd,
    stderr=subprocess.STDOUT)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000", **(env or {})}
    options = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={k: v for k, v in env.items() if v is not None})
    return subprocess.Popen([sys.executable, "-m", "postrl.cli", *args], **{**options, **popen})


def run_postrl(*args: str, timeout: float = 600, env: dict[str, str | None] | None = None, **popen) -> subprocess.CompletedProcess:
    """`postrl ARGS` (start_postrl) run to its end: returncode, stdout, stderr. Past `timeout` seconds it is killed
    and subprocess.TimeoutExpired raised, as subprocess.run does."""
    with start_postrl(*args, env=env, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def quiet_console(width: int = 400, **options):
    """A rich Console that prints into a string instead of the terminal (read it with `.file.getvalue()`)."""
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=width, **options)


def fixed_batch(tokenizer, prompts: list[list[int]]) -> dict:
    """Three fixed responses after `prompts` (three prompt id lists), as `models.build_sequences` packs them."""
    from postrl.models import build_sequences

    responses = [tokenizer.encode(" 12 apples"), tokenizer.encode("The answer is 7."), tokenizer.encode("x")]
    return build_sequences(prompts, responses, tokenizer.pad_token_id)


def masked_logprobs(model, t: dict):
    """Response log-probs [B, T] of a `build_sequences` batch under `model` (temperature 1), 0 on padding."""
    import torch

    from postrl.models import response_logprobs

    with torch.no_grad():
        logp, _ = response_logprobs(model, t["input_ids"], t["attention_mask"], t["position_ids"], t["response_mask"].shape[1], 1.0)
    return logp * t["response_mask"]
