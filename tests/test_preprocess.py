"""`postrl preprocess`: readers, handlers, templates, seq_length filtering, malformed input, parquet output."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from postrl.data.preprocess import load_preprocess_config, main_preprocess, run_preprocess
from postrl.data.readers import iter_records, read_records
from postrl.data.templates import R1_INSTRUCTION, get_template
from postrl.errors import UserError

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="../shared/data not present")


def write_yaml(path: Path, **keys) -> str:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return str(path)


def run(tmp_path: Path, name: str = "cfg", **keys) -> dict:
    keys.setdefault("output_prefix", str(tmp_path / "out" / name))
    cfg = load_preprocess_config(write_yaml(tmp_path / f"{name}.yaml", **keys))
    out = io.StringIO()
    report = run_preprocess(cfg, tmp_path, out=out)
    report["stdout"] = out.getvalue()
    return report


def read_out(report: dict) -> list[dict]:
    return pq.read_table(report["output"]).to_pylist()


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> str:
    """A tokenizer with one token per whitespace-separated word (hand-countable), no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------ templates
def test_templates_shape_messages_and_render():
    qwen = get_template("qwen")
    msgs = qwen.messages("What is 2+3?")
    assert msgs == [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+3?"}]
    assert qwen.render(msgs) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    r1 = get_template("qwen_r1").messages("Q")
    assert r1[1]["content"] == R1_INSTRUCTION + "Q" and r1[1]["content"].endswith("within \\boxed{}.\nQ")
    assert get_template("qwen_math_r1").messages("Q")[0]["content"].startswith("Please reason step by step")
    assert get_template("empty").messages("Q") == [{"role": "user", "content": "Q"}]
    assert get_template("qwen3").messages("Q", system="") == [{"role": "user", "content": "Q"}]
    assert get_template("llama3").render([{"role": "user", "content": "Hi"}]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(UserError, match="qwen_math_r1"):
        get_template("chatglm9")


# ------------------------------------------------------------------------------------ readers
def test_readers_report_rows_and_keep_good_ones(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"q": 1}\n\n{"q": 2\n[1, 2]\n{"q": 4}\n{"q": 5')  # bad JSON, a list, truncated last line
    recs = list(iter_records(jsonl))
    assert [r.row for r in recs if r.row] == [{"q": 1}, {"q": 4}]
    bad = [r.describe() for r in recs if r.problem]
    assert len(bad) == 3
    assert bad[0].startswith(f"{jsonl} row 2 (line 3): is not valid JSON")
    assert "row 3 (line 4)" in bad[1] and "not an object" in bad[1]
    assert "row 5 (line 6)" in bad[2] and "truncated" in bad[2]

    js = tmp_path / "b.json"
    js.write_text('[\n  {"q": 1},\n  {"q": 2,, },\n  {"q": 3}\n]')
    recs = list(iter_records(js))
    assert [r.row for r in recs if r.row] == [{"q": 1}, {"q": 3}]
    assert [r.describe() for r in recs if r.problem][0].startswith(f"{js} row 2 (line 3): is not valid JSON")

    empty = tmp_path / "c.jsonl"
    empty.write_text("")
    (rec,) = iter_records(empty)
    assert rec.number == 0 and "empty" in rec.problem and "Fix" in rec.problem
    with pytest.raises(UserError, match="not valid JSON"):
        list(read_records(jsonl))


def test_parquet_reader_truncated_and_corrupt_row_group(tmp_path):
    rows = [{"question": f"q{i} " * 20, "answer": f"#### {i}"} for i in range(200)]
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist(rows), good, row_group_size=50)
    assert list(read_records(good)) == rows

    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(good.read_bytes()[:3000])
    (rec,) = iter_records(trunc)
    assert rec.number == 0 and "cannot be opened as parquet" in rec.problem and "re-download" in rec.problem

    col = pq.ParquetFile(good).metadata.row_group(1).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(good.read_bytes())
    data[start : start + 8] = b"\xff" * 8  # break a page header of row group 1 (rows 51-100)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    recs = list(iter_records(bad))
    assert len([r for r in recs if r.row]) == 150
    (problem,) = [r.describe() for r in recs if r.problem]
    assert problem.startswith(f"{bad} row 51: rows 51-100 (row group 1) cannot be read")


# ---------------------------------------------------------------------------- GSM8K / MATH-500
@needs_data
def test_gsm8k_to_verl_parquet(tmp_path):
    report = run(tmp_path, input=str(DATA / "gsm8k_test.jsonl"), handler_name="gsm8k", prompt_type="qwen", split="test")
    assert report["rows_in"] == 1319 and report["rows_out"] == 1319 and report["dropped"] == {}
    rows = read_out(report)
    raw = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    for row, src in zip(rows, raw):
        number = re.search(r"####\s*(.+)$", src["answer"]).group(1).replace(",", "")
        assert row["reward_model"] == {"style": "rule", "ground_truth": number}
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert first["prompt"][1]["content"].startswith("Janet’s ducks lay 16 eggs")
    assert first["prompt"][1]["content"].endswith('output the final answer after "####".')
    assert first["extra_info"]["index"] == 0 and first["extra_info"]["split"] == "test"
    assert first["extra_info"]["solution"].endswith("#### 18")
    assert rows[1318]["extra_info"]["index"] == 1318
    summary = json.loads(Path(report["output"].replace(".parquet", ".summary.json")).read_text())
    assert summary["rows_in"] == 1319 and summary["rows_out"] == 1319
    assert "rows in: 1319  rows out: 1319  dropped: 0" in report["stdout"]


@needs_data
def test_math500_seq_length_drops_are_counted(tmp_path, word_tokenizer):
    limit = 60
    report = run(
        tmp_path,
        input=str(DATA / "math500_test.jsonl"),
        handler_name="math",
        prompt_type="qwen_math_r1",
        tokenizer_name_or_path=word_tokenizer,
        seq_length=limit,
        log_interval=200,
    )
    # Independent count: the qwen_math_r1 prompt written out by hand, one token per word.
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    raw = [json.loads(line) for line in (DATA / "math500_test.jsonl").read_text().splitlines()]
    lengths = [
        len(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{r['problem']}<|im_end|>\n<|im_start|>assistant\n".split())
        for r in raw
    ]
    too_long = sum(n > limit for n in lengths)
    assert 0 < too_long < 500
    assert report["rows_out"] == 500 - too_long
    assert report["dropped"] == {f"prompt longer than seq_length ({limit} tokens)": too_long}
    assert report["prompt_tokens"]["max"] <= limit
    rows = read_out(report)
    kept = [r for r, n in zip(raw, lengths) if n <= limit]
    assert [r["reward_model"]["ground_truth"] for r in rows] == [r["answer"] for r in kept]
    assert rows[0]["extra_info"]["subject"] == kept[0]["subject"] and rows[0]["prompt"][0]["content"] == system
    assert "processed 500 rows" in report["stdout"]


def test_chat_template_of_the_tokenizer_is_used_for_counting(tmp_path, word_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}[assistant]"
    tok_dir = tmp_path / "tok_chat"
    tok.save_pretrained(tok_dir)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"question": "one two three", "answer": "#### 3"}) + "\n")
    common = dict(input=str(src), handler_name="gsm8k", prompt_type="empty", instruction="")
    # "[user] one two three [assistant]" = 5 tokens with the tokenizer's template (3 with "empty")
    assert run(tmp_path, "a", tokenizer_name_or_path=str(tok_dir), seq_length=5, **common)["rows_out"] == 1
    with pytest.raises(UserError, match="no row survived"):
        run(tmp_path, "b", tokenizer_name_or_path=str(tok_dir), seq_length=4, **common)
    assert run(tmp_path, "c", tokenizer_name_or_path=word_tokenizer, seq_length=3, **common)["rows_out"] == 1


# --------------------------------------------------------------------------- the other handlers
def test_dapo_math_17k_parquet(tmp_path):
    prompt = "Solve the following math problem step by step. The last line of your response should be of the form Answer: $Answer"
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": prompt + " 1+1?", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "a0f3"},
        },
        {"data_source": "math_dapo", "prompt": [{"content": "2+3?", "role": "user"}], "reward_model": {"ground_truth": "5"}},
        {"data_source": "math_dapo", "prompt": [{"content": "x", "role": "user"}], "reward_model": {"style": "rule"}},
    ]
    src = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    report = run(
        tmp_path,
        input=str(src),
        handler_name="Math17kAlpacaStyleInstructionHandler",  # the guide's name
        prompt_type="empty",
        map_keys='{"prompt":"prompt", "query":"", "response": "reward_model", "system":""}',  # the guide's JSON
        dataset_additional_keys="labels",
    )
    out = read_out(report)
    assert [r["reward_model"]["ground_truth"] for r in out] == ["2", "5"]
    assert out[0]["prompt"] == [{"role": "user", "content": prompt + " 1+1?"}]
    assert out[0]["extra_info"]["source_index"] == "a0f3" and out[0]["data_source"] == "math_dapo"
    assert report["dropped"] == {"malformed row": 1}
    assert f"{src} row 3: field 'reward_model' is a mapping without a 'ground_truth' value" in report["stdout"]


