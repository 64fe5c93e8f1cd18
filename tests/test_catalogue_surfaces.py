"""The reliability catalogue of the newer surfaces: agents, async, reward models, the judge, `postrl rm`, PPO.

Each case is a row of docs/reliability.md (section "Newer surfaces"), found here by its id. Bad input ends in
exit status 2 and one paragraph per problem, without a traceback; `check-config` refuses what `train` would.
The CLI cases run `postrl.cli.main` in this process (no model is loaded by any of them, so each takes well
under a second); the broken model directories hold only config.json and tokenizer files, since the model
checks (postrl.preflight) read nothing else.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from postrl import cli
from postrl.checks import load_config
from postrl.config import RewardConfig
from postrl.errors import UserError
from postrl.rewards import RewardFunction
from postrl.rewards.reward_model import ModelScores

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True)
class Case:
    id: str  # the row of docs/reliability.md
    args: tuple[str, ...]  # postrl command line; {name} -> path of paths[name]
    exit: int
    phrases: tuple[str, ...]
    absent: str | None = None


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_model_path) -> dict[str, str]:
    d = tmp_path_factory.mktemp("surfaces")
    tiny = Path(tiny_model_path)
    config = json.loads((tiny / "config.json").read_text())

    def model(name: str, tokenizer: bool = True, **changes) -> str:
        out = d / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**config, **changes}))
        for f in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
            shutil.copy(tiny / f, out / f)
        return str(out)

    seq_cls = {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    (d / "cfg.yaml").write_text("model: {path: builtin:tiny-qwen2}\nrollout: {engine: hf}\n")
    pairs = [
        {"prompt": "1+1?", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2?", "chosen": "4"},  # no rejected
        {"prompt": "3+3?", "chosen": "6", "rejected": "6"},  # the same text
    ]
    labels = [{"prompt": "1+1?", "response": "2", "label": y} for y in (1, 0, "good", 5, -3, 0.5)]
    (d / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (d / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels))
    gt = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
    (d / "empty_gt.jsonl").write_text(json.dumps(gt) + "\n" + json.dumps({**gt, "reward_model": {"ground_truth": ""}}) + "\n")
    (d / "rm_out" / "model").mkdir(parents=True)
    return {
        "cfg": str(d / "cfg.yaml"), "tiny": tiny_model_path, "pairs": str(d / "pairs.jsonl"), "labels": str(d / "labels.jsonl"),
        "empty_gt": str(d / "empty_gt.jsonl"), "rm_out": str(d / "rm_out"), "missing": str(d / "no" / "such" / "model"),
        "no_tokenizer": model("no_tokenizer", tokenizer=False),
        "rm": model("rm", **seq_cls),
        "rm_small_embeddings": model("rm_small_embeddings", **seq_cls, vocab_size=300),  # the tokenizer has 405 ids
        "causal_lm": model("causal_lm"),
    }  # fmt: skip


TOOLS_ON = ("rollout.multi_turn.enable=true",)
CASES = [
    # model paths: every model a run loads is checked from config.json and its tokenizer files
    Case("model-without-tokenizer-files", ("check-config", "{cfg}", "model.path={no_tokenizer}"), 2,
         ("model.path: '{no_tokenizer}' has no tokenizer files", "Fix: copy the tokenizer files")),
    Case("model-without-tokenizer-files-eval", ("eval", "{cfg}", "--model", "{no_tokenizer}"), 2,
         ("has no tokenizer files",)),
    Case("rm-tokenizer-larger-than-embeddings", ("check-config", "{cfg}", "reward.reward_model.path={rm_small_embeddings}"), 2,
         ("has 405 token ids but the model's embeddings have 300 rows",)),
    Case("judge-is-a-sequence-classifier", ("check-config", "{cfg}", "reward.judge.path={rm}"), 2,
         ("reward.judge.path: '{rm}' is a classifier (Qwen2ForSequenceClassification", "put it in reward.reward_model.path")),
    Case("rm-is-a-causal-lm", ("check-config", "{cfg}", "reward.reward_model.path={causal_lm}"), 2,
         ("reward.reward_model.path: '{causal_lm}' is a causal LM (Qwen2ForCausalLM", "not a reward model"), absent="output labels"),
    Case("critic-path-missing", ("check-config", "{cfg}", "algorithm.adv_estimator=gae", "critic.model_path={missing}"), 2,
         ("critic.model_path: '{missing}' does not exist", "It is not tried as a model hub id")),
    Case("judge-path-missing", ("check-config", "{cfg}", "reward.judge.path={missing}"), 2,
         ("reward.judge.path: '{missing}' does not exist", "Fix: point reward.judge.path at"), absent="model.tokenizer_path"),
    Case("rm-path-ok", ("check-config", "{cfg}", "reward.reward_model.path={rm}", "reward.judge.path={causal_lm}"), 0,
         ("configuration is valid",)),
    Case("sequence-parallel-heads", ("check-config", "{cfg}", "model.path={tiny}", "train.sequence_parallel_size=3"), 2,
         ("train.sequence_parallel_size (3) must divide the model's attention heads (4)",)),
    # config values
    Case("max-staleness-huge", ("check-config", "{cfg}", "rollout.mode=async", "rollout.max_staleness=3000000000"), 2,
         ("rollout.max_staleness: Input should be less than or equal to 100",)),
    Case("sequence-parallel-with-other-problems",
         ("check-config", "{cfg}", "train.sequence_parallel_size=3", "cluster.devices_per_node=2", "train.lr=-1"), 2,
         ("2 problem(s) in the configuration", "train.sequence_parallel_size (3) must divide the world size (2 devices)")),
    Case("multi-turn-with-nothing-to-run", ("check-config", "{cfg}", *TOOLS_ON), 2,
         ("neither rollout.multi_turn.tools nor rollout.multi_turn.interaction is set",)),
    Case("tools-with-enable-false", ("check-config", "{cfg}", "rollout.multi_turn.tools=[builtin:calculator]"), 0,
         ("note: rollout.multi_turn.tools is set but rollout.multi_turn.enable is false",)),
    Case("critic-keys-on-grpo", ("check-config", "{cfg}", "critic.lr=0.001"), 0,
         ("note: critic.lr is set but adv_estimator 'grpo' uses no critic",)),
    # the modules a run imports: imported and shape-checked by check-config
    Case("tool-not-importable", ("check-config", "{cfg}", *TOOLS_ON, "rollout.multi_turn.tools=[no_such_tools:search]"), 2,
         ("tool 'no_such_tools:search' could not be loaded (ModuleNotFoundError",)),
    Case("environment-without-step", ("check-config", "{cfg}", *TOOLS_ON, f"rollout.multi_turn.interaction={__name__}:NoStep"), 2,
         (f"rollout.multi_turn.interaction '{__name__}:NoStep' has no step method",)),
    # postrl rm: every row checked before the model loads; an existing model is not replaced
    Case("rm-rows-without-rejected", ("rm", str(CONFIGS / "tiny_rm.yaml"), "model.path=builtin:tiny-qwen2",
                                      "rm.train_files=[{pairs}]", "rm.output_dir={missing}"), 2,
         ("2 unusable row(s)", "pairs.jsonl row 2: no rejected", "pairs.jsonl row 3: chosen and rejected are the same text")),
    Case("rm-bad-labels", ("rm", str(CONFIGS / "tiny_rm.yaml"), "model.path=builtin:tiny-qwen2",
                           "rm.train_files=[{labels}]", "rm.output_dir={missing}"), 2,
         ("4 unusable row(s)", "labels.jsonl row 3: label 'good' (text) is not 0 or 1", "row 4: label 5 (int)",
          "row 5: label -3 (int)", "row 6: label 0.5 (float)")),
    Case("rm-output-dir-holds-a-model", ("rm", str(CONFIGS / "tiny_rm.yaml"), "model.path=builtin:tiny-qwen2",
                                         "rm.output_dir={rm_out}"), 2,
         ("already holds a reward model", "rm.overwrite: true")),
]  # fmt: skip


class NoStep:
    """An environment that forgot its step method."""

    def reset(self, row):
        pass


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cli_case(case: Case, paths, capsys, caplog, monkeypatch):
    monkeypatch.setattr(cli.console, "width", 1000)
    code = cli.main([a.format(**paths) for a in case.args])  # a traceback would be an exception here
    captured = capsys.readouterr()  # notes are log records (on the terminal: stderr)
    out = " ".join((captured.out + "\n" + captured.err + "\n" + caplog.text).split())
    assert code == case.exit, out[-3000:]
    for phrase in case.phrases:
        assert phrase.format(**paths) in out, out[-3000:]
    assert case.absent is None or case.absent not in out


def test_model_checks_read_no_weights_and_take_well_under_a_second(paths):
    from postrl.preflight import run_model_problems

    cfg = load_config(None, [f"model.path={paths['tiny']}", "algorithm.adv_estimator=gae", f"critic.model_path={paths['tiny']}",
                             "algorithm.kl.coef=0.1", f"checkpoint.ref_model_path={paths['tiny']}",
                             f"reward.reward_model.path={paths['rm']}", f"reward.judge.path={paths['causal_lm']}"], check_paths=False)  # fmt: skip
    start = time.perf_counter()
    assert run_model_problems(cfg) == []
    assert time.perf_counter() - start < 1.0  # five paths; the RM and judge directories hold no weights at all
    bad = cfg.model_copy(deep=True)
    bad.critic.model_path = paths["missing"]
    start = time.perf_counter()
    (problem,) = run_model_problems(bad)
    assert problem.startswith("critic.model_path:") and time.perf_counter() - start < 1.0  # no hub retries (were 22 s)


def test_a_two_part_path_under_a_local_directory_is_local_not_a_hub_id(tmp_path, monkeypatch):
    """'runs/critic' (a run output not written yet) is refused at once as a missing local path; 'Qwen/Qwen2.5-7B'
    with no Qwen/ directory here stays a hub id for the loader."""
    from postrl.preflight import CRITIC, check_model, looks_like_hub_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not looks_like_hub_id("runs/critic") and looks_like_hub_id("Qwen/Qwen2.5-7B")
    (p,) = check_model("runs/critic", CRITIC)
    assert p.startswith("critic.model_path: 'runs/critic' does not exist") and "its first part is a local directory" in p


def test_check_model_takes_a_new_role(paths):
    from postrl.preflight import Role, check_model

    teacher = Role("teacher", "distill.teacher.path", "causal_lm", own_tokenizer=False)
    assert check_model(paths["causal_lm"], teacher, policy_vocab=405) == []
    (p,) = check_model(paths["rm"], teacher)
    assert p.startswith(f"distill.teacher.path: '{paths['rm']}' is a classifier")
    (p,) = check_model(paths["causal_lm"], teacher, policy_vocab=500)
    assert "the policy's tokenizer has 500 token ids but the model's embeddings have 405 rows" in p


def test_rm_overwrite_replaces_only_when_asked(paths):
    from postrl.rm import _check_output_dir

    cfg = load_config(CONFIGS / "tiny_rm.yaml", ["model.path=builtin:tiny-qwen2", f"rm.output_dir={paths['rm_out']}"], check_paths=False)
    with pytest.raises(UserError, match="already holds a reward model"):
        _check_output_dir(cfg.rm)
    _check_output_dir(cfg.rm.model_copy(update={"overwrite": True}))
    _check_output_dir(cfg.rm.model_copy(update={"output_dir": paths["missing"]}))  # a fresh directory


def test_empty_ground_truth_refused(paths):
    from transformers import AutoTokenizer

    from postrl.config import DataConfig
    from postrl.data.dataset import load_prompts

    tok = AutoTokenizer.from_pretrained(paths["tiny"])
    with pytest.raises(UserError) as err:
        load_prompts([paths["empty_gt"]], tok, DataConfig())
    assert err.value.problems == [
        f"{paths['empty_gt']}, row 1: the ground truth (data.answer_key 'reward_model.ground_truth') is empty. A verifier "
        "compares each response with it, so every response would score as wrong and the prompt teach nothing. Fix: fill "
        "in the answers, or drop those rows (`postrl preprocess` writes them from the raw data)."
    ]


# ------------------------------------------------ reward sources alike: environments, the RM, the judge
class Flaky:
    """An environment whose step raises, returns NaN, or works, by the row's 'mode'."""

    def reset(self, row):
        self.mode = row["mode"]

    def step(self, text):
        if self.mode == "raise":
            raise ValueError("no such state")
        return "", (math.nan if self.mode == "nan" else 1.0), True


