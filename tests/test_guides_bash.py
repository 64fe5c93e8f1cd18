"""verl launch scripts read as bash reads them, and every evaluation bounded (issue 64).

The scripts in tests/guides_inputs/verl were written for these tests in the style of verl's example shells: a
backend guard (`[ a ] && [ b ]` then `echo ... >&2; exit 1`), compound tests, text that looks like settings in
echo / printf arguments, here-documents and comments. The hypothesis tests generate scripts and YAML and hold
the reader to returning or refusing, never raising.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from postrl.errors import UserError
from postrl.guides import convert_file
from postrl.guides.reading import MAX_YAML_NODES, load_yaml_lines
from postrl.guides.script import read_script
from postrl.guides.shell import MAX_WORD, Scope, condition_value, quoted_parts, split_commands, unquote, words

SCRIPTS = Path(__file__).resolve().parent / "guides_inputs" / "verl"
GUARD = SCRIPTS / "backend_guard.sh"
HOME = {"HOME": "/h"}


def _settings(**env: str) -> tuple:
    f = convert_file(GUARD, env={**HOME, **env}).flat()
    return f["algorithm.loss_agg_mode"], f["rollout.engine"], f["logging.dir"], f["rollout.n_samples_per_prompt"], f["train.global_batch_size"]


# ------------------------------------------------------------------------------------------ the guard
@pytest.mark.parametrize("env, expected", [
    ({}, ("token-mean", "vllm", "runs/guard-gpu", 4, 64)),  # DEVICE=${DEVICE:-gpu}: bash's default
    ({"DEVICE": "gpu"}, ("token-mean", "vllm", "runs/guard-gpu", 4, 64)),
    ({"DEVICE": "npu"}, ("seq-mean-token-mean", "vllm", "runs/guard-npu", 4, 64)),  # [[ np* && -n ... ]]
    ({"DEVICE": "ascend"}, ("seq-mean-token-mean", "vllm", "runs/guard-ascend", 4, 64)),  # the `||` side
    ({"INFER_BACKEND": "trtllm"}, ("token-mean", "hf", "runs/guard-gpu", 4, 64)),  # `! [ x != vllm ]` is false
    ({"EXPERIMENT": "mine"}, ("token-mean", "vllm", "runs/mine", 4, 64)),  # [ -z ... ] && EXPERIMENT=...: skipped
])  # fmt: skip
def test_the_guarded_script_takes_the_branches_bash_takes(env, expected):
    # echo's "INFER_BACKEND=trtllm ...", printf's "data.train_batch_size=1", the here-document's rollout.n=64 and the
    # comment's optim.lr are text: none is a setting
    assert _settings(**env) == expected
    conv = convert_file(GUARD, env={**HOME, **env})
    assert "train.lr" not in conv.flat() and not any("INFER_BACKEND" in u.source for u in conv.unmapped)


def test_the_guard_stops_the_script_where_bash_would():
    with pytest.raises(UserError) as exc:
        convert_file(GUARD, env={**HOME, "DEVICE": "npu", "INFER_BACKEND": "trtllm"})
    text = str(exc.value)
    assert "line 13: the script stops here with `exit 1` after printing 'INFER_BACKEND=trtllm is only supported with DEVICE=gpu' (line 12)" in text
    assert len(exc.value.problems) == 1  # nothing after the exit is read
    assert "stops here with `exit 2`, as bash would" in read_script('echo ""\n[ "$#" -lt 1 ] && exit 2\n').refused[0]  # no arguments


def test_a_guard_on_an_unknown_device_decides_by_the_known_side(tmp_path):
    """false && unknown is false: the guard does not need DEVICE while INFER_BACKEND is vllm; the branches that do
    are refused naming the --env that settles them."""
    text = GUARD.read_text().replace("DEVICE=${DEVICE:-gpu}", "DEVICE=$(detect_device)")
    reading = read_script(text, HOME)
    assert any(n.startswith('line 11: `if [ "${DEVICE}" = npu ] && [ "${INFER_BACKEND}" = trtllm ]` is false') for n in reading.notes)
    assert reading.refused and all("through the `if` at line 16" in r and "pass --env DEVICE=VALUE" in r for r in reading.refused)
    src = tmp_path / "run.sh"
    src.write_text(text)
    assert convert_file(src, env={**HOME, "DEVICE": "gpu", "INFER_BACKEND": "trtllm"}).flat()["rollout.engine"] == "hf"
    assert convert_file(src, env={**HOME, "DEVICE": "npu"}).flat()["algorithm.loss_agg_mode"] == "seq-mean-token-mean"


def test_an_exit_in_a_branch_postrl_cannot_choose_is_noted_not_taken():
    text = "cd $(mktemp -d) || exit 1\n[ -d /opt/x ] && exit 3\npython3 -m verl.trainer.main_ppo trainer.experiment_name=e\n"
    reading = read_script(text)
    assert [(i.key, i.value) for i in reading.items] == [("trainer.experiment_name", "e")] and not reading.refused
    assert any(n.startswith("line 2: `exit 3` runs only if the condition `[ -d /opt/x ]`") for n in reading.notes)
    assert read_script("exit 0\npython3 -m x trainer.experiment_name=e\n").items == []  # exit 0: nothing after it runs
    probe = "command -v nvidia-smi && DEVICE=cuda || DEVICE=npu\npython3 -m m trainer.device=$DEVICE\n"
    [refusal] = read_script(probe).refused  # a probe's status is unknown: so is what it chooses
    assert "the command `command -v nvidia-smi` (postrl runs nothing, so whether it succeeds is unknown)" in refusal
    assert "pass --env DEVICE=VALUE" in refusal
    assert [i.value for i in read_script(probe, {"DEVICE": "cuda"}).items] == ["cuda"]


@pytest.mark.parametrize("test, value", [
    ('[ a = a ]', True), ('[ a != a ]', False), ('[ ! a = b ]', True), ('[ -z "" ]', True), ('[ -n "" ]', False),
    ('[ 3 -lt 10 ]', True), ("[[ abc == a* ]]", True), ("[[ abc == 'a*' ]]", False), ("[[ a == a && ! b == c ]]", True),
    ("[[ ( a == b || c == c ) && -n x ]]", True), ("[[ a == b || a == c ]]", False), ('test x == x', True),
    ("[ -d /x ]", None), ("[[ a =~ b ]]", None), ("[ a = ]", None),
])  # fmt: skip
def test_single_tests_as_bash_evaluates_them(test, value):
    assert condition_value([w for _, w in words(test)]) is value


def test_echo_printf_heredoc_and_comments_are_never_settings():
    text = """echo actor_rollout_ref.rollout.n=64
