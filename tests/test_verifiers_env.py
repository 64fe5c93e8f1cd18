"""`verifiers` environments as the rollout (agents/verifiers/env.py + worker.py).

The environment runs in its own process with an interpreter that has verifiers 0.1.x: `make setup` builds the
side venv `.venv-verifiers` at the repository root (POSTRL_VERIFIERS_PYTHON overrides the path); without it the
tests that need it skip, and say why.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from test_agents import tokenizer  # noqa: F401 - the module's fixture (the tiny tools model's tokenizer)

ROOT = Path(__file__).resolve().parents[1]
VF_PYTHON = os.environ.get("POSTRL_VERIFIERS_PYTHON") or str(ROOT / ".venv-verifiers" / "bin" / "python")
needs_vf = pytest.mark.skipif(
    not Path(VF_PYTHON).exists(),
    reason=f"no verifiers side venv at {VF_PYTHON} (make setup builds it; or set POSTRL_VERIFIERS_PYTHON)",
)
EXAMPLE = ROOT / "examples/verifiers_calculator"


def _example_cfg(tmp_path, *extra: str):
    """examples/verifiers_calculator/ with tiny_tool_dapo's settings, shortened: the random tiny tools model, HF
    rollout, 2 steps of 2 prompts x 2 samples, validation before and after on 4 prompts."""
    from postrl.checks import load_config

    return load_config(EXAMPLE / "tiny_tool_dapo_verifiers.yaml", [
        "model.path=builtin:tiny-qwen2-tools", "rollout.engine=hf", "rollout.n_samples_per_prompt=2", "rollout.max_tokens=16",
        f"rollout.environment=verifiers:{EXAMPLE}/calculator_env.py", f"rollout.environment_python={VF_PYTHON}",
        "rollout.environment_args.train_size=64", "rollout.environment_args.eval_size=8", "rollout.agent_concurrency=8",
        "algorithm.filter_groups.enable=false", "algorithm.overlong_buffer.len=4", "train.global_batch_size=2", "train.gen_batch_size=2",
        "train.micro_batch_size=4", "train.total_steps=2", "train.warmup_steps=0", "eval.freq=0", "eval.max_prompts=4", "eval.max_tokens=16",
        f"logging.dir={tmp_path}", "logging.progress=false", "checkpoint.keep_best=null", "checkpoint.save_final=false", *extra,
    ])  # fmt: skip


@needs_vf
def test_the_verifiers_calculator_trains_two_steps_and_logs_its_rubric_reward(tmp_path):
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    cfg = _example_cfg(tmp_path)
    assert cfg.data.train_files == ["verifiers:train"] and cfg.data.val_files == ["verifiers:eval"]
    assert [v.weight for v in cfg.reward.verifiers] == [0.0] and cfg.algorithm.filter_groups.metric == "score"
    Trainer(cfg).fit()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "reward/rubric" in r]
    assert len(steps) == 2
    for r in steps:  # 2 prompts x 2 samples per step, each scored by the rubric (ToolEnv adds its monitors)
        assert (r["rubric/scored"], r["rubric/failed"], r["rubric/function_errors"], r["agent/errors"]) == (4, 0, 0, 0)
        assert 0.0 <= r["reward/rubric"] <= 1.0 and "rubric/correct_answer" in r and "rubric/num_turns" in r
        assert r["rubric/correct_answer"] == r["reward/rubric"]  # the rubric's one weighted function
        assert 1 <= r["agent/requests_mean"] <= r["rubric/num_turns"]  # a turn past the token budget asks no engine
        assert r["response_length/mean"] > 0  # the endpoint's sampled tokens are trained on
    assert len([r for r in rows if "val/calculator_env/score_mean" in r]) == 2  # eval_dataset validates


def test_config_errors_are_one_paragraph_each(tmp_path):
    from postrl.checks import load_config
    from postrl.config import RolloutConfig
    from postrl.errors import UserError

    base = ["model.path=builtin:tiny-qwen2-tools", f"logging.dir={tmp_path}"]
    for extra, words in (
        (["rollout.environment=wordle"], "not of the form 'verifiers:"),
        (["rollout.environment=verifiers:wordle", "rollout.agent=x.py:run"], "rollout.environment and rollout.agent"),
        (["rollout.environment=verifiers:wordle", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[builtin:calculator]"],
         "rollout.environment and rollout.multi_turn.enable"),
    ):  # fmt: skip
        with pytest.raises(UserError) as err:
            load_config(EXAMPLE / "tiny_tool_dapo_verifiers.yaml", base + extra)
        assert words in str(err.value) and "Fix:" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not of the form 'verifiers:"):
        RolloutConfig(environment="verifiers: ")


def test_an_interpreter_without_verifiers_is_named_with_the_fix(tmp_path):
    import importlib.util
    import sys

    from postrl.agents.verifiers.python import interpreter_problems

    (missing,) = interpreter_problems(str(tmp_path / "nope/bin/python"))
    assert "does not exist" in missing and "postrl[verifiers]" in missing
    if importlib.util.find_spec("verifiers") is None:  # postrl's own venv: verifiers lives in the side venv
        (without,) = interpreter_problems(sys.executable)
        assert "cannot import verifiers" in without and "rollout.environment_python" in without
    if Path(VF_PYTHON).exists():
        assert interpreter_problems(VF_PYTHON) == []


QUESTION = [{"role": "user", "content": "What is 347 * 28 + 1205?"}]


def _engine(tokenizer, turns, environment, **cfg):
    from postrl.agents.verifiers.env import make_verifiers_engine
    from postrl.config import RolloutConfig
    from test_agents import ScriptEngine

    rollout = RolloutConfig(environment=f"verifiers:{environment}", environment_python=VF_PYTHON, agent_timeout_s=60, **cfg)
    return make_verifiers_engine(ScriptEngine(tokenizer, turns), tokenizer, rollout)


@needs_vf
def test_the_rubric_scores_what_the_environments_tool_loop_did_through_the_endpoint(tokenizer):
    """The calculator ToolEnv, a scripted policy (a calculator call, then the boxed result): the environment runs
    the tool and sends its result back, the rubric pays the right number; the endpoint records one segment of
    model tokens (mask 1) around the tool's (mask 0)."""
    from postrl.rollout.base import SamplingParams
    from test_agents import _call, _ids

    script = [_call("347 * 28 + 1205", ""), "\\boxed{10921}<|im_end|>"]
    gw = _engine(tokenizer, script, EXAMPLE / "calculator_env.py", agent_batch_wait_ms=10_000)  # one engine call per turn
    rows = [{"prompt": QUESTION, "reward_model": {"ground_truth": truth}} for truth in ("10921", "10922")]  # rows of a file
    try:
        out = gw.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=200, n=2, seed=0), rows=rows)
        m = gw.pop_metrics()
    finally:
        gw.close()
    assert [c.env_reward for c in out] == [1.0, 1.0, 0.0, 0.0]  # the rubric's reward: right, right, wrong truth x2
    model_ids = _ids(tokenizer, script[0]) + _ids(tokenizer, script[1])
    for c in out:
        assert c.segments is None and len(c.turn_spans) == 2 and c.tool_calls == 1 and c.finished
        assert sum(c.loss_mask) == len(model_ids) and [t for t, k in zip(c.token_ids, c.loss_mask) if k] == model_ids
        assert "10921" in tokenizer.decode([t for t, k in zip(c.token_ids, c.loss_mask) if not k])  # the tool's answer
    assert (m["reward/rubric"], m["rubric/correct_answer"], m["rubric/scored"]) == (0.5, 0.5, 4)
    assert (m["rubric/num_turns"], m["rubric/calculator_calls"], m["rubric/failed"], m["agent/errors"]) == (2.0, 1.0, 0, 0)
    assert m["agent/segments_mean"] == 1.0 and m["agent/requests_mean"] == 2.0


