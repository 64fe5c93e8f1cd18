"""The reliability catalogue: each way a run goes wrong that postrl promises to handle, with its test.

Two promises (docs/reliability.md lists the cases for users):
- bad input -> exit status 2 and one paragraph per problem (what, why, how to fix), no traceback;
- a fault -> nothing lost (and a warning where data had to be skipped).

To add a case of bad input: add a `Case` to CLI_CASES. `args` is a real `postrl` command line run in a
fresh process (`python -m postrl.cli`); `{name}` in an argument is replaced by the path of a file
from the `files` fixture (add the file there). The test asserts the exit status, that each phrase is
in the output (whitespace normalised), that `absent` is not, and that no traceback is printed.
Cases that need more than one command (a file that must be torn after writing, an engine built in
this process) are written as ordinary tests below the table, named test_<case id>_<what it checks>.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_postrl

import postrl
from postrl.config import RewardConfig
from postrl.errors import UserError
from postrl.rewards import RewardFunction

SRC = Path(postrl.__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    id: str  # short name, also the row of docs/reliability.md
    args: tuple[str, ...]  # postrl command line; {name} -> path of files[name]
    exit: int  # expected exit status
    phrases: str | tuple[str, ...]  # each must appear in stdout + stderr (whitespace normalised)
    absent: str | None = None  # must not appear
    needs_missing: str | None = None  # run only where this module is not installed


TINY_RUN = (
    "model.path=builtin:tiny-qwen2", "rollout.engine=hf", "rollout.n_samples_per_prompt=4", "rollout.max_tokens=8",
    "data.builtin.train_size=16", "data.builtin.val_size=4", "train.global_batch_size=4", "train.micro_batch_size=16",
    "train.total_steps=1", "eval.before_train=false", "eval.after_train=false", "logging.progress=false",
    "logging.dir={run}", "checkpoint.save_final=false",
)  # fmt: skip

CLI_CASES = [
    # 3. a verifier that does not exist: refused by check-config, before any model is loaded
    Case("unknown-verifier", ("check-config", "{cfg}", "reward.verifiers=[math_17k_accc]"), 2,
         "unknown verifier 'math_17k_accc' (did you mean 'math_17k_acc'?)"),
    Case("user-verifier-not-importable", ("check-config", "{cfg}", "reward.verifiers=[no_such_module:score]"), 2,
         "verifier 'no_such_module:score' could not be loaded (ModuleNotFoundError"),
    # ... and reported together with the config's other problems
    Case("unknown-verifier-with-other-problems", ("check-config", "{cfg}", "reward.verifiers=[nope]", "train.lr=-1"), 2,
         "2 problem(s) in the configuration"),
    # 4. a logging sink whose package is missing: refused before the model loads, with the extra to install
    Case("sink-tensorboard-missing", ("check-config", "{cfg}", "logging.sinks=[console,tensorboard]"), 2,
         "Fix: pip install 'postrl[tensorboard]'", needs_missing="tensorboard"),
    Case("sink-wandb-missing", ("check-config", "{cfg}", "logging.sinks=[wandb]"), 2,
         "Fix: pip install 'postrl[wandb]'", needs_missing="wandb"),
    Case("sink-swanlab-missing", ("train", "{cfg}", "logging.sinks=[jsonl,swanlab]"), 2,
         "Fix: pip install 'postrl[swanlab]'", needs_missing="swanlab"),
    # a damaged weight file in the model directory: named, with the way to restore it
    Case("model-weights-damaged", ("train", "{cfg}", "model.path={damaged_model}", "logging.dir={run}"), 2,
         ("is damaged and cannot be read", "restore the model directory")),
    # 7. options anywhere among the overrides: parsed (the run then stops at the planted bad verifier)
    Case("option-after-override", ("train", "{cfg}", "train.total_steps=2", "--nproc", "2", "reward.verifiers=[nope]"), 2,
         "unknown verifier 'nope'", absent="unrecognized arguments"),
    Case("option-between-overrides", ("check-config", "{cfg}", "train.total_steps=7", "--no-path-check", "train.seed=3"), 0,
         "total_steps: 7"),
    # 6. metrics.jsonl with a bad line in the middle: an error naming file and line (a torn last line: below)
    Case("metrics-bad-middle-line", ("report", "{bad_metrics_run}"), 2,
         "metrics.jsonl line 2 is not a JSON object"),
    # 8. a JSONL with a malformed line: training stops, and says so (preprocess skips and counts instead)
    Case("jsonl-bad-line-train", ("train", "{cfg}", "data.train_files=[{bad_jsonl}]", *TINY_RUN), 2,
         ("bad.jsonl row 2: is not valid JSON", "1 malformed record(s); training stops", "Training reads every row or stops"),
         absent="other lines are read"),
    # 2. a verifier that fails on every call: an error naming it, the kind and the fix
    Case("verifier-always-times-out", ("verify", "--verifier", "verifiers_for_tests:sleeps", "--input", "{completions}",
                                       "--timeout", "0.3", "--workers", "2"), 2,
         "verifier 'verifiers_for_tests:sleeps' failed on 4 of its 4 calls in this batch; 4 ran past reward.timeout_s"),
    Case("verifier-always-raises-in-training", ("train", "{cfg}", "reward.verifiers=[verifiers_for_tests:raises]",
                                                "reward.timeout_s=2", *TINY_RUN), 2,
         "failed on 16 of its 16 calls in this batch; 16 raised an exception (counted in reward/errors), "
         "for example: ValueError: cannot parse"),
    # 5. a tokenizer without a chat template: preprocessing works, and says so once
    Case("no-chat-template", ("preprocess", "{preprocess_yaml}"), 0,
         "has no chat template, so prompt tokens are counted on prompt_type 'qwen' text"),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_path) -> dict[str, str]:
    d = tmp_path_factory.mktemp("catalogue")
    (d / "cfg.yaml").write_text("model: {path: builtin:tiny-qwen2}\nrollout: {engine: hf}\n")

    row = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}}
    (d / "bad.jsonl").write_text(json.dumps(row) + "\n" + '{"prompt": [{"role": "user", "content": "What is\n'
                                 + (json.dumps(row) + "\n") * 6)  # fmt: skip

    run = d / "bad_metrics_run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "dapo/rewards/mean": 0.5}\n{"step": 2, "dapo/rew\n{"step": 3}\n')

    (d / "completions.jsonl").write_text("".join(json.dumps({"response": f"{k}", "answer": "1"}) + "\n" for k in range(4)))

    tok = d / "tokenizer_without_template"  # the tiny model's tokenizer, its chat template removed
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model_path) / name, tok / name)
    tok_cfg = json.loads((tok / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    raw = d / "raw.jsonl"
    raw.write_text("".join(json.dumps({"question": f"{k} + 1?", "answer": f"#### {k + 1}"}) + "\n" for k in range(3)))
    (d / "pre.yaml").write_text(
        f"input: {raw}\nhandler_name: gsm8k\nprompt_type: qwen\ntokenizer_name_or_path: {tok}\n"
        f"output_prefix: {d / 'pre_out' / 'train'}\nworkers: 1\n"
    )
    damaged = d / "damaged_model"  # the tiny model with its weights cut to a third
    shutil.copytree(tiny_model_path, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    return {
        "damaged_model": str(damaged),
        "cfg": str(d / "cfg.yaml"), "bad_jsonl": str(d / "bad.jsonl"), "bad_metrics_run": str(run),
        "completions": str(d / "completions.jsonl"), "preprocess_yaml": str(d / "pre.yaml"), "run": str(d / "run"),
        "tokenizer_without_template": str(tok),
    }  # fmt: skip


def postrl_cli(*args: str) -> subprocess.CompletedProcess:
    """`postrl ARGS` in a fresh process, as a user runs it (run_postrl), importing this checkout and its test verifiers."""
    return run_postrl(*args, env={"COLUMNS": "400", "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}, timeout=300)


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_cli_case(case: Case, files):
    if case.needs_missing and importlib.util.find_spec(case.needs_missing) is not None:
        pytest.skip(f"{case.needs_missing} is installed here")
    proc = postrl_cli(*(a.format(**files) for a in case.args))
    out = " ".join((proc.stdout + "\n" + proc.stderr).split())
    assert proc.returncode == case.exit, out[-3000:]
    for phrase in [case.phrases] if isinstance(case.phrases, str) else case.phrases:
        assert phrase in out, out[-3000:]
    assert case.absent is None or case.absent not in out
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]


def test_no_chat_template_warned_once(files):
    # the catalogue row above checks the phrase; here: one line, not one per row
    proc = postrl_cli("preprocess", files["preprocess_yaml"])
    assert proc.returncode == 0
    assert (proc.stdout + proc.stderr).count("has no chat template") == 1


# ------------------------------------------------------------------- 2. silent reward failures
def test_failed_verifier_calls_counted_by_kind(caplog):
    caplog.set_level(logging.WARNING, logger="postrl.rewards")
    completions = ["ok", "sleep", "raise", "nan", "text", "ok", "raise"]
    with RewardFunction(RewardConfig(verifiers=["verifiers_for_tests:flaky"], timeout_s=0.5, workers=2)) as rf:
        out = rf(completions, ["1"] * 7, [{}] * 7)
    assert out.failures == {"reward/timeouts": 1, "reward/errors": 2, "reward/invalid": 2}
    assert out.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # failed calls score the fail score (0)
    assert out.timed_out == [False, True, False, False, False, False, False]
    warned = [r.getMessage() for r in caplog.records if r.name == "postrl.rewards"]
    assert len(warned) == 3  # once per kind, not once per call
    assert "timed out" in warned[0] and "reward/timeouts" in warned[0]
    assert "raised (ValueError: cannot parse 'raise')" in warned[1]
    assert "returned no valid score (score nan is not a finite number)" in warned[2]


@pytest.mark.parametrize(
    "verifier, kind, example",
    [
        ("sleeps", "ran past reward.timeout_s (0.3 s) (counted in reward/timeouts)", "Fix: raise reward.timeout_s (now 0.3)"),
        ("raises", "raised an exception (counted in reward/errors), for example: ValueError: cannot parse 'a'", "Fix: fix the function"),
        ("returns_nan", "returned no finite number (counted in reward/invalid), for example: score nan", "Fix: make it return a finite number"),
        ("returns_text", "returned no finite number (counted in reward/invalid), for example: score is a str ('correct')", "Fix: make it return"),
    ],
)  # fmt: skip
def test_verifier_fails_every_call_stops_the_run(verifier, kind, example):
    name = f"verifiers_for_tests:{verifier}"
    with RewardFunction(RewardConfig(verifiers=[name], timeout_s=0.3, workers=2)) as rf:
        with pytest.raises(UserError) as err:
            rf(["a", "b", "c", "d"], ["1"] * 4, [{}] * 4)
        assert f"verifier '{name}' failed on 4 of its 4 calls in this batch; 4 {kind}" in err.value.problems[0]
        assert example in err.value.problems[0]
        # 3 calls are too few to judge: counted, not fatal
        assert sum(rf(["a", "b", "c"], ["1"] * 3, [{}] * 3).failures.values()) == 3


def test_verifier_fails_every_call_weight_zero_is_counted_not_fatal():
    cfg = RewardConfig(verifiers=[{"name": "verifiers_for_tests:raises", "weight": 0}], timeout_s=2, workers=1)
    with RewardFunction(cfg) as rf:
        assert rf(["a"] * 4, ["1"] * 4, [{}] * 4).failures == {"reward/timeouts": 0, "reward/errors": 4, "reward/invalid": 0}


# --------------------------------------------------------------------- 6. torn metrics.jsonl
def test_torn_last_metrics_line_skipped_and_cut_before_appending(tmp_path):
    from postrl.metrics import MetricsLogger, read_jsonl

    run = tmp_path / "run"
    logger = MetricsLogger(run, ["jsonl"])
    logger.log(1, {"dapo/rewards/mean": 0.25, "response_length/mean": 7.0})
    logger.log(2, {"dapo/rewards/mean": 0.5, "response_length/mean": 6.0})
    logger.close()
    path = run / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 3, "dapo/rewards/me')  # killed mid-write

    proc = postrl_cli("report", str(run))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, out
    assert "skipped the torn last line 3" in out and (run / "training.png").stat().st_size > 0
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]

    logger = MetricsLogger(run, ["jsonl"])  # a resumed run appends after the torn line
    logger.log(3, {"dapo/rewards/mean": 0.75, "response_length/mean": 5.0})
    logger.close()
    assert read_jsonl(path) == [
        {"step": 1, "dapo/rewards/mean": 0.25, "response_length/mean": 7.0},
        {"step": 2, "dapo/rewards/mean": 0.5, "response_length/mean": 6.0},
        {"step": 3, "dapo/rewards/mean": 0.75, "response_length/mean": 5.0},
    ]


# ------------------------------------------------------------------ 5. no chat template (train)
def test_no_chat_template_in_training_plain_text_said_once(files, caplog):
    from transformers import AutoTokenizer

    from postrl.data.templates import render_chat

    caplog.set_level(logging.WARNING, logger="postrl.data")
    tok = AutoTokenizer.from_pretrained(files["tokenizer_without_template"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    assert render_chat(tok, messages) == tok("Be brief.\n1 + 1?", add_special_tokens=True)["input_ids"]
    assert render_chat(tok, "2 + 2?") == tok("2 + 2?", add_special_tokens=True)["input_ids"]
    warned = [r.getMessage() for r in caplog.records if r.name == "postrl.data"]
    assert len(warned) == 1
    assert f"tokenizer '{files['tokenizer_without_template']}' has no chat template, so prompts are rendered as plain text" in warned[0]
    assert "Fix: point model.tokenizer_path at a tokenizer that has one" in warned[0]


# ------------------------------------------------- 1. vLLM and model-directory code (auto_map)
@pytest.mark.slow
def test_vllm_remote_code_not_imported_without_trust(tmp_path, tiny_model_path):
    import postrl.rollout.vllm as vllm_mod
    import postrl.rollout.vllm_platform as vllm_platform

    try:
        vllm_platform.import_vllm()
    except vllm_platform.VLLMUnavailable as exc:  # pragma: no cover - machines without a working vLLM
        pytest.skip(f"vLLM is unavailable here: {exc}")
    from postrl.config import RolloutConfig
    from postrl.models import load_model, load_tokenizer

    model_dir, marker = tmp_path / "model", tmp_path / "remote_code_ran"
    shutil.copytree(tiny_model_path, model_dir)
    (model_dir / "planted_code.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen2Config\n\n\nclass PlantedConfig(Qwen2Config):\n    pass\n"
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted_code.PlantedConfig"}
    (model_dir / "config.json").write_text(json.dumps(config))

    # The planted code does run when trusted (so its absence below means something) ...
    trusted = subprocess.run(
        [sys.executable, "-c", f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model_dir)!r}, trust_remote_code=True)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert trusted.returncode == 0 and marker.read_text() == "ran", trusted.stderr[-2000:]
    marker.unlink()

    # ... and with trust_remote_code false (the default) neither the trainer's loader nor vLLM runs it.
    model, tok = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    engine = vllm_mod.VLLMEngine(model, tok, RolloutConfig(kv_cache_space_gb=0.1, max_num_seqs=8), max_model_len=64)
    assert engine.llm is not None
    assert not marker.exists()
    assert [m for m in sys.modules if m.endswith("planted_code")] == []
