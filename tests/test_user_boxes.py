"""The out-of-range lookup task of issue 50's reproduction (tests/user_boxes.py, docs/learning.md): training items
box0 .. box299, held-out box300 .. box399, so no held-out name's digits after `box` occur in training; the SFT
traces call the tool with the prompt's exact item and box its answer; the tool answers as a `module:function` tool."""

from __future__ import annotations

import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

import user_boxes
from postrl.agents.tools.tools import call_tool, load_tools


def test_boxes_task_holds_out_names_outside_the_training_range(tmp_path):
    paths = user_boxes.write(tmp_path)
    train = pq.read_table(paths["boxes_train"]).to_pylist()
    val = pq.read_table(paths["boxes_val"]).to_pylist()
    assert (len(train), len(val)) == (2400, 100)  # 300 items x 8 repeats; 100 held-out items once each
    train_items = {r["extra_info"]["item"] for r in train}
    val_items = {r["extra_info"]["item"] for r in val}
    assert train_items == {f"box{i}" for i in range(300)} and val_items == {f"box{i}" for i in range(300, 400)}
    # every held-out name is box3NN; in training `box3` is followed by at most one more digit (box3, box30 .. box39)
    assert all(re.fullmatch(r"box3[0-9]{2}", item) for item in val_items)
    assert not any(re.fullmatch(r"box3[0-9]{2}", item) for item in train_items)
    assert {item for item in train_items if item.startswith("box3")} == {"box3", *(f"box3{d}" for d in range(10))}
    traced = [r for r in train if len(r["extra_info"]["solution"]) == 3]
    assert 600 <= len(traced) <= 840  # tool_ratio 0.3 of 2400
    for r in traced:
        call, tool, final = r["extra_info"]["solution"]
        item = r["extra_info"]["item"]
        assert r["prompt"][0]["content"] == f"What is the stock of item {item}?"
        assert call["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"item": item}}
        assert tool["content"] == r["reward_model"]["ground_truth"] == user_boxes.lookup(item)
        assert final["content"] == "\\boxed{" + tool["content"] + "}"
    guesses = [r for r in train if len(r["extra_info"]["solution"]) == 1]
    assert all(g["extra_info"]["solution"][0]["content"] != "\\boxed{" + g["reward_model"]["ground_truth"] + "}" for g in guesses)
    with pytest.raises(ValueError, match="must not occur in training"):
        user_boxes.rows(train_items=range(310), val_items=range(300, 400))


def test_boxes_tool_answers_as_a_user_module_function_tool():
    tools = load_tools(["user_boxes:lookup"])
    assert tools["lookup"].schema["function"]["parameters"]["required"] == ["item"]
    answer = call_tool(tools, "lookup", {"item": "box317"})
    assert answer.status == "ok" and answer.text == user_boxes.lookup("box317") and 1000 <= int(answer.text) <= 9999
    assert user_boxes.lookup("box217") != answer.text  # the first digit rewritten: another number
    assert call_tool(tools, "lookup", {"item": "crate317"}).text == "unknown item: crate317"


def test_wide_held_out_set_spans_every_block_outside_the_training_range():
    """`--val 300:1000:3`: 234 held-out names box3NN .. box9NN, 3 or 4 in each block of ten (box30X .. box99X), so
    the held-out accuracy averages over 70 blocks where box300 .. box399 has 10 (docs/learning.md, issue 50)."""
    got = user_boxes.rows(val_items=user_boxes.items("300:1000:3"))
    val = [r["extra_info"]["item"] for r in got["val"]]
    assert len(val) == 234 and val[:3] == ["box300", "box303", "box306"] and val[-1] == "box999"
    blocks = Counter(item[:5] for item in val)  # box30X .. box99X
    assert len(blocks) == 70 and set(blocks.values()) == {3, 4}
    # no training name has three digits starting with 3 .. 9
    assert not any(re.fullmatch(r"box[3-9][0-9]{2}", r["extra_info"]["item"]) for r in got["train"])
    assert user_boxes.items("10:100") == range(10, 100)


def test_mix_shuffles_names_of_the_held_out_length_into_a_few_training_names():
    """`--train 30:40 --repeats 240 --mix 200:300 --mix-repeats 8`: 2400 prompts on box30 .. box39 and 800 on
    box200 .. box299, shuffled together, none held out: the RL names then include three-digit ones, so the
    `box30X -> box30` shortening no longer earns the full reward (docs/learning.md, issue 50)."""
    got = user_boxes.mixed(train_items=range(30, 40), repeats=240, mix_items=user_boxes.items("200:300"), mix_repeats=8)
    train = [r["extra_info"]["item"] for r in got["train"]]
    counts = Counter(train)
    assert len(train) == 3200
    assert counts == {**{f"box{i}": 240 for i in range(30, 40)}, **{f"box{i}": 8 for i in range(200, 300)}}
    assert [r["extra_info"]["index"] for r in got["train"]] == list(range(3200))
    assert 0.15 < sum(len(item) == 6 for item in train[:400]) / 400 < 0.35  # shuffled: a quarter three-digit throughout
    assert [r["extra_info"]["item"] for r in got["val"]] == [f"box{i}" for i in range(300, 400)]
    plain = dict(train_items=range(30, 40), repeats=240)
    assert user_boxes.mixed(**plain) == user_boxes.rows(**plain)  # no mix: the rows as before, row for row
    with pytest.raises(ValueError, match="must not occur in training"):
        user_boxes.mixed(mix_items=range(350, 360))