FLAKY = """
import verifiers as vf
from datasets import Dataset


def rubric(completion, answer, info):
    if info.get("mode") == "rubric":
        raise ValueError("the rubric is broken")
    return {"nan": float("nan"), "huge": 1e300}.get(info.get("mode"), 1.0)


class Env(vf.SingleTurnEnv):
    async def setup_state(self, state):
        if state["info"].get("mode") == "raise":
            raise KeyError("the environment is broken")


def load_environment(load="ok"):
    if load == "fail":
        raise RuntimeError("cannot load me")
    return Env(dataset=Dataset.from_list([{"question": "q", "answer": "1"}]), rubric=vf.Rubric(funcs=[rubric]))
"""


@needs_vf
def test_a_failing_environment_is_contained_and_counted_and_a_broken_one_stops_with_exit_2(tmp_path, tokenizer):
    """A rollout that raises in the environment, a rubric function that raises, the environment's process killed:
    each sample scores 0 and is counted, the run goes on (the process restarts). An environment whose
    load_environment raises stops the run before any rollout (a UserError: one paragraph, exit 2)."""
    import subprocess
    import sys

    from postrl.errors import UserError
    from postrl.rollout.base import SamplingParams

    env = tmp_path / "flaky_env.py"
    env.write_text(FLAKY)
    gw = _engine(tokenizer, ["\\boxed{1}<|im_end|>"] * 4, env)  # whichever way the requests are batched
    rows = [{"prompt": QUESTION, "extra_info": {"verifiers": {"prompt": QUESTION, "answer": "1", "info": {"mode": mode}, "example_id": i}}}
            for i, mode in enumerate(("ok", "raise", "rubric", "ok", "nan", "huge"))]  # fmt: skip
    try:
        out = gw.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=50, n=1, seed=0), rows=rows[:3])
        m = gw.pop_metrics()
        assert [c.env_reward for c in out] == [1.0, 0.0, 0.0]
        assert (m["agent/errors"], m["rubric/failed"], m["rubric/scored"], m["rubric/function_errors"]) == (1, 1, 2, 1)
        assert m["reward/rubric"] == 0.5 and sum(out[1].loss_mask) == 0  # the failed sample trains nothing
        # a reward out of range (NaN, 1e300) is that sample's error, counted; the process and the run go on
        out = gw.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=50, n=1, seed=0), rows=rows[3:])
        m = gw.pop_metrics()
        assert [c.env_reward for c in out] == [1.0, 0.0, 0.0] and [sum(c.loss_mask) > 0 for c in out] == [True, False, False]
        assert (m["agent/errors"], m["rubric/failed"], m["rubric/scored"], m["reward/rubric"]) == (2, 2, 1, 1.0)
        assert gw.agent.worker.alive
        gw.agent.worker.proc.kill()  # the environment's process dies: the next samples start a new one
        gw.agent.worker.proc.wait()
        out = gw.generate([[1, 2, 3]], SamplingParams(max_tokens=50, n=1, seed=0), rows=rows[:1])
        m = gw.pop_metrics()
        assert [c.env_reward for c in out] == [1.0] and (m["rubric/worker_restarts"], m["rubric/scored"]) == (1, 1)
    finally:
        gw.close()

    from postrl.agents.verifiers.env import VerifiersAgent
    from postrl.config import RolloutConfig

    with pytest.raises(UserError) as err:
        VerifiersAgent(RolloutConfig(environment=f"verifiers:{env}", environment_args={"load": "fail"}, environment_python=VF_PYTHON))
    assert "did not load: RuntimeError: cannot load me" in str(err.value) and "Fix:" in str(err.value)
    cli = subprocess.run(  # an interpreter without verifiers, through the CLI: one paragraph, exit 2, no traceback
        [sys.executable, "-m", "postrl.cli", "check-config", str(EXAMPLE / "tiny_tool_dapo_verifiers.yaml"), "model.path=builtin:tiny-qwen2-tools",
         f"rollout.environment_python={tmp_path}/no/python"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=300,
    )  # fmt: skip
    said = " ".join((cli.stdout + cli.stderr).split())  # the console wraps lines
    assert cli.returncode == 2 and "1 problem(s)" in said and "rollout.environment_python" in said and "Traceback" not in said


HOSTILE_ENV = """
import gc, io, json, os, stat, struct
import verifiers as vf
from datasets import Dataset


class Env(vf.SingleTurnEnv):
    async def setup_state(self, state):
        if state["info"].get("mode") == "bad_frame":  # code in the environment writes onto postrl's channel
            (out,) = [f for f in gc.get_objects() if isinstance(f, io.BufferedWriter) and not f.closed and f.fileno() > 2
                      and stat.S_ISFIFO(os.fstat(f.fileno()).st_mode)]
            out.write(struct.pack("!i", 16) + b"this is not JSON")  # a whole frame, of garbage
            out.flush()


def load_environment(env_out=None):
    if env_out:
        with open(env_out, "w") as f:
            json.dump(dict(os.environ), f)
    return Env(dataset=Dataset.from_list([{"question": "q", "answer": "1"}]), rubric=vf.Rubric(funcs=[lambda completion: 1.0]))
"""


@needs_vf
@pytest.mark.slow  # two environment processes start (~70 s on 2 loaded cores)
def test_the_environment_process_starts_scrubbed_and_a_bad_frame_from_it_is_counted_and_restarts_it(tmp_path, tokenizer, monkeypatch):
    """The environment's process gets the allowlist plus rollout.agent_env_passthrough, not the trainer's secrets;
    a frame that breaks the protocol kills it: its sample scores 0 (counted), the next sample starts a new one."""
    import json

    from postrl.rollout.base import SamplingParams

    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("WANDB_API_KEY", "wb_x")
    monkeypatch.setenv("MY_SERVICE_KEY", "listed")
    env, seen = tmp_path / "hostile_env.py", tmp_path / "env.json"
    env.write_text(HOSTILE_ENV)
    gw = _engine(tokenizer, ["\\boxed{1}<|im_end|>"] * 4, env, environment_args={"env_out": str(seen)}, agent_env_passthrough=["MY_SERVICE_KEY"])
    rows = [{"prompt": QUESTION, "extra_info": {"verifiers": {"prompt": QUESTION, "answer": "1", "info": {"mode": mode}, "example_id": 0}}}
            for mode in ("bad_frame", "ok")]  # fmt: skip
    try:
        environ = json.loads(seen.read_text())
        first = gw.agent.worker
        (bad,) = gw.generate([[1, 2, 3]], SamplingParams(max_tokens=50, n=1, seed=0), rows=rows[:1])
        m = gw.pop_metrics()
        assert bad.env_reward == 0.0 and (m["agent/errors"], m["rubric/failed"]) == (1, 1)
        assert "not JSON" in first.bad_frame and first.proc.poll() is not None
        (ok,) = gw.generate([[1, 2, 3]], SamplingParams(max_tokens=50, n=1, seed=0), rows=rows[1:])
        m = gw.pop_metrics()
        assert ok.env_reward == 1.0 and (m["rubric/worker_restarts"], m["rubric/scored"], m["agent/errors"]) == (1, 1, 0)
    finally:
        gw.close()
    assert "HF_TOKEN" not in environ and "WANDB_API_KEY" not in environ
    assert environ["MY_SERVICE_KEY"] == "listed" and environ["PATH"] == os.environ["PATH"]


def test_the_environment_channel_refuses_long_cut_short_and_garbage_frames_and_other_shapes(monkeypatch):
    import json
    import struct

    from postrl.agents.verifiers import env as vf_env
    from postrl.agents.verifiers.env import MAX_REPLY_BYTES, FrameError, check_reply, read_reply

    def reply(data: bytes, close: bool = True):
        r, w = os.pipe()  # the environment's stdout as postrl reads it: a pipe
        try:
            os.write(w, data)
            if close:
                os.close(w)
            return read_reply(r)
        finally:
            os.close(r)
            if not close:
                os.close(w)

    assert reply(struct.pack("!i", 9) + b'{"id": 1}') == ({"id": 1}, 9) and reply(b"") == (None, 0)
    for data in (struct.pack("!i", MAX_REPLY_BYTES + 1), b"\xff\xfe\xfd\xfc", struct.pack("!i", 2) + b"\xff\xfe",
                 struct.pack("!i", 130) + b"[" * 65 + b"]" * 65, struct.pack("!i", 8) + b"not json"):  # fmt: skip
        with pytest.raises(FrameError):
            reply(data)
    monkeypatch.setattr(vf_env, "FRAME_TIMEOUT_S", 0.05)  # a frame begun, then nothing: the process hangs mid-frame
    with pytest.raises(FrameError, match="cut short"):
        reply(struct.pack("!i", 10) + b"{", close=False)
    assert reply(struct.pack("!i", 10) + b"{") == (None, 0)  # the process died mid-frame: its end, reported as its death
    good = {"id": 2, "reward": 1.0, "metrics": {"m": 0.5}, "error": None, "rubric_errors": 0}
    check_reply("rollout", good)
    check_reply("rollout", {"id": 2, "exception": "ValueError: x"})
    check_reply("dataset", {"id": 1, "rows": [{"prompt": "q"}], "more": False})
    for op, bad in (
        ("rollout", [1, 2]), ("rollout", {**good, "id": "2"}), ("rollout", {**good, "reward": "1"}), ("rollout", {**good, "reward": True}),
        ("rollout", {**good, "metrics": {"m": [1]}}), ("rollout", {**good, "error": 3}),
        ("rollout", {"id": 2, "exception": {"a": 1}}), ("dataset", {"id": 1, "rows": "abc"}), ("dataset", {"id": 1, "rows": [1]}),
    ):  # fmt: skip
        with pytest.raises(FrameError):
            check_reply(op, json.loads(json.dumps(bad)))
    for value in ({**good, "reward": 10**400}, {**good, "reward": math.nan}, {**good, "metrics": {"m": math.inf}}):
        check_reply("rollout", value)  # of the shape: its values are the sample's business (VerifiersAgent.run)


def test_the_worker_speaks_postrls_frames_without_postrl_installed():
    """worker.py loads postrl/ipc.py by its path, in an interpreter that cannot import postrl (no site-packages):
    the frames it writes are the ones postrl reads, and the channel's refusals are the same FrameError."""
    import subprocess
    import sys

    from postrl import ipc

    code = (
        "import runpy, sys\n"
        f"w = runpy.run_path({str(ROOT / 'src/postrl/agents/verifiers/worker.py')!r})\n"
        "assert 'postrl' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "sys.stdout.buffer.write(w['ipc'].encode({'op': 'ready', 'env_id': 'x', 'group_rubric': False}))\n"
        "try:\n    w['ipc'].loads(b'not json')\nexcept w['ipc'].FrameError as exc:\n    print(exc, file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr.decode()
    assert ipc.loads(out.stdout[4:]) == {"op": "ready", "env_id": "x", "group_rubric": False}
    assert ipc.HEADER.unpack(out.stdout[:4]) == (len(out.stdout) - 4,) and b"not JSON" in out.stderr


@needs_vf
def test_an_environment_whose_every_rollout_errors_stops_after_that_batch_with_the_first_error(tokenizer, tmp_path):
    """Every model request refused (the prompt past a 4-token context): verifiers records the error in each rollout
    and its rubric still scores them; the batch stops the run with the first error and the fix."""
    from postrl.agents.verifiers.env import make_verifiers_engine
    from postrl.config import RolloutConfig
    from postrl.errors import UserError
    from postrl.rollout.base import SamplingParams
    from test_agents import ScriptEngine

    env = tmp_path / "hostile_env.py"
    env.write_text(HOSTILE_ENV)
    rollout = RolloutConfig(environment=f"verifiers:{env}", environment_python=VF_PYTHON, agent_timeout_s=60)
    gw = make_verifiers_engine(ScriptEngine(tokenizer, ["\\boxed{1}<|im_end|>"] * 4), tokenizer, rollout, max_model_len=4)
    rows = [{"prompt": QUESTION, "extra_info": {"verifiers": {"prompt": QUESTION, "answer": "1", "info": {}, "example_id": 0}}}]
    try:
        with pytest.raises(UserError) as err:
            gw.generate([[1, 2, 3]], SamplingParams(max_tokens=50, n=4, seed=0), rows=rows)
        m = gw.pop_metrics()
    finally:
        gw.close()
    said = str(err.value)
    assert "in 4 of the 4 rollouts of this batch" in said and "context is 4" in said and "Fix" in said and "\n" not in said, said
    assert (m["rubric/rollout_errors"], m["rubric/scored"], m["agent/errors"]) == (4, 4, 4)  # never called the model: errors