printf 'trainer.total_epochs=%s\\n' 3 | tee -a log
cat <<-'END' > overrides.txt
\tactor_rollout_ref.actor.optim.lr=1
\tEND
echo "a <<EOF does not open a here-document"
python3 -m verl.trainer.main_ppo trainer.experiment_name=e  # trainer.total_epochs=9
"""
    reading = read_script(text)
    assert [(i.key, i.value, i.line) for i in reading.items] == [("trainer.experiment_name", "e", 7)] and not reading.refused


def test_one_scanner_for_quotes_and_substitutions():
    """Backticks, $(...) and quotes hide separators and blanks from every splitter alike."""
    text = """A=`echo "x; y"`; B=$(echo 'a && b') && C="${D:-p q}" ; echo `date`"""
    assert [text[a:b].strip() for a, b, _ in split_commands(text)] == ['A=`echo "x; y"`', "B=$(echo 'a && b')", 'C="${D:-p q}"', "echo `date`"]
    assert [w for _, w in words("x `a b` \"c d\" $(e f) ${g:-h i}")] == ["x", "`a b`", '"c d"', "$(e f)", "${g:-h i}"]
    assert unquote("'a b'\"c\\\"d\"\\ e") == 'a bc"d e'
    assert quoted_parts("a*'b*'") == [("a*", False), ("b*", True)]
    # a quoted value runs on to the next line; `#` inside it is not a comment
    reading = read_script('X="a # b\nc"\npython3 -m m trainer.experiment_name="$X"\n')
    assert [i.value for i in reading.items] == ["a # b\nc"]


# ----------------------------------------------------------------------------------------------- bounds
def _refusal_in(reading, seconds: float, start: float) -> str:
    assert time.monotonic() - start < seconds
    assert len(reading.refused) == 1, reading.refused
    return reading.refused[0]


def test_a_long_sum_is_refused_not_a_recursion_error():
    start = time.monotonic()
    r = read_script("X=$((" + "+".join(["1"] * 3000) + "))\npython3 -m m actor_rollout_ref.rollout.n=$X\n")
    assert "more than 200 operators" in _refusal_in(r, 5, start)


def test_variables_that_fan_out_are_refused_within_the_budget():
    script = "A0=1\n" + "".join(f'A{i + 1}="$A{i}+$A{i}"\n' for i in range(40)) + "python3 -m m actor_rollout_ref.rollout.n=$((A40))\n"
    start = time.monotonic()
    assert "longer than postrl reads" in _refusal_in(read_script(script), 10, start)
    # the same fan-out through arithmetic on names (each read evaluates the expression again)
    script = "A0=1\n" + "".join(f"A{i + 1}={'+'.join([f'A{i}'] * 10)}\n" for i in range(12)) + "python3 -m m actor_rollout_ref.rollout.n=$((A12))\n"
    start = time.monotonic()
    assert "expansion steps" in _refusal_in(read_script(script), 10, start)


def test_a_replacement_is_measured_before_it_is_built():
    start = time.monotonic()
    r = read_script("A=" + "x" * 5000 + "\nB=${A//x/$A}\npython3 -m m actor_rollout_ref.rollout.n=$B\n")
    assert "longer than postrl reads" in _refusal_in(r, 5, start)
    r = read_script("A=" + "y" * 9000 + "\n" + "python3 -m m actor_rollout_ref.model.path=" + "$A" * 200 + "\n")
    assert "longer than postrl reads" in r.refused[0] and MAX_WORD * 10 < 9000 * 200


def test_a_yaml_alias_bomb_is_refused(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    start = time.monotonic()
    with pytest.raises(UserError, match=f"expand to more than {MAX_YAML_NODES:,} values"):
        convert_file(bomb)
    r = read_script("python3 -m m actor_rollout_ref.rollout.n='[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]) + ", "
                    + ", ".join(f"&b{i} [" + ", ".join(["*a" if i == 0 else f"*b{i - 1}"] * 10) + "]" for i in range(8)) + "]'\n")  # fmt: skip
    assert "expand to more than" in r.refused[0]
    assert time.monotonic() - start < 5
    huge = tmp_path / "huge.sh"
    huge.write_bytes(b"#" * (9 << 20))
    with pytest.raises(UserError, match="larger than 8 MB"):
        convert_file(huge)
    ok = tmp_path / "ok.yaml"  # anchors that expand to little are read as YAML reads them
    ok.write_text("base: &b {clip_ratio: 0.2}\nactor_config: *b\n")
    assert load_yaml_lines(ok.read_text(), "ok")[0]["actor_config"] == {"clip_ratio": 0.2}


# ------------------------------------------------------------------------------------------- hypothesis
_FRAGMENTS = st.sampled_from([
    "A=1", "B=$((A*2+3))", 'C="${A:-x} ${B}"', "D=$(date)", "E=`uname`", "F=${C//x/$C}", "G=${#C}", "H=$((H+1))",
    'if [ "$A" = 1 ] && [ -n "$B" ]; then', "elif [[ $C == x* || ! -z $D ]]; then", "else", "fi", 'case "$A" in',
    "1|2) I=one ;;", "*) I=other ;;", "esac", "echo \"K=v\" >&2", "exit 1", "exit 0", "cat <<EOF", "EOF", "for i in 1 2; do",
    "done", "f() {", "}", "x && y || z", "[ -d /x ] || A=2", "'unterminated", '"also', "$((", "${", "`", "\\", "#c",
    "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.n=$A trainer.experiment_name=$D",
    "actor_rollout_ref.actor.optim.lr=$B", "data.train_batch_size=$((B*B*B*B*B*B))", "X=$X$X$X$X", "Y=${Y:-${Y:-${Y:-1}}}",
])  # fmt: skip


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_FRAGMENTS, st.text(max_size=40)), max_size=30), st.sampled_from([" ", "\n", "; ", " && ", " | "]))
def test_generated_scripts_are_read_or_refused_never_raised(fragments, joint):
    reading = read_script(joint.join(fragments))
    assert isinstance(reading.items, list) and all(isinstance(p, str) for p in reading.refused + reading.notes)


@settings(max_examples=100, deadline=2000)
@given(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10)),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=20),
       st.integers(0, 12))  # fmt: skip
def test_generated_yaml_is_read_or_refused_never_raised(tmp_path_factory, tree, aliases):
    import yaml

    text = yaml.safe_dump({"rl_config": tree}) + "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}' if i else '1'] * 6)}]\n" for i in range(aliases))
    path = tmp_path_factory.mktemp("y") / "c.yaml"
    path.write_text(text)
    try:
        convert_file(path)
    except UserError:
        pass


def test_the_scope_starts_from_the_script_and_env_only(monkeypatch):
    """The process environment is not read: $HF_TOKEN in a name is refused, not copied into the run's directory."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("MODEL", "from-the-environment")
    r = read_script("MODEL=${MODEL:-Qwen/Q}\npython3 -m m actor_rollout_ref.model.path=$MODEL trainer.experiment_name=$HF_TOKEN\n")
    assert [i.value for i in r.items] == ["Qwen/Q"]
    assert "hf_secret" not in " ".join(r.refused + r.notes) and "--env HF_TOKEN" in r.refused[0]
    assert [i.value for i in read_script("python3 -m m trainer.experiment_name=$HF_TOKEN\n", {"HF_TOKEN": "run1"}).items] == ["run1"]
    assert Scope({}).values == {}
    assert [i.value for i in read_script("D=${DATA_ROOT:-$PWD}\npython3 -m m trainer.default_local_dir=$D/ckpt\n").items] == [f"{Path.cwd()}/ckpt"]
    assert [i.value for i in read_script('D="$(pwd)"\npython3 -m m trainer.default_local_dir=$D/c\n').items] == [f"{Path.cwd()}/c"]
