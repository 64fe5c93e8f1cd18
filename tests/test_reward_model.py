"""Model-based rewards: the reward model's scores, their combination with the rule verifiers, the judge.

The RM here is a random-init one-logit `Qwen2ForSequenceClassification` of the tiny model's shape, saved
as a plain HF directory; the judge is the tiny random model itself. Learning (an RM trained by `postrl
rm`, DAPO with it) is in test_learning.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from postrl.checks import load_config
from postrl.config import JudgeConfig, RewardConfig, RewardModelConfig
from postrl.errors import UserError
from postrl.rewards import RewardFunction
from postrl.rewards.judge import Judge, parse_score
from postrl.rewards.reward_model import RewardModel, encode, load_reward_model, render, sequence_scores

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROWS = [
    {"prompt": [{"role": "user", "content": "Tom has 3 apples. He buys 2 more. How many now?"}]},
    {"prompt": [{"role": "user", "content": "Eva has 9 books. She loses 4. How many now?"}]},
]
RESPONSES = ["3+2=5. \\boxed{5}", "\\boxed{4}", "9-4=5. \\boxed{5}", "\\boxed{9}"]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory, tiny_model_path) -> str:
    """A random-init one-logit RM of the tiny model's shape, saved as a plain HF directory."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from postrl.models import load_tokenizer

    out = tmp_path_factory.mktemp("rm")
    tok = load_tokenizer(tiny_model_path)
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _rows(n: int) -> list[dict]:
    return [ROWS[i % 2] for i in range(n)]


def test_scores_are_the_hf_heads_logit_at_the_last_token(rm_path):
    model, tok = load_reward_model(rm_path)
    texts = [render(tok, ROWS[i % 2]["prompt"], r) for i, r in enumerate(RESPONSES)]
    assert texts[0].endswith("<|im_start|>assistant\n3+2=5. \\boxed{5}<|im_end|>\n")  # the RM's own chat template
    batch = encode(tok, texts, max_length=1024)
    assert batch["attention_mask"].sum(1).tolist() != [batch["input_ids"].shape[1]] * 4  # right-padded rows
    with torch.no_grad():
        ours = sequence_scores(model, batch)
        theirs = model(**batch).logits[:, 0]  # the pad token never occurs in the texts: HF finds the same token
    torch.testing.assert_close(ours, theirs)
    one = encode(tok, texts[:1], max_length=1024)  # unpadded alone: the same score
    with torch.no_grad():
        torch.testing.assert_close(sequence_scores(model, one), ours[:1], atol=1e-5, rtol=1e-5)


def test_micro_batches_and_left_cut(rm_path):
    big = RewardModel(RewardModelConfig(path=rm_path, micro_batch_size=16), torch.device("cpu"))
    small = RewardModel(RewardModelConfig(path=rm_path, micro_batch_size=1), torch.device("cpu"))
    a = big.score(RESPONSES, ["5"] * 4, _rows(4)).scores
    b = small.score(RESPONSES, ["5"] * 4, _rows(4)).scores
    assert len(a) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert len(set(round(x, 6) for x in a)) == 4  # the scores tell the responses apart
    # cut from the left: the last 8 tokens alone decide, so two renderings that end alike tie
    same_end = ["Tom: 12+3+4+5=24. 24-19=5. \\boxed{5}", "Eva: 12+3+4+5=24. 24-19=5. \\boxed{5}"]
    cut = RewardModel(RewardModelConfig(path=rm_path, max_length=8), torch.device("cpu"))
    s = cut.score(same_end, ["5", "5"], _rows(2)).scores
    full = big.score(same_end, ["5", "5"], _rows(2)).scores
    assert abs(s[0] - s[1]) < 1e-5 and abs(full[0] - full[1]) > 1e-4


def test_rm_combines_with_the_rule_verifiers_by_weight(rm_path):
    rules = [{"name": "math_17k_acc", "weight": 0.5}]
    cfg = RewardConfig(verifiers=rules, reward_model=RewardModelConfig(path=rm_path, weight=2.0))
    rm = RewardModel(cfg.reward_model, torch.device("cpu"))
    raw = rm.score(RESPONSES, ["5"] * 4, _rows(4)).scores
    mean = sum(raw) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4)
    norm = [(x - mean) / (std + 1e-6) for x in raw]
    with RewardFunction(cfg, models=[rm]) as fn:
        out = fn(RESPONSES, ["5", "4", "5", "5"], _rows(4))
        rule_only = fn.score_rules(RESPONSES, ["5", "4", "5", "5"], _rows(4))
    rule = [0.5, 0.5, 0.5, 0.0]  # 0.5 x boxed accuracy
    assert out.metrics["rule_score"] == rule and out.metrics["acc"] == [1.0, 1.0, 1.0, 0.0]
    assert out.metrics["rm_score"] == pytest.approx(raw, abs=1e-6)
    assert out.metrics["rm_score_reward"] == pytest.approx(norm, abs=1e-5)
    assert out.scores == pytest.approx([r + 2.0 * n for r, n in zip(rule, norm)], abs=1e-5)
    assert out.metrics["rm_rule_max"] == pytest.approx([max(r, n) for r, n in zip(rule, norm)], abs=1e-5)
    assert out.metrics["rm_rule_min"] == pytest.approx([min(r, n) for r, n in zip(rule, norm)], abs=1e-5)
    assert rule_only.scores == rule and "rm_score" not in rule_only.metrics  # validation stays rule-checked
    raw_cfg = cfg.reward_model.model_copy(update={"normalize": False, "weight": 1.0})
    with RewardFunction(cfg, models=[RewardModel(raw_cfg, torch.device("cpu"))]) as fn:
        out = fn(RESPONSES, ["5", "4", "5", "5"], _rows(4))
    assert out.scores == pytest.approx([r + x for r, x in zip(rule, raw)], abs=1e-5)