def test_deepscaler_json_list_with_qwen_r1(tmp_path):
    src = tmp_path / "deepscaler.json"
    src.write_text(json.dumps([
        {"problem": "What is 1/2 + 1/2?", "answer": "1", "solution": "1/2+1/2=1"},
        {"problem": ["not", "text"], "answer": "2"},
        {"problem": "What is 3*3?", "answer": 9},
    ]))
    report = run(tmp_path, input=str(src), handler_name="R1AlpacaStyleInstructionHandler", prompt_type="qwen_r1",
                 map_keys={"prompt": "problem", "query": "", "response": "answer", "system": ""})
    out = read_out(report)
    assert [r["reward_model"]["ground_truth"] for r in out] == ["1", "9"]
    assert out[0]["prompt"][1]["content"] == R1_INSTRUCTION + "What is 1/2 + 1/2?"  # no extra hint: template instructs
    assert out[0]["extra_info"]["solution"] == "1/2+1/2=1"
    assert f"{src} row 2: field 'problem' (prompt) is a list, expected text" in report["stdout"]
    assert [r["extra_info"]["index"] for r in out] == [0, 2]


def _png(color=(255, 0, 0)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(buf, format="PNG")
    return buf.getvalue()


def test_geo3k_images_and_unreadable_image(tmp_path):
    rows = [
        {"images": [{"bytes": _png(), "path": None}], "problem": "<image>Find x.", "answer": "30"},
        {"images": [{"bytes": b"definitely not a png", "path": None}], "problem": "<image>Find y.", "answer": "4"},
        {"images": [{"bytes": _png((0, 0, 255)), "path": None}], "problem": "Find z.", "answer": "\\frac{1}{2}"},
    ]
    src = tmp_path / "geo3k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    report = run(tmp_path, input=str(src), handler_name="geo3k", prompt_type="qwen", workers=2)
    out = read_out(report)
    assert [r["reward_model"]["ground_truth"] for r in out] == ["30", "\\frac{1}{2}"]
    assert out[0]["images"][0]["bytes"] == _png()
    assert out[1]["prompt"][1]["content"].startswith("<image>Find z.")  # placeholder added for its image
    assert "<think>" in out[0]["prompt"][1]["content"] and "\\boxed{}" in out[0]["prompt"][1]["content"]
    assert report["dropped"] == {"malformed row": 1}
    assert f"{src} row 2: image 0 of 'images' cannot be decoded" in report["stdout"]
    assert "re-export the image" in report["stdout"]


def test_malformed_inputs_are_reported_and_good_rows_kept(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"question": "a?", "answer": "x\n#### 1"}) + "\n"
        + json.dumps({"question": "b?"}) + "\n"  # missing answer
        + json.dumps({"question": {"text": "c"}, "answer": "#### 3"}) + "\n"  # wrong type
        + json.dumps({"question": "d?", "answer": "no final line"}) + "\n"  # no #### number
        + "{broken\n"
        + json.dumps({"question": "e?", "answer": "#### 1,234"}) + "\n"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    trunc = tmp_path / "trunc.parquet"
    trunc.write_bytes(b"PAR1" + b"\x00" * 100)
    report = run(tmp_path, input=[str(good), str(empty), str(trunc)], handler_name="gsm8k")
    out = read_out(report)
    assert [r["reward_model"]["ground_truth"] for r in out] == ["1", "1234"]
    assert report["rows_in"] == 6 and report["rows_out"] == 2 and report["dropped"] == {"malformed row": 4}
    text = report["stdout"]
    assert f"{good} row 2: field 'answer' (response) is missing or null" in text
    assert f"{good} row 3: field 'question' (prompt) is a dict, expected text" in text
    assert f"{good} row 4: field 'answer' does not end with a '#### <number>' line" in text
    assert f"{good} row 5: is not valid JSON" in text
    assert f"{empty}: file is empty" in text and f"{trunc}: cannot be opened as parquet" in text
    assert text.count("Fix:") >= 6


