"""The guides' data: `postrl preprocess <short name>`, math_17k's boxed instruction, templates.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from postrl.data.preprocess import load_preprocess_config, main_preprocess, resolve_config
from postrl.data.templates import get_template
from postrl.errors import UserError
from postrl.rewards.math import answer_format_problem

ROOT = Path(__file__).resolve().parents[1]
DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def test_short_names_resolve_to_the_shipped_yamls(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not from the checkout: the source tree's configs/datasets is found anyway
    for name in ("math_17k", "dapo_math_17k", "deepscaler", "gsm8k", "math", "geo3k", "geo3k_test"):
        path = Path(resolve_config(name))
        assert path.name == f"{name}.yaml" and path.is_file()
        load_preprocess_config(str(path))
    assert load_preprocess_config(resolve_config("geo3k_test")).split == "test"
    with pytest.raises(UserError, match="math_17k"):
        resolve_config("math17")


def _dapo_parquet(tmp_path: Path) -> Path:
    rows = [
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_PROMPT.format(q=q)}],
         "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": str(i)}}
        for i, (q, a) in enumerate([("What is 2+3?", "5"), ("What is 7*6?", "42")])
    ]  # fmt: skip
    src = tmp_path / "dataset" / "dapo-math-17k.parquet"
    src.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), src)
    return src


def test_math_17k_prompts_ask_for_a_box(tmp_path, monkeypatch):
    """`postrl preprocess math_17k`: DAPO-Math-17k's prompts plus a system prompt asking for \\boxed{}, so
    math_17k_acc can score them; dapo_math_17k keeps them as they are (for acc_for_dapo)."""
    _dapo_parquet(tmp_path)
    monkeypatch.chdir(tmp_path)  # the shipped YAML reads ./dataset/dapo-math-17k.parquet
    for name in ("math_17k", "dapo_math_17k"):
        cfg = yaml_without_tokenizer(name, tmp_path)
        assert main_preprocess(str(cfg)) == 0
    boxed = pq.read_table(tmp_path / "dataset" / "math_17k" / "train.parquet").to_pylist()
    plain = pq.read_table(tmp_path / "dataset" / "dapo_math_17k" / "train.parquet").to_pylist()
    assert boxed[0]["prompt"][0] == {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."}
    assert [m["role"] for m in plain[0]["prompt"]] == ["user"]
    text = lambda row: "\n".join(m["content"] for m in row["prompt"])  # noqa: E731
    assert answer_format_problem([text(r) for r in plain], ["math_17k_acc"]) is not None
    assert answer_format_problem([text(r) for r in boxed], ["math_17k_acc"]) is None


def yaml_without_tokenizer(name: str, tmp_path: Path) -> Path:
    """The shipped YAML without its tokenizer (no model here), so no token counting."""
    import yaml

    tree = yaml.safe_load(Path(resolve_config(name)).read_text())
    tree.pop("tokenizer_name_or_path"), tree.pop("seq_length")
    tree["workers"] = 1
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(tree))
    return out


def test_templates_json_file(tmp_path):
    """A templates.json in MindSpeed-RL's format: prompt_type_path + prompt_type."""
    entries = [
        {"name": "empty", "format_user": {"slots": ["{{content}}"]}},
        {"name": "qwen_boxed", "format_user": {"slots": ["<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"]},
         "format_system": {"slots": ["<|im_start|>system\n{{content}}<|im_end|>\n"]},
         "format_prefix": {"slots": [["bos_token"]]},
         "default_system": "Please reason step by step, and put your final answer within \\boxed{}."},
    ]  # fmt: skip
    path = tmp_path / "templates.json"
    path.write_text(json.dumps(entries))
    t = get_template("qwen_boxed", path)
    msgs = t.messages("What is 2+3?")
    assert msgs[0]["content"].endswith("\\boxed{}.") and t.instructs
    assert t.render(msgs) == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(UserError, match="qwen_boxed"):
        get_template("qwen", path)

    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n")
    cfg = tmp_path / "pre.yaml"
    cfg.write_text(f"input: {src}\noutput_prefix: {tmp_path}/out\nhandler_name: gsm8k\nprompt_type: qwen_boxed\nprompt_type_path: templates.json\n")
    assert main_preprocess(str(cfg)) == 0  # prompt_type_path is read from the YAML's directory
    row = pq.read_table(tmp_path / "out.parquet").to_pylist()[0]
    assert row["prompt"][0]["role"] == "system" and "boxed" in row["prompt"][0]["content"]
