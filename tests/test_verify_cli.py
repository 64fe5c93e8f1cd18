"""`postrl verify` (main_verify): offline scoring of a file of completions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from postrl.errors import UserError
from postrl.utils import get_dotted
from postrl.verify_cli import as_completion, as_ground_truth, main_verify, parse_verifiers

# ../shared/data beside the checkout (found from a git worktree nested deeper, too)
DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents if (p / "shared" / "data").is_dir()),
            Path("../shared/data"))  # fmt: skip
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="../shared/data not present")


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def printed(capsys, captured=None) -> dict[str, str]:
    out = (captured or capsys.readouterr()).out
    return dict(re.findall(r"^([\w/ ]+): (.+)$", out, flags=re.M))


def test_helpers():
    row = {"reward_model": {"ground_truth": "4"}, "a.b": 1, "msgs": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]}
    assert get_dotted(row, "reward_model.ground_truth") == "4"
    assert get_dotted(row, "a.b") == 1  # a literal dotted key wins
    assert get_dotted(row, "msgs.1.content") == "A"
    assert as_completion(row["msgs"]) == "A"
    assert as_completion({"role": "assistant", "content": "B"}) == "B"
    assert as_completion(None) == ""  # an empty generation scores like an empty string
    assert as_ground_truth(18) == "18" and as_ground_truth(2.0) == "2" and as_ground_truth(0.5) == "0.5"
    assert as_ground_truth(["1", 2]) == "1, 2"
    assert as_ground_truth({"ground_truth": "x", "style": "rule"}) == "x"
    with pytest.raises(ValueError):
        as_completion(["a", "b"])
    assert parse_verifiers("math_17k_acc,format=0.1", None) == [
        {"name": "math_17k_acc", "weight": 1.0}, {"name": "format", "weight": 0.1}]
    assert parse_verifiers("a,b", "0.5,2")[1]["weight"] == 2.0
    with pytest.raises(UserError):
        parse_verifiers("a", "1,2")


def test_verify_scores_file_and_writes_one_line_per_record(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"response": r"so \boxed{4}", "answer": "4"},
        {"response": r"\boxed{5}", "answer": "4"},
        "{not json",
        {"response": "Answer: 4", "answer": 4},
        {"answer": "4"},  # no response
        {"response": [{"role": "user", "content": "q"}, {"role": "assistant", "content": r"\boxed{4}"}], "answer": "4"},
    ])
    out = tmp_path / "out.jsonl"
    assert main_verify(["--verifier", "math_17k_acc", "--input", src, "--output", str(out)]) == 0
    captured = capsys.readouterr()
    p = printed(capsys, captured)
    # scored rows: 1, 0, 0 (no box), 1 -> mean 0.5
    assert p["mean score"] == "0.5000" and p["acc"] == "0.5000" and p["timeouts"] == "0"
    assert p["records"] == "6 (4 scored, 2 skipped)"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6 and [ln["index"] for ln in lines] == list(range(6))
    assert [ln["score"] for ln in lines] == [1.0, 0.0, None, 0.0, None, 1.0]
    assert lines[0]["metrics"] == {"math_17k_acc": 1.0, "acc": 1.0} and lines[0]["timeout"] is False
    assert "not valid JSON" in lines[2]["error"] and "no field 'response'" in lines[4]["error"]
    assert "in.jsonl row 3: is not valid JSON" in captured.err and "in.jsonl row 5: no field 'response'" in captured.err


def test_verify_dotted_keys_weights_and_dapo(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"output": {"text": "<think>x</think><answer>Answer: 12</answer>"}, "reward_model": {"ground_truth": "12"}},
        {"output": {"text": "Answer: 1,000"}, "reward_model": {"ground_truth": "1000"}},
    ])
    main_verify(["--verifier", "acc_for_dapo,format=0.5", "--input", src,
                 "--response-key", "output.text", "--answer-key", "reward_model.ground_truth"])
    p = printed(capsys)
    # row 1: dapo reads "12</answer>" -> -1, format 1 x 0.5 -> -0.5; row 2: dapo +1, format 0 -> 1.0
    assert p["mean score"] == "0.2500"
    assert p["acc"] == "0.5000"  # acc comes from acc_for_dapo, not from format
    assert p["acc_for_dapo/mean"] == "0.0000" and p["format/mean"] == "0.5000"


def test_verify_falls_back_to_common_keys_and_reads_parquet(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"completion": "#### 7", "ground_truth": "7"}]), src)
    main_verify(["--verifier", "gsm8k", "--input", str(src)])
    captured = capsys.readouterr()
    assert "mean score: 1.0000" in captured.out
    assert "scoring 'completion'" in captured.err and "scoring 'ground_truth'" in captured.err


def test_verify_bad_input_is_a_user_error(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="empty"):
        main_verify(["--verifier", "gsm8k", "--input", str(empty)])
    with pytest.raises(UserError, match="does not exist"):
        main_verify(["--verifier", "gsm8k", "--input", str(tmp_path / "missing.jsonl")])
    src = write_jsonl(tmp_path / "x.jsonl", [{"text": "a", "label": "1"}])
    with pytest.raises(UserError, match="no record has the field 'resp'"):
        main_verify(["--verifier", "gsm8k", "--input", src, "--response-key", "resp"])
    with pytest.raises(UserError, match="unknown verifier"):
        main_verify(["--verifier", "nope", "--input", src])


@needs_data
def test_verify_on_gsm8k_reference_answers(capsys):
    main_verify(["--verifier", "gsm8k", "--input", str(DATA / "gsm8k_test.jsonl"),
                 "--response-key", "answer", "--answer-key", "answer"])
    p = printed(capsys)
    assert p["records"] == "1319 (1319 scored, 0 skipped)" and p["mean score"] == "1.0000"


@needs_data
def test_verify_math_verify_grades_every_answer_style_alike(tmp_path, capsys):
    # 12 GSM8K and 12 MATH-500 answers, each written three ways, right and wrong (the next row's answer)
    gsm = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()][:12]
    m500 = [json.loads(line) for line in (DATA / "math500_test.jsonl").read_text().splitlines()][:12]
    answers = [r["answer"].rsplit("####", 1)[1].strip() for r in gsm] + [r["answer"] for r in m500]
    styles = {
        "answer_is": lambda x: f"Step by step, we find it.\nThe answer is: ${x}$",
        "answer": lambda x: f"Answer: ${x}$",
        "boxed": lambda x: f"Therefore the result is $\\boxed{{{x}}}$.",
    }
    rows = []
    for k, answer in enumerate(answers):
        other = answers[(k + 1) % len(answers)]
        assert other != answer
        for style, write in styles.items():
            rows.append({"response": write(answer), "answer": answer, "style": style, "right": True})
            rows.append({"response": write(other), "answer": answer, "style": style, "right": False})
    src = write_jsonl(tmp_path / "styles.jsonl", rows)
    out = tmp_path / "scored.jsonl"
    assert main_verify(["--verifier", "math_verify", "--input", src, "--output", str(out)]) == 0
    p = printed(capsys)
    assert p["records"] == f"{len(rows)} (144 scored, 0 skipped)" and p["timeouts"] == "0"
    assert p["mean score"] == "0.5000" and p["math_verify/mean"] == "0.5000"
    scored = [json.loads(x) for x in out.read_text().splitlines()]
    for style in styles:
        right = [ln["score"] for ln, r in zip(scored, rows) if r["style"] == style and r["right"]]
        wrong = [ln["score"] for ln, r in zip(scored, rows) if r["style"] == style and not r["right"]]
        assert right == [1.0] * 24 and wrong == [0.0] * 24, style
    # math_17k_acc reads only the box: the same file scores 1/3 of the right answers
    main_verify(["--verifier", "math_17k_acc", "--input", src])
    assert printed(capsys)["mean score"] == f"{24 / 144:.4f}"