def test_config_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError) as exc:
        load_preprocess_config(write_yaml(tmp_path / "a.yaml", input="x", output_prefix="y", handler_name="gsm8k",
                                          seq_lenght=10))
    assert "Did you mean 'seq_length'?" in str(exc.value)
    with pytest.raises(UserError, match="handler_name 'nope' is not known"):
        run(tmp_path, input=str(tmp_path / "a.yaml"), handler_name="nope")
    with pytest.raises(UserError, match="does not exist"):
        run(tmp_path, input=str(tmp_path / "missing.jsonl"), handler_name="gsm8k")
    with pytest.raises(UserError, match="seq_length needs tokenizer_name_or_path"):
        run(tmp_path, input=str(tmp_path / "a.yaml"), handler_name="gsm8k", seq_length=10)
    with pytest.raises(UserError, match="map_keys"):
        load_preprocess_config(write_yaml(tmp_path / "b.yaml", input="x", output_prefix="y", handler_name="gsm8k",
                                          map_keys={"question": "q"}))


def test_main_preprocess_resolves_paths_from_the_config_dir(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "g.jsonl").write_text(json.dumps({"question": "q?", "answer": "#### 7"}) + "\n")
    cfg = write_yaml(tmp_path / "g.yaml", input="data/g.jsonl", output_prefix=str(tmp_path / "o" / "g"), handler_name="gsm8k")
    monkeypatch.chdir(Path(__file__).parent)
    assert main_preprocess(cfg) == 0
    assert pq.read_table(tmp_path / "o" / "g.parquet").num_rows == 1