def test_a_classifier_with_two_labels_is_refused(tmp_path, tiny_model_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model_path, num_labels=2)).save_pretrained(tmp_path)
    from postrl.models import load_tokenizer

    load_tokenizer(tiny_model_path).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="2 output labels"):
        load_reward_model(str(tmp_path))


def test_parse_score():
    p = re.compile(r"Score:\s*(-?\d+(?:\.\d+)?)")
    assert parse_score("ok. Score: 7.5 because", p) == 7.5
    assert parse_score("Score: -2 then Score: 9", p) == -2.0  # the first match
    assert parse_score("no verdict", p) is None
    assert parse_score("Score: 1e999", re.compile(r"Score: (\S+)")) is None  # not finite
    assert parse_score("Score: ten", re.compile(r"Score: (\S+)")) is None


def test_judge_config_is_checked():
    with pytest.raises(ValueError, match="exactly one"):
        JudgeConfig(path="x", score_pattern=r"(\d+)-(\d+)")
    with pytest.raises(ValueError, match="doubled"):
        JudgeConfig(path="x", prompt_template="{prompt} as JSON {score: n}")


def test_judge_with_a_real_tiny_model_scores_unparsed_judgements_the_fail_value():
    """The random tiny model writes newlines: nothing parses, every sample scores fail_score and is counted;
    a pattern that matches the empty judgement's end parses none either (an empty group is no number)."""
    cfg = JudgeConfig(path="builtin:tiny-qwen2", max_tokens=6, fail_score=-1.0, weight=0.5)
    judge = Judge(cfg, torch.device("cpu"))
    judgements = judge.judgements(RESPONSES, ["5"] * 4, _rows(4))
    assert len(judgements) == 4 and all(parse_score(j, judge.pattern) is None for j in judgements)
    with RewardFunction(RewardConfig(verifiers=["math_17k_acc"]), models=[judge]) as fn:
        out = fn(RESPONSES[1:], ["4", "5", "5"], _rows(3))  # 3 samples: too few to judge the judge, counted
        assert out.metrics["judge_score"] == [-1.0] * 3
        assert out.failures["reward/judge_unparsed"] == 3 and judge.unparsed_total == 3
        assert out.scores == [1 - 0.5, 1 - 0.5, 0 - 0.5]  # judges are not normalised
        with pytest.raises(UserError, match="the judge gave no score for 4 of its 4 samples in this batch"):
            fn(RESPONSES, ["5", "4", "5", "5"], _rows(4))  # 4 of 4 unparsed: the verifiers' rule stops the run