def _env_loop(modes: list[str]):
    from test_agents import ScriptEngine

    from postrl.agents.loop.loop import AgentLoop
    from postrl.builtin.tiny import build_tiny_model
    from postrl.config import MultiTurnConfig
    from postrl.rollout.base import SamplingParams
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2-tools"))
    loop = AgentLoop(ScriptEngine(tok, ["\\boxed{5}<|im_end|>"]), tok, MultiTurnConfig(enable=True, interaction=f"{__name__}:Flaky"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}], add_generation_prompt=True, return_dict=False)
    return lambda: loop.generate([prompt] * len(modes), SamplingParams(max_tokens=50, greedy=True), rows=[{"mode": m} for m in modes]), loop


def test_environment_step_raising_or_nan_is_contained_and_counted(caplog):
    run, loop = _env_loop(["ok", "raise", "nan", "ok"])
    out = run()
    assert [c.env_reward for c in out] == [1.0, 0.0, 0.0, 1.0]  # no NaN reaches the score
    assert [c.finished for c in out] == [True, False, False, True]  # a raising or invalid step ends its trajectory
    m = loop.pop_metrics()
    assert m["agent/env_errors"] == 1 and m["agent/env_invalid"] == 1 and m["agent/env_reward_mean"] == 0.5


@pytest.mark.parametrize("mode, kind", [("raise", "raised an exception (counted in agent/env_errors), for example: ValueError: no such state"),
                                        ("nan", "returned a value out of its type or range (counted in agent/env_invalid), for example: the reward is nan; it must be a finite number within +-1e+06")])  # fmt: skip