def test_shipped_dataset_configs_are_valid():
    configs = sorted((Path(__file__).resolve().parents[1] / "configs" / "datasets").glob("*.yaml"))
    assert {p.stem for p in configs} >= {"dapo_math_17k", "deepscaler", "gsm8k", "math", "geo3k"}
    for p in configs:
        load_preprocess_config(str(p))


# ------------------------------------------------------------------------- the trainer reads it
@needs_data
def test_trainer_trains_on_preprocessed_gsm8k_and_math500(tmp_path):
    from postrl.checks import load_config
    from postrl.builtin.tiny import build_tiny_model
    from postrl.trainer import train

    model = build_tiny_model(out_dir=tmp_path / "tiny")
    common = dict(tokenizer_name_or_path=str(model), seq_length=200, max_rows=64, split="test")
    g = run(tmp_path, "gsm8k", input=str(DATA / "gsm8k_test.jsonl"), handler_name="gsm8k", prompt_type="qwen", **common)
    m = run(tmp_path, "math", input=str(DATA / "math500_test.jsonl"), handler_name="math", prompt_type="qwen_math_r1", **common)
    assert g["rows_out"] > 8 and m["rows_out"] > 8
    cfg_path = write_yaml(
        tmp_path / "train.yaml",
        model={"path": str(model)},
        data={"train_files": [g["output"], m["output"]], "val_files": [m["output"]], "max_prompt_length": 256},
        rollout={"engine": "hf", "n_samples_per_prompt": 2, "max_tokens": 8},
        reward={"verifiers": [{"name": "gsm8k_flexible", "weight": 1.0}, {"name": "math_17k_acc", "weight": 1.0}],
                "workers": 1},
        train={"global_batch_size": 2, "micro_batch_size": 4, "total_steps": 2, "lr": 1.0e-4},
        eval={"before_train": False, "after_train": True, "max_prompts": 4},
        logging={"dir": str(tmp_path / "run"), "sinks": ["jsonl"], "progress": False},
        checkpoint={"save_final": False},
    )
    metrics = train(load_config(cfg_path))
    assert metrics  # two steps ran and validation scored the MATH-500 prompts
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 2
