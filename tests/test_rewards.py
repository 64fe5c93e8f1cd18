"""Verifiers on hand-checked cases and on the real GSM8K / MATH-500 files; the time-limited pool."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from postrl.config import RewardConfig
from postrl.errors import UserError
from postrl.rewards import RewardFunction, get_entry, get_verifier, registered_verifiers
from postrl.rewards.equivalence import quick_equal
from postrl.rewards.gsm8k import extract_flexible, extract_strict
from postrl.rewards.math import extract_dapo_answer
from postrl.rewards.text import last_boxed, minerva_normalize, parse_number

# ../shared/data beside the checkout (found from a git worktree nested deeper, too)
DATA = next((p / "shared" / "data" for p in Path(__file__).resolve().parents if (p / "shared" / "data").is_dir()),
            Path("../shared/data"))  # fmt: skip
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="../shared/data not present")


def score(name: str, completion: str, truth: str, row: dict | None = None):
    return get_verifier(name)(completion, truth, row or {})


def reward_fn(*names: str | tuple[str, float], timeout_s: float = 5.0, workers: int = 2) -> RewardFunction:
    specs = [{"name": n, "weight": 1.0} if isinstance(n, str) else {"name": n[0], "weight": n[1]} for n in names]
    return RewardFunction(RewardConfig(verifiers=specs, timeout_s=timeout_s, workers=workers))


@pytest.fixture(scope="module")
def math_reward():
    rf = reward_fn("math_17k_acc", timeout_s=3.0)
    yield rf
    rf.close()


# ------------------------------------------------------------------------------- extraction
def test_last_boxed_nested_and_variants():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\left( 3, \frac{\pi}{2} \right)}") == r"\left( 3, \frac{\pi}{2} \right)"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box here") is None
    assert last_boxed("x" * 1_000_000 + r"\boxed{12}") == "12"


def test_parse_number_and_quick_equal():
    assert parse_number("1,234.50") == parse_number("1234.5")
    assert parse_number("1,-2") is None and parse_number("x") is None
    assert quick_equal("37", "37.0") is True
    assert quick_equal(r"\$1,000", "1000") is True
    assert quick_equal("38", "37") is False
    assert quick_equal("1000000001", "1000000000") is False  # integers compare exactly
    assert quick_equal("0.30000000000000004", "0.3") is True  # float noise is forgiven
    assert quick_equal("3.14", "3.14159") is False
    assert quick_equal(r"\dfrac{1}{2}", r"\frac12") is True  # simple fractions are exact
    assert quick_equal("0.5", r"\frac{1}{2}") is True
    assert quick_equal(r"\frac{1}{3}", r"\frac{2}{3}") is False
    assert quick_equal("0.333", r"\frac13") is None  # a rounding? math-verify decides
    assert quick_equal(r"145^\circ", "145") is True
    assert quick_equal(r"\text{Evelyn}", "Evelyn") is True
    assert quick_equal(None, "1") is False
    assert quick_equal("5", r"\boxed{5}") is True  # a ground truth stored boxed
    assert quick_equal("30", "30°") is True
    assert quick_equal("1+" * 5000 + "1", "2") is False  # absurdly long: no symbolic check


def test_registry_names_and_unknown_verifier():
    names = registered_verifiers()
    for n in ("math_17k_acc", "boxed_acc", "acc_for_dapo", "gsm8k", "gsm8k_flexible", "geo3k", "format", "verl_default"):
        assert n in names
    with pytest.raises(UserError, match="math_17k_acc"):
        get_verifier("no_such_verifier")
    with pytest.raises(UserError, match="could not be loaded"):
        get_verifier("no_such_pkg.mod:fn")


# --------------------------------------------------------------------------------------- DAPO
# Expected values follow DAPO's published rule (verl math_dapo.compute_score), checked by hand.
DAPO_CASES = [
    ("The total is 5.\nAnswer: 5 units", "5", 1.0),
    (r"Answer: \text{5 cm}", "5", 1.0),  # spaces dropped, "cm" removed, \text{} unwrapped
    (r"Answer: $\frac{1}{2}$", r"\frac12", 1.0),  # $...$ kept, \frac12 -> \frac{1}{2}
    (r"Answer: \frac12", r"\frac{1}{2}", 1.0),
    ("Answer: 1,000", "1000", 1.0),  # commas dropped from an integer
    ("Answer: 1,234,567", "1234567", 1.0),
    ("Answer: 1,000.5", "1000.5", -1.0),  # ... but not from a decimal
    ("Answer: 0.5", r"\frac{1}{2}", -1.0),  # string rule: no symbolic equivalence
    ("answer: 12", "12", 1.0),  # case-insensitive
    ("Answer: x = 3", "3", 1.0),  # text after the last '='
    ("Answer: 3 dollars", "3", 1.0),
    (r"Answer: \$3", "3", 1.0),
    (r"Answer: 90^\circ", "90", 1.0),
    ("Answer: 5\nAnswer: 6", "6", 1.0),  # the last Answer: line counts
    ("Answer: 5\nAnswer: 6", "5", -1.0),
    (r"Answer: \text{(B)}", "B", -1.0),
    (r"Answer: \sqrt2", r"\sqrt{2}", 1.0),
    ("Answer: The answer is $12$.", "12", 1.0),  # only the first $...$ span is kept
    (r"Answer: \textbf{Evelyn}", r"\text{Evelyn}", 1.0),
    ("Answer: 7\n" + "x" * 400, "7", -1.0),  # only the last 300 characters are read
    ("I think it is 7.", "7", -1.0),  # no Answer: line and no box
    (r"So the result is \boxed{7}.", "7", 1.0),  # postrl's fallback to the last \boxed{}
]


@pytest.mark.parametrize("completion,truth,expected", DAPO_CASES)
def test_dapo_rule_matches_published_behaviour(completion, truth, expected):
    res = score("acc_for_dapo", completion, truth)
    assert res.score == expected
    assert res.metrics["acc"] == (1.0 if expected > 0 else 0.0)


def test_minerva_normalize_examples():
    assert minerva_normalize(r"\text{5 cm}") == "5"
    assert minerva_normalize(r"$\frac{1}{2}$") == r"\frac{1}{2}"
    assert minerva_normalize("1,000") == "1000"
    assert minerva_normalize(r"\boxed{x+1}") == "x+1"
    assert extract_dapo_answer("Answer: 3\nmore text") == "3"


# -------------------------------------------------------------------------------------- gsm8k
def test_gsm8k_strict_and_flexible():
    assert extract_strict("so 2+2=4\n#### 4") == 4
    assert extract_strict("#### $1,600") == 1600
    assert extract_strict("#### 3\n#### 5") == 5  # the last one counts
    assert extract_strict("the answer is 4") is None
    assert extract_flexible("it costs $1,600.50 in total.") == parse_number("1600.50")
    assert score("gsm8k", "2+2=4\n#### 4", "4").score == 1.0
    assert score("gsm8k", "2+2=4\n#### 4.00", "4").score == 1.0
    assert score("gsm8k", "the answer is 4", "4").score == 0.0  # strict needs ####
    assert score("gsm8k_flexible", "the answer is 4", "4").score == 1.0
    assert score("gsm8k_flexible", "the answer is 4, not 5", "4").score == 0.0  # last number
    assert score("gsm8k", "#### -10", "-10").metrics["acc"] == 1.0
    assert score("gsm8k", "#### 7", "Janet sells 7 eggs.\n#### 7").score == 1.0  # full solution as truth


@needs_data
def test_gsm8k_reference_answers_score_full_reward():
    rows = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    assert len(rows) == 1319
    for name in ("gsm8k", "gsm8k_flexible"):
        fails = []
        for i, row in enumerate(rows):
            number = re.search(r"####\s*(.+)\s*$", row["answer"]).group(1).strip()
            if score(name, row["answer"], number).score != 1.0:
                fails.append((i, number))
        assert fails == [], f"{name}: {len(fails)} reference answers not scored 1: {fails[:5]}"
    # and wrong numbers score nothing
    assert score("gsm8k", rows[0]["answer"], "19").score == 0.0


# ------------------------------------------------------------------------------- boxed / math
def test_boxed_fast_path_in_process():
    assert score("math_17k_acc", r"so \boxed{37}", "37").score == 1.0
    assert score("boxed_acc", r"\boxed{38}", "37").score == 0.0
    assert score("math_17k_acc", "37", "37").score == 0.0  # no box, no credit


def test_math_equivalence_through_pool(math_reward):
    completions = [r"\boxed{0.5}", r"\boxed{\dfrac12}", r"\boxed{\frac{2}{4}}", r"\boxed{(3,\frac{\pi}{2})}",
                   r"\boxed{p-q}", r"\boxed{2\sqrt{2}}", r"\boxed{\sqrt{8}}", r"\boxed{x^2+2x+1}", r"\boxed{3}"]
    truths = [r"\frac{1}{2}", "0.5", "0.5", r"\left( 3, \frac{\pi}{2} \right)",
              "p - q", r"\sqrt{8}", r"2\sqrt2", "(x+1)^2", r"\frac{7}{2}"]
    out = math_reward(completions, truths, [{}] * len(truths))
    assert out.scores == [1.0] * 8 + [0.0]
    assert out.metrics["acc"] == out.scores
    assert out.metrics["math_17k_acc"] == out.scores
    assert out.timeouts == 0 and out.errors == 0


@needs_data
def test_math500_reference_solutions_agree(math_reward):
    rows = [json.loads(line) for line in (DATA / "math500_test.jsonl").read_text().splitlines()]
    assert len(rows) == 500
    sols = [r["solution"] for r in rows]
    own = math_reward(sols, [r["answer"] for r in rows], rows)
    agree = sum(own.scores) / len(rows)
    nxt = math_reward(sols, [rows[(i + 1) % len(rows)]["answer"] for i in range(len(rows))], rows)
    wrong = sum(nxt.scores) / len(rows)
    print(f"MATH-500: own answer {agree:.1%}, next row's answer {wrong:.1%}, timeouts {own.timeouts + nxt.timeouts}")
    assert agree >= 0.99
    assert wrong <= 0.01


# -------------------------------------------------------------------------------- math_verify
@pytest.mark.parametrize(
    "completion,truth,expected",
    [
        ("Adding up.\nThe answer is: 18", "18", 1.0),
        ("Answer: 18", "18", 1.0),
        (r"so $\boxed{18}$", "18", 1.0),
        ("Combining, the final answer is $18$.", "18", 1.0),
        ("9 * 2 = 18\n#### 18", "18", 1.0),
        ("The answer is: 18 dollars per day.", "18", 1.0),
        (r"The answer is: $\frac{1}{2}$", "0.5", 1.0),  # symbolic equivalence, as math_17k_acc
        (r"Answer: $(3, \frac{\pi}{2})$", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        ("#### 7", "Janet sells 7 eggs.\n#### 7", 1.0),  # a GSM8K solution as ground truth
        (r"\boxed{5}", r"\boxed{5}", 1.0),  # a ground truth stored boxed
        ("Answer: 19", "18", 0.0),
        ("The answer is: 18.5", "18", 0.0),
        ("I do not know.", "18", 0.0),
        ("", "18", 0.0),
    ],
)
def test_math_verify_reads_many_answer_styles(completion, truth, expected):
    res = score("math_verify", completion, truth)
    assert res.score == expected and res.metrics == {"acc": expected}


def test_math_17k_acc_keeps_its_boxed_only_meaning():
    # the same completions that math_verify accepts, without a box, score nothing under math_17k_acc
    for completion in ("The answer is: 18", "Answer: 18", "the final answer is $18$", "#### 18"):
        assert score("math_verify", completion, "18").score == 1.0
        assert score("math_17k_acc", completion, "18").score == 0.0
    assert score("math_17k_acc", r"\boxed{18}", "18").score == 1.0
    assert "math_verify" in registered_verifiers() and get_entry("math_verify").in_process is False


def _style_completions(answer: str, numeric: bool) -> dict[str, str]:
    """One completion per answer style; LaTeX answers in running text are written in $...$, as models do."""
    x = answer if numeric else f"${answer}$"
    styles = {
        "The answer is: X": f"Let me work through it step by step.\nThe answer is: {x}",
        "Answer: X": f"Simplifying the expression.\nAnswer: {x}",
        "boxed": f"So the result is $\\boxed{{{answer}}}$.",
        "the final answer is $X$": f"Combining the steps, the final answer is ${answer}$. I hope it is correct.",
    }
    if numeric:
        styles["#### X"] = f"Adding everything up.\n#### {answer}"
    return styles


@needs_data
def test_math_verify_on_real_answers_in_many_styles():
    # 40 sampled rows of each file; each row's answer in every style, scored against its own answer
    # (should be 1) and against the next sampled row's answer (should be 0), through the time-limited pool
    import random

    gsm = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    m500 = [json.loads(line) for line in (DATA / "math500_test.jsonl").read_text().splitlines()]
    rnd = random.Random(0)
    answers = [(r["answer"].rsplit("####", 1)[1].strip(), True) for r in rnd.sample(gsm, 40)]
    answers += [(r["answer"], parse_number(r["answer"]) is not None) for r in rnd.sample(m500, 40)]
    completions, truths, cases = [], [], []
    for k, (answer, numeric) in enumerate(answers):
        other = answers[(k + 1) % len(answers)][0]
        for style, text in _style_completions(answer, numeric).items():
            completions += [text, text]
            truths += [answer, other]
            cases += [(style, answer, "own"), (style, answer, "other" if quick_equal(answer, other) is not True else "same")]
    rf = reward_fn("math_verify", timeout_s=5.0)
    try:
        out = rf(completions, truths, [{}] * len(truths))
    finally:
        rf.close()
    assert out.timeouts == 0 and out.errors == 0
    by_style: dict[str, dict[str, list[float]]] = {}
    for (style, answer, kind), s in zip(cases, out.scores):
        by_style.setdefault(style, {"own": [], "other": [], "same": []})[kind].append(s)
    for style, res in by_style.items():
        own, other = res["own"], res["other"]
        print(f"math_verify {style}: own {sum(own):.0f}/{len(own)}, other row's answer {sum(other):.0f}/{len(other)}")
        assert len(own) >= 40 and sum(own) >= 0.97 * len(own), style
        assert sum(other) <= 0.02 * len(other), style
    # every style was exercised on MATH-500 LaTeX answers (fractions, intervals, matrices), not only numbers
    assert sum(not numeric for _, numeric in answers) >= 10


# ----------------------------------------------------------------------------- format / geo3k
@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<think>reason</think><answer>4</answer>", 1.0),
        ("  <think>\nreason\n</think>\n<answer> 4 </answer>\n", 1.0),
        ("<think>reason</think>so<answer>4</answer>", 0.0),  # text between the blocks
        ("<answer>4</answer><think>r</think>", 0.0),
        ("<think>a</think><think>b</think><answer>4</answer>", 0.0),
        ("<think>reason</think><answer>4</answer> trailing", 0.0),
        ("<think>" + "x" * 1_000_000, 0.0),
    ],
)
def test_format_reward(completion, expected):
    res = score("format", completion, "")
    assert res.score == expected and res.metrics["format"] == expected


def test_geo3k_weights_accuracy_and_format():
    good = r"<think>the angle is 30</think> The answer is \boxed{30}."
    assert score("geo3k", good, "30").score == pytest.approx(1.0)
    assert score("geo3k", r"<think>hmm</think> \boxed{40}", "30").score == pytest.approx(0.1)
    res = score("geo3k", r"The answer is \boxed{30}", "30")
    assert res.score == pytest.approx(0.9) and res.metrics == {"acc": 1.0, "format": 0.0}
    assert score("geo3k", "no idea", "30").score == 0.0


# ---------------------------------------------------------------------- weighted sum, metrics
def test_weighted_sum_and_acc_source():
    rf = reward_fn(("format", 0.5), ("acc_for_dapo", 1.0))  # both in-process: no pool is started
    out = rf(
        ["<think>r</think><answer>Answer: 4</answer>", "Answer: 5", "<think>r</think><answer>3</answer>"],
        ["4", "4", "4"],
        [{}, {}, {}],
    )
    # format 1/0/1 x 0.5 + dapo: "4</answer>" normalises to "4</answer>" != "4" -> -1; "5" -> -1; none -> -1
    assert out.metrics["format"] == [1.0, 0.0, 1.0]
    assert out.metrics["acc_for_dapo"] == [-1.0, -1.0, -1.0]
    assert out.scores == [-0.5, -1.0, -0.5]
    assert out.metrics["acc"] == [0.0, 0.0, 0.0]  # acc comes from the accuracy verifier, not format
    assert out.means()["format"] == pytest.approx(2 / 3)
    assert rf._pool is None
    rf.close()
    only_format = reward_fn("format")
    assert only_format(["<think>r</think><answer>4</answer>"], ["4"], [{}]).metrics["acc"] == [1.0]


# ---------------------------------------------------------------- time limits, user verifiers
USER_MODULE = '''
import os, signal, time
from postrl.rewards import VerifierResult

def length_bonus(completion, ground_truth, row):
    return min(len(completion), 10) / 10

def uses_row(completion, ground_truth, row):
    return {"score": float(row.get("bonus", 0)), "acc": 1.0}

def slow_python(completion, ground_truth, row):
    while True:  # pure Python: the worker's soft limit interrupts it
        pass

def stuck_in_c(completion, ground_truth, row):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # like a C loop: no signal gets in
    time.sleep(3600)

def crashes(completion, ground_truth, row):
    os._exit(3)

def raises(completion, ground_truth, row):
    raise ValueError("bad input")
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    name = f"postrl_user_verifiers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_verifier_by_path(user_module):
    assert get_entry(f"{user_module}:length_bonus").in_process is False
    rf = reward_fn((f"{user_module}:length_bonus", 2.0), (f"{user_module}:uses_row", 1.0), workers=1)
    try:
        out = rf(["abcde", "x" * 50], ["", ""], [{"bonus": 0.25}, {}])
        assert out.scores == [pytest.approx(1.0 + 0.25), pytest.approx(2.0)]
        assert out.metrics[f"{user_module}:length_bonus"] == [0.5, 1.0]
    finally:
        rf.close()


def test_pathological_inputs_time_out_and_pool_recovers(user_module):
    rf = reward_fn("math_17k_acc", (f"{user_module}:raises", 0.0), timeout_s=1.5, workers=2)
    try:
        warm = rf([r"\boxed{0.5}"], [r"\frac12"], [{}])  # starts the workers
        assert warm.scores == [1.0] and warm.errors == 1  # `raises` is logged, scores 0, run goes on
        completions = [r"\boxed{9^{9^{9^{9}}}}", "y" * 1_000_000 + r"\boxed{2}", "z" * 1_000_000, r"\boxed{\frac{4}{8}}"]
        truths = ["5", "2", "2", "0.5"]
        t0 = time.perf_counter()
        out = rf(completions, truths, [{}] * 4)
        elapsed = time.perf_counter() - t0
        assert out.metrics["math_17k_acc"] == [0.0, 1.0, 0.0, 1.0]
        assert out.timeouts == 1 and out.timed_out == [True, False, False, False]
        assert elapsed < 1.5 + 3.0, f"took {elapsed:.1f} s with a 1.5 s limit"
    finally:
        rf.close()


def test_hard_limit_kills_a_stuck_worker(user_module):
    rf = reward_fn((f"{user_module}:stuck_in_c", 1.0), timeout_s=1.0, workers=1)
    try:
        t0 = time.perf_counter()
        out = rf(["a", "b"], ["", ""], [{}, {}])
        elapsed = time.perf_counter() - t0
        assert out.scores == [0.0, 0.0] and out.timeouts == 2
        assert rf.pool.restarts >= 2
        # two calls one after the other, each killed at 1 s, plus two worker start-ups
        assert elapsed < 60
    finally:
        rf.close()


def test_crashing_and_slow_user_verifiers(user_module):
    rf = reward_fn((f"{user_module}:crashes", 1.0), (f"{user_module}:slow_python", 1.0), timeout_s=1.0, workers=2)
    try:
        out = rf(["a"], [""], [{}])
        assert out.scores == [0.0]
        assert out.errors == 1 and out.timeouts == 1
    finally:
        rf.close()


# ------------------------------------------------------------------------------- throughput
@needs_data
@pytest.mark.slow
def test_2000_verifications_with_pathological_ones_finish():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "verifier_throughput.py"
    spec = importlib.util.spec_from_file_location("verifier_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if not (bench.DATA / "math500_test.jsonl").exists():  # the benchmark reads ../shared/data of the checkout only
        pytest.skip(f"{bench.DATA} not present")
    stats = bench.run(n=2000, n_pathological=20, timeout_s=2.0, workers=2)
    print(f"{stats['per_second']:.1f} verifications/s, {stats['timeouts']} time-outs, {stats['seconds']:.1f} s")
    assert stats["verifications"] == 2000 and stats["errors"] == 0
    assert 1 <= stats["timeouts"] <= 20  # only pathological inputs hit the limit
    # every call is bounded: even if all 20 pathological calls used the whole limit on one worker,
    # the run stays far below "hung"
    assert stats["seconds"] < 20 * 2.0 + 120


def test_math_verify_pathological_completion_times_out():
    rf = reward_fn("math_verify", timeout_s=2.0, workers=1)
    try:
        t0 = time.perf_counter()
        out = rf([r"The answer is $\boxed{9^{9^{9^{9}}}}$", "Answer: 4"], ["5", "4"], [{}, {}])
        elapsed = time.perf_counter() - t0
        assert out.scores == [0.0, 1.0] and out.timeouts == 1 and out.timed_out == [True, False]
        assert elapsed < 60
    finally:
        rf.close()