def test_environment_failing_every_step_stops_the_run(mode, kind):
    run, _ = _env_loop([mode] * 4)
    with pytest.raises(UserError) as err:
        run()
    assert f"environment '{__name__}:Flaky' failed on 4 of its 4 calls in this batch; 4 {kind}" in err.value.problems[0]
    run, loop = _env_loop([mode] * 3)  # 3 calls are too few to judge: counted, not fatal
    assert [c.env_reward for c in run()] == [0.0] * 3
    m = loop.pop_metrics()
    assert m["agent/env_errors"] + m["agent/env_invalid"] == 3


class StubScorer:
    """A model reward (the ModelScorer protocol) whose scores are given: NaN for a broken RM, or judge-like failures."""

    def __init__(self, name: str, scores: list[float], failures: list[str] = (), weight: float = 1.0):
        self.name, self.weight, self.normalize, self.fail_score = name, weight, True, 0.0
        self.scores, self.failures, self.failure_fix = scores, list(failures), "fix the model"

    def score(self, responses, ground_truths, rows):
        return ModelScores(self.scores[: len(responses)], {}, self.failures[: len(responses)])

    def close(self):
        pass


def test_rm_non_finite_scores_counted_and_stop_the_run():
    cfg = RewardConfig(verifiers=[{"name": "math_17k_acc", "weight": 0}])
    rm = StubScorer("rm_score", [1.0, math.nan, 3.0, math.inf])
    with RewardFunction(cfg, models=[rm]) as fn:
        out = fn(["a", "b", "c", "d"], ["1"] * 4, [{}] * 4)
        assert out.failures["reward/rm_invalid"] == 2 and all(math.isfinite(s) for s in out.scores)
        assert out.metrics["rm_score"] == [1.0, 0.0, 3.0, 0.0]  # the fail score, then normalised with the rest
        rm.scores = [math.nan] * 4
        with pytest.raises(UserError, match=r"the reward model gave no score for 4 of its 4 samples in this batch, for example: score nan"):
            fn(["a", "b", "c", "d"], ["1"] * 4, [{}] * 4)
        rm.weight = 0  # logged, not rewarded: counted, not fatal (as a weight-0 verifier)
        assert fn(["a", "b", "c", "d"], ["1"] * 4, [{}] * 4).failures["reward/rm_invalid"] == 4


def test_judge_never_parsed_stops_the_run_by_the_verifiers_rule():
    cfg = RewardConfig(verifiers=[{"name": "math_17k_acc", "weight": 0}])
    judge = StubScorer("judge_score", [0.0] * 4, ["judgement 'great answer' does not match the score pattern"] * 4)
    with RewardFunction(cfg, models=[judge]) as fn:
        fn(["a", "b", "c"], ["1"] * 3, [{}] * 3)  # 3 of 3: too few to judge
        with pytest.raises(UserError, match=r"the judge gave no score for 4 of its 4 samples in this batch, for example: judgement 'great answer'"):
            fn(["a", "b", "c", "d"], ["1"] * 4, [{}] * 4)
