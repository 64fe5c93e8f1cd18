"""The lookup-tool task of issue 40's reproduction (tests/user_lookup.py, docs/learning.md): its files build, the
held-out codes never occur in training, the SFT traces call the tool with the prompt's exact code and box its
answer, and the tool answers through postrl's tool loader as a `module:function` tool."""

from __future__ import annotations

import pyarrow.parquet as pq

import user_lookup
from postrl.agents.tools.tools import call_tool, load_tools


def test_lookup_task_files_build_with_unseen_held_out_codes_and_exact_tool_traces(tmp_path):
    paths = user_lookup.write(tmp_path, entities=50, repeats=4, val_size=20, tool_ratio=0.5)
    train = pq.read_table(paths["lookup_train"]).to_pylist()
    val = pq.read_table(paths["lookup_val"]).to_pylist()
    assert (len(train), len(val)) == (200, 20)
    train_codes = {r["extra_info"]["code"] for r in train}
    val_codes = {r["extra_info"]["code"] for r in val}
    assert len(train_codes) == 50 and len(val_codes) == 20 and not train_codes & val_codes
    traced = [r for r in train if len(r["extra_info"]["solution"]) == 3]
    assert 60 <= len(traced) <= 140  # tool_ratio 0.5 of 200
    for r in traced:
        call, tool, final = r["extra_info"]["solution"]
        code = r["extra_info"]["code"]
        assert code in r["prompt"][0]["content"]
        assert call["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"code": code}}
        assert tool["content"] == r["reward_model"]["ground_truth"] == user_lookup.lookup(code)
        assert final["content"] == "\\boxed{" + tool["content"] + "}"
    guesses = [r for r in train if len(r["extra_info"]["solution"]) == 1]
    assert all(g["extra_info"]["solution"][0]["content"] != "\\boxed{" + g["reward_model"]["ground_truth"] + "}" for g in guesses)


def test_lookup_tool_answers_as_a_user_module_function_tool():
    tools = load_tools(["user_lookup:lookup"])
    assert tools["lookup"].schema["function"]["parameters"]["required"] == ["code"]
    answer = call_tool(tools, "lookup", {"code": "K7-204"})
    assert answer.status == "ok" and answer.text == user_lookup.lookup("K7-204") and 1000 <= int(answer.text) <= 9999
    assert user_lookup.lookup("K7-205") != answer.text  # a neighbouring code: another number
    assert call_tool(tools, "lookup", {"code": "K77-204"}).text == "unknown item: K77-204"