def test_two_steps_with_an_rm_and_a_rule_then_resume(rm_path, tmp_path):
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    over = tiny_overrides(
        tmp_path, f"reward.reward_model.path={rm_path}", "reward.verifiers=[acc_for_dapo]",
        "algorithm.filter_groups.metric=rm_score", "train.total_steps=2", "checkpoint.save_final=true",
    )  # fmt: skip
    trainer = Trainer(load_config(CONFIGS / "tiny_dapo.yaml", over))
    trainer.fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "training/step" in r]
    assert [r["training/step"] for r in rows] == [1, 2]
    for key in ("dapo/score/mean", "dapo/rewards/mean", "dapo/rm_score/mean", "dapo/rule_score/mean", "dapo/rm_rule_max/mean"):
        assert key in rows[0], key
    assert rows[0]["dapo/score/mean"] == pytest.approx(rows[0]["dapo/rm_score/mean"])  # score: the RM's own
    assert rows[0]["dapo/rule_score/mean"] == -1.0  # the random model is never right: DAPO's rule gives -1
    r = rows[0]
    assert r["dapo/rm_rule_min/mean"] <= -1.0 <= r["dapo/rm_rule_max/mean"]
    # per sample max + min = RM reward + rule reward, so the means add up the same way
    both = r["dapo/rm_rule_max/mean"] + r["dapo/rm_rule_min/mean"]
    assert both == pytest.approx(r["dapo/rm_score_reward/mean"] + r["dapo/rule_score/mean"], abs=1e-6)
    resumed = Trainer(load_config(CONFIGS / "tiny_dapo.yaml", [*over, "train.total_steps=3"]))
    assert resumed.step == 2
    resumed.fit()
    steps = [r["training/step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "training/step" in r]
    assert steps[-1] == 3


def test_the_judge_engine_is_built_like_every_engine(tmp_path, monkeypatch):
    """The judge's engine comes from build_engine: the run's trust_remote_code and runtime, its own engine kind,
    never the agent loop, a KV cache for prompt + response + template + judgement."""
    import postrl.rollout.build as build

    made = {}
    monkeypatch.setattr(build, "make_engine", lambda rollout, model, tok, **kw: made.update(kw, rollout=rollout) or "engine")
    cfg = load_config(None, tiny_overrides(
        tmp_path, "reward.judge.path=builtin:tiny-qwen2", "reward.judge.max_tokens=5", "reward.judge.engine=auto",
        "model.trust_remote_code=true", "data.max_prompt_length=100",
    ), check_paths=False)  # fmt: skip
    runtime = object()
    judge = Judge(cfg.reward.judge, torch.device("cpu"), "prompt", cfg, runtime)
    filled = cfg.reward.judge.prompt_template.format(prompt="", response="", ground_truth="")
    around = len(judge.tokenizer.apply_chat_template([{"role": "user", "content": filled}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))  # fmt: skip
    assert judge.engine == "engine" and around > 10
    assert made["trust_remote_code"] is True and made["runtime"] is runtime and made["seed"] == cfg.train.seed
    assert made["max_model_len"] == 100 + 12 + around + 5  # max_prompt_length + rollout.max_tokens + template + judgement
    assert made["rollout"].engine == "auto" and made["rollout"].multi_turn.enable is False


def test_two_steps_with_a_judge(tmp_path):
    from postrl.metrics import read_jsonl
    from postrl.trainer import Trainer

    over = tiny_overrides(
        tmp_path, "reward.judge.path=builtin:tiny-qwen2", "reward.judge.max_tokens=4", "train.total_steps=2",
        "reward.judge.weight=0",  # logged, not rewarded: the random judge's unparsed answers are counted, not fatal
        "algorithm.filter_groups.enable=false", "train.gen_batch_size=4",
    )  # fmt: skip
    trainer = Trainer(load_config(CONFIGS / "tiny_dapo.yaml", over))
    trainer.fit()
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "training/step" in r]
    assert [r["training/step"] for r in rows] == [1, 2]
    assert rows[0]["reward/judge_unparsed"] == 16  # 4 prompts x 4 samples, none parsed (the judge is random)
    assert rows[0]["dapo/judge_score/mean"] == 0.0


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_postrl_rm_trains_pairwise_and_pointwise_files_into_a_loadable_rm(tmp_path):
    from postrl.rm import run_rm

    q = ROWS[0]["prompt"]
    pairs = [{"prompt": q, "chosen": [{"role": "assistant", "content": "3+2=5. \\boxed{5}"}], "rejected": "\\boxed{4}"}] * 4
    labelled = [{"prompt": "Tom has 3 apples. He buys 2 more. How many now?", "response": r, "label": y}
                for r, y in [("\\boxed{5}", 1), ("\\boxed{4}", 0)] * 2]  # fmt: skip
    files = {"pairwise": _write_jsonl(tmp_path / "pairs.jsonl", pairs), "pointwise": _write_jsonl(tmp_path / "labels.jsonl", labelled)}
    for objective, f in files.items():
        out = tmp_path / objective
        cfg = load_config(CONFIGS / "tiny_rm.yaml", [
            "model.path=builtin:tiny-qwen2", f"rm.train_files=[{f}]", f"rm.val_files=[{f}]", "rm.steps=3", "rm.batch_size=4",
            "rm.lr=1e-3", "rm.warmup_steps=0", f"rm.output_dir={out}", "logging.progress=false",
        ])  # fmt: skip
        result = run_rm(cfg)
        assert 0.0 <= result["rm/val_accuracy"] <= 1.0 and result["rm/loss"] > 0
        model, _ = load_reward_model(str(out / "model"))
        assert model.config.num_labels == 1
    with pytest.raises(UserError, match="pairs or labelled responses"):
        bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "answer": "y"}])
        run_rm(load_config(CONFIGS / "tiny_rm.yaml", ["model.path=builtin:tiny-qwen2", f"rm.train_files=[{bad}]",
                                                      f"rm.output_dir={tmp_path}/bad"]))  # fmt: skip
