"""A verl launch script read as the shell would run it, without running anything (postrl.guides.shell).

Each command of the script ends as the script's variable, an `Item` (a `key=value` of the trainer's command
line, with its line), a note, or a refusal that names its line. `case` and `if` take the branch the shell
would take when the value they test is known; when it is not (a command's output, an unset variable, a test
postrl does not evaluate), the variables set in the branches are unknown for the same reason, and so are the
values computed from them. An unknown value is refused only where it decides what is trained, naming the
`--env VAR=...` that settles it; in a key that only names things (experiment and project names, log and
checkpoint paths) the command's name stands in for its output, with a note.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

from postrl.errors import UserError
from postrl.guides.reading import Item, Reading, TooLarge, _logical_lines, yaml_value
from postrl.guides.shell import (
    Exhausted,
    Scope,
    ShellError,
    Unknown,
    case_matches,
    condition_value,
    expand,
    kleene_and,
    kleene_or,
    split_commands,
    top_level,
    unquote,
    words,
)

_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_FUNCTION = re.compile(r"(?:function\s+)?[A-Za-z_][A-Za-z0-9_.-]*\s*\(\)\s*\{?$|function\s+[A-Za-z_][A-Za-z0-9_.-]*\s*\{?$")
_LOOPS = ("for", "while", "until", "select")
HYDRA_FLAGS = {"--config-name": "--config-name", "-cn": "--config-name", "--config-path": "--config-path", "-cp": "--config-path",
               "--config-dir": "--config-dir", "-cd": "--config-dir"}  # fmt: skip
_KEY = re.compile(r"~?[A-Za-z_][A-Za-z0-9_.\-/@]*")  # a Hydra key (after its + / ++ prefix)
# Commands whose arguments are text, paths or tests, never the trainer's overrides: `echo "A=b"` prints A=b.
TEXT_COMMANDS = frozenset({
    "echo", "printf", "cat", "tee", "read", "test", "[", "[[", ":", "true", "false", "exit", "return", "cd", "pushd",
    "popd", "mkdir", "rm", "cp", "mv", "ln", "touch", "chmod", "chown", "ls", "sleep", "wait", "kill", "set", "unset",
    "shift", "trap", "ulimit", "source", ".", "logger", "sed", "awk", "grep", "date", "hostname", "nvidia-smi",
    "npu-smi", "pip", "pip3", "git", "wget", "curl", "eval", "alias", "command", "type", "which", "basename", "dirname",
})  # fmt: skip
# Commands taken to succeed before `&&` / `||` (a launch script's setup: `cd "$DIR" || exit 1` reads on).
SETUP_COMMANDS = frozenset({
    "cd", "pushd", "popd", "mkdir", "cp", "mv", "ln", "touch", "chmod", "chown", "rm", "echo", "printf", "export", "set",
    "unset", "source", ".", "sleep", "wait", "tee", "cat", "shift", "trap", "ulimit", "alias", "logger", "local", "declare",
    "readonly",
})  # fmt: skip


@dataclass
class _Frame:
    kind: str  # case | if | function | loop
    outer: str  # the mode around it: on | off | unknown
    line: int
    mode: str = "off"  # the mode of the branch being read
    decided: bool = False  # a branch was taken: the later ones are not
    unknown: Unknown | None = None  # why its branches cannot be chosen
    value: str = ""  # case: the word
    in_clause: bool = False
    patterns: list[str] = field(default_factory=list)


class _Reader:
    def __init__(self, env: dict[str, str]):
        from postrl.guides.verl import NAMES, VERL, VERL_HEADS

        self.table, self.names = VERL, NAMES
        self.heads = (*VERL_HEADS, "data.", "algorithm.")
        self.given = dict(env)
        # the script's own assignments and --env only (the environment is never read), and $PWD, which bash itself sets
        self.scope = Scope({"PWD": os.getcwd(), **env})
        self.reading = Reading()
        self.frames: list[_Frame] = []
        self.unset_refused: set[str] = set()
        self.stopped = False  # an `exit` the shell takes for certain: nothing after it runs
        self.said: tuple[int, str] | None = None  # the last line an echo / printf printed (an exit's message)

    def expand(self, word: str, n: int) -> str:
        """The word expanded; a construct postrl does not read makes it unknown (refused only where it matters)."""
        try:
            return expand(word, self.scope, n)
        except Exhausted:
            raise
        except ShellError as exc:
            key, value = re.match(r"([^=$`'\"\\]+=)?(.*)", word, re.S).groups()  # NAME= / key= stays readable
            return (key or "") + self.scope.mark(Unknown(f"`{value[:60]}` ({str(exc).split('. Fix:')[0]})", n))

    @property
    def mode(self) -> str:
        return self.frames[-1].mode if self.frames else "on"

    # ----------------------------------------------------------------------------------- control
    def and_or(self, chain: list[tuple[str, list[tuple[int, str]]]]) -> None:
        """Commands joined by `&&` / `||`: each runs as bash would decide from the statuses before it. A test's
        status is evaluated (unknown when its values are); an assignment and a setup command (`cd`, `mkdir`,
        `export`, ...: SETUP_COMMANDS) are taken to succeed, the path a launch script is written for; any other
        command's status is unknown (`command -v nvidia-smi && DEVICE=gpu || DEVICE=npu` leaves DEVICE unknown).
        A command whose turn is unknown runs in an unknown branch."""
        first = "".join(t for _, t in chain[0][1]).split(None, 1)[:1]
        if len(chain) == 1 or (first and first[0] in ("if", "elif", "while", "until")):
            self.command([p for _, pieces in chain for p in pieces] if len(chain) == 1 else self._joined(chain))
            return
        status, why = True, None
        for op, pieces in chain:
            if (op == "&&" and status is False) or (op == "||" and status is True):
                continue  # bash skips it
            unsure = bool(op) and status is None  # its turn depends on a test postrl could not decide
            if unsure:
                u = why or Unknown("a test postrl does not evaluate", pieces[0][0])
                self.frames.append(_Frame("list", self.mode, pieces[0][0], mode="off" if self.mode == "off" else "unknown", unknown=u))
            try:
                value, u = self.status(pieces)
                if value is None and u is None:  # not a test: run it (postrl runs nothing of it)
                    self.command(pieces)
                    value, u = self.succeeds(pieces)
            finally:
                if unsure:
                    self.frames.pop()
            status = kleene_and(status, value) if op == "&&" else kleene_or(status, value) if op == "||" else value
            why = u or why

    def _joined(self, chain: list[tuple[str, list[tuple[int, str]]]]) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        for op, pieces in chain:
            if op:
                out.append((pieces[0][0], op))
            out += pieces
        return out

    def succeeds(self, pieces: list[tuple[int, str]]) -> tuple[bool | None, Unknown | None]:
        """The status of a command that is not a test: True for assignments and setup commands, else unknown."""
        text = "".join(t for _, t in pieces).strip()
        head = next((w for _, w in words(text) if not _ASSIGN.match(w)), None)
        if head is None or unquote(head) in SETUP_COMMANDS:
            return True, None
        return None, Unknown(f"the command `{text[:60]}` (postrl runs nothing, so whether it succeeds is unknown)", pieces[0][0])

    def status(self, pieces: list[tuple[int, str]]) -> tuple[bool | None, Unknown | None]:
        """(status, why unknown) of one command of an and-or list: a test's value; True for any other command."""
        text = "".join(t for _, t in pieces).strip()
        negate = text.startswith("! ")
        text = text[2:].strip() if negate else text
        head = text.split(None, 1)[0] if text else ""
        if head in ("true", ":"):
            value, unknown = True, None
        elif head == "false":
            value, unknown = False, None
        elif head in ("[", "[[", "test"):
            value, unknown = self.test(text, pieces[0][0])
        else:
            return None, None  # not a test: the caller runs it (and takes it to succeed)
        return (value if value is None or not negate else not value), unknown

    def test(self, text: str, n: int) -> tuple[bool | None, Unknown | None]:
        """A test command's value as bash finds it, or (None, why) when a value in it is unknown."""
        value = self.expand(text, n)
        unknown = self.scope.unknowns_in(value)
        try:
            result = condition_value([w for _, w in words(value)])
        except ShellError:
            result = None
        if result is not None:  # decided by known values (an unknown one the result does not depend on is fine)
            return result, None
        return None, unknown[0] if unknown else Unknown(f"the condition `{text[:60]}` (a test postrl does not evaluate)", n)

    def condition_of(self, cond: str, n: int) -> tuple[bool | None, Unknown | None]:
        """An `if` / `elif` condition: tests joined by `&&` / `||` (left to right, equal precedence, as bash), each
        with an optional `!`; three-valued (false && ?, true || ? are decided)."""
        parts = split_commands(cond)
        value, why, op = None, None, None
        for start, end, sep in parts:
            text = cond[start:end].strip()
            v, u = self.status([(n, text)])
            if v is None and u is None:  # a command, not a test: its status is not known
                u = Unknown(f"the command `{text[:60]}` in a condition (postrl runs nothing)", n)
            value = v if op is None else kleene_and(value, v) if op == "&&" else kleene_or(value, v)
            why = why or (u if v is None else None)
            op = sep if sep in ("&&", "||") else None
        return value, (why if value is None else None)

    def command(self, pieces: list[tuple[int, str]]) -> None:
        text = "".join(t for _, t in pieces).strip()
        n = pieces[0][0]
        first, _, rest = text.partition(" ")
        rest = rest.strip()
        top = self.frames[-1] if self.frames else None
        if top and top.kind == "case" and text == ";;":
            top.in_clause = False
            return
        if top and top.kind == "case" and first == "esac":
            self.close("case", n)
            return
        if top and top.kind == "case" and not top.in_clause:
            self.clause(top, text, n, pieces)
            return
        if first == "case":
            m = re.match(r"case\s+(.+?)\s+in(?:\s+(.*))?$", text, re.S)
            if not m:
                raise ShellError(f"'{text[:60]}' is not of the form `case WORD in`")
            self.open_case(m[1], n)
            if m[2]:
                self.command([(n, m[2])])
            return
        if first in ("if", "elif"):
            self.condition(first, rest, n)
            return
        if first in ("then", "else", "do"):
            if first == "else":
                self.other_branch(n)
            if rest:
                self.command([(n, rest)])
            return
        if first in ("fi", "done") or (text == "}" and top and top.kind == "function"):
            self.close({"fi": "if", "done": "loop", "}": "function"}[first], n)
            return
        if _FUNCTION.fullmatch(text):
            self.frames.append(_Frame("function", self.mode, n, mode="off"))
            self.reading.notes.append(f"line {n}: `{text}` defines a shell function; its body is not read (postrl reads no calls of it)")
            return
        if first in _LOOPS:
            why = Unknown(f"the loop `{text[:60]}` (postrl does not run loops)", n)
            self.frames.append(_Frame("loop", self.mode, n, mode="off" if self.mode == "off" else "unknown", unknown=why))
            return
        if text == "{" or first == "(":
            return
        if self.mode == "off":
            return
        if first in ("exit", "return") and not any(f.kind == "function" for f in self.frames):
            self.exit(text, n)
            return
        self.simple(pieces)

    def exit(self, text: str, n: int) -> None:
        """`exit N` read where bash would: certain -> the script ends there (N != 0: refused, with the message it
        printed); in a branch postrl cannot choose -> noted, and the rest is read as where it does not exit."""
        code = unquote(self.expand(text.split(None, 1)[1], n)) if len(text.split()) > 1 else "0"
        if self.mode == "unknown":
            u = self.frames[-1].unknown
            self.reading.notes.append(f"line {n}: `{text}` runs only if {self._chosen(u)} says so; postrl reads on, as where it does not")
            return
        self.stopped = True
        if code.strip() == "0":
            self.reading.notes.append(f"line {n}: `{text}`: the script ends here, as bash would; nothing after it runs")
            return
        said = f" after printing '{self.said[1]}' (line {self.said[0]})" if self.said and self.said[1] else ""
        self.reading.refused.append(
            f"line {n}: the script stops here with `{text}`{said}, as bash would with these values, so it trains "
            f"nothing. Fix: the values that lead here (--env, or the script itself)."
        )

    def open_case(self, word: str, n: int) -> None:
        frame = _Frame("case", self.mode, n)
        if frame.outer != "off":
            value = self.expand(word, n)
            unknown = self.scope.unknowns_in(value)
            if unknown or frame.outer == "unknown":
                frame.unknown = unknown[0] if unknown else self.frames[-1].unknown  # (the enclosing frame's)
            frame.value = unquote(value)
        self.frames.append(frame)

    def clause(self, frame: _Frame, text: str, n: int, pieces: list) -> None:
        body = text.strip().removeprefix("(")
        close = next((i for i, c in top_level(body) if c == ")"), None)
        if close is None or not body[:close].strip():
            raise ShellError(f"'{text[:60]}' is neither a case pattern `pat)` nor `esac`")
        bars = [-1] + [i for i, c in top_level(body[:close]) if c == "|"] + [close]
        patterns = [body[a + 1 : b].strip() for a, b in zip(bars, bars[1:])]
        shown, rest = body[:close].strip(), body[close + 1 :].strip()
        frame.in_clause = True
        frame.patterns += patterns
        if frame.outer == "off":
            frame.mode = "off"
        elif frame.unknown is not None:
            frame.mode = "unknown"
            frame.unknown.choices += [p for p in patterns if p not in frame.unknown.choices and not any(ch in p for ch in "*?[")]
            where = f"the case at line {frame.line}"
            if where not in frame.unknown.chooses:
                frame.unknown.chooses.append(where)
        elif not frame.decided and case_matches(frame.value, [expand(p, self.scope, n) for p in patterns]):
            frame.mode, frame.decided = "on", True
            self.reading.notes.append(f"line {n}: case `{frame.value}` takes the branch `{shown})`, as the shell would")
        else:
            frame.mode = "off"
        if rest:
            self.command([(n, rest)])

    def condition(self, keyword: str, cond: str, n: int) -> None:
        if keyword == "if":
            frame = _Frame("if", self.mode, n)
            self.frames.append(frame)
        else:
            frame = self.frames[-1] if self.frames and self.frames[-1].kind == "if" else None
            if frame is None:
                raise ShellError("`elif` outside an `if`")
        if frame.outer == "off" or frame.decided:
            frame.mode = "off"
            return
        if frame.outer == "unknown" or frame.unknown is not None:
            frame.unknown = frame.unknown or self.frames[-2].unknown
            frame.mode = "unknown"
            return
        cond = cond.rstrip().removesuffix("then").rstrip().removesuffix(";").rstrip()
        result, why = self.condition_of(cond, n)
        if result is None:
            frame.unknown = why or Unknown(f"the condition `{cond[:60]}` (a test postrl does not evaluate)", n)
            frame.mode = "unknown"
            where = f"the `if` at line {n}"
            if where not in frame.unknown.chooses:
                frame.unknown.chooses.append(where)
            return
        frame.mode, frame.decided = ("on", True) if result else ("off", False)
        self.reading.notes.append(f"line {n}: `{keyword} {cond}` is {'true' if result else 'false'}, as the shell would find it")

    def other_branch(self, n: int) -> None:
        frame = self.frames[-1] if self.frames and self.frames[-1].kind == "if" else None
        if frame is None:
            raise ShellError("`else` outside an `if`")
        if frame.outer == "off" or frame.decided:
            frame.mode = "off"
        elif frame.unknown is not None:
            frame.mode = "unknown"
        else:
            frame.mode, frame.decided = "on", True

    def close(self, kind: str, n: int) -> None:
        if not self.frames or self.frames[-1].kind != kind:
            raise ShellError(f"a closing word with no open {kind}")
        self.frames.pop()

    # ------------------------------------------------------------------------------ simple commands
    def simple(self, pieces: list[tuple[int, str]]) -> None:
        text = "".join(t for _, t in pieces)
        starts, total = [], 0
        for m, t in pieces:
            starts.append((total, m))
            total += len(t)

        def line_at(offset: int) -> int:
            return next(m for s, m in reversed(starts) if s <= offset)

        tokens: list[tuple[str, int]] = []
        for offset, word in words(text):
            n = line_at(offset)
            if word == "|":  # a pipe: the next command's words
                self.tokens(tokens)
                tokens = []
                continue
            try:
                tokens += [(tok, n) for tok in shlex.split(self.expand(word, n), posix=True)]
            except ValueError as exc:
                raise ShellError(f"{exc} (an unbalanced quote). Fix: close the quote") from None
        self.tokens(tokens)

    def tokens(self, tokens: list[tuple[str, int]]) -> None:
        r = self.reading
        head_done, skip_next, declare = False, False, False
        for k, (tok, n) in enumerate(tokens):
            if skip_next:
                skip_next = False
                continue
            key, sep, raw = tok.partition("=")
            key = key.lstrip("+")
            if not head_done and tok in ("export", "local", "readonly", "declare"):
                declare = True
                continue
            if not head_done and sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) and key not in ("data", "trainer", "algorithm"):
                self.assign(key, raw, n)
                continue
            if not head_done and declare and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tok):
                continue  # `export NAME` of a variable set before
            if not head_done and not sep and tok in TEXT_COMMANDS:  # its arguments are text, never overrides
                shown = self.scope.substitute(" ".join(t for t, _ in tokens[k:] if not re.fullmatch(r"\d*[<>]+&?\S*", t)))
                if tok in ("echo", "printf"):
                    self.said = (n, shown.partition(" ")[2].strip()[:120])
                r.notes.append(f"line {n}: the command `{shown[:80]}`: skipped (not configuration)")
                return
            if sep and not tok.startswith("-") and _KEY.fullmatch(key):
                head_done = True
                if self.mode == "unknown":
                    u = self.frames[-1].unknown
                    r.refused.append(f"line {n}: {key} is given inside {self._chosen(u)}, so whether it is given is unknown. Fix: {self._fix(u)}.")
                elif tok.startswith("~"):
                    r.refused.append(f"line {n}: '{tok}' deletes a key of verl's config; postrl's config has no such key. Fix: remove it.")
                else:
                    self.item(key, raw, n)
                continue
            if tok.startswith(self.heads) or tok in self.table:
                nxt = tokens[k + 1][0] if k + 1 < len(tokens) else ""
                r.refused.append(
                    f"line {n}: '{tok} {nxt}'".rstrip() + " is written `key value`; verl (Hydra) reads only key=value, so "
                    f"it would not be applied. Fix: write {tok}={nxt or '<value>'}."
                )
                skip_next = bool(nxt) and "=" not in nxt
                head_done = True
                continue
            if not head_done:
                shown = " ".join(self.scope.substitute(t) for t, _ in tokens if "=" not in t)[:80]
                r.notes.append(f"line {n}: the command `{shown}`: skipped (not configuration)")
                head_done = True
            flag, eq, value = tok.partition("=")
            if flag in HYDRA_FLAGS:  # the config verl starts from: which defaults the keys are read against
                if not eq:
                    value, skip_next = (tokens[k + 1][0] if k + 1 < len(tokens) else ""), True
                unknown = self.scope.unknowns_in(value)
                if unknown:
                    r.refused.append(f"line {n}: {flag} takes a value that comes from {self._chosen(unknown[0])}, and it decides "
                                     f"verl's defaults for every key. Fix: {self._fix(unknown[0])}.")  # fmt: skip
                else:
                    r.hydra.append((HYDRA_FLAGS[flag], self.scope.substitute(value), n))
                continue
            if tok == "-m" and k + 1 < len(tokens):
                r.entry = r.entry or tokens[k + 1][0]
                skip_next = True

    def assign(self, name: str, raw: str, n: int) -> None:
        r = self.reading
        if name in self.given:  # --env wins over the script's own value
            r.notes.append(f"line {n}: {name}=...: a variable of the script; --env {name}={self.given[name]} wins")
            return
        if self.mode == "unknown":  # set in a branch postrl cannot choose: unknown for the same reason
            raw = self.scope.mark_of(self.frames[-1].unknown)
        for u in self.scope.unknowns_in(raw):
            if u.var is None:
                u.var = name
        self.scope.values[name] = raw
        unknown = self.scope.unknowns_in(raw)
        if unknown and not unknown[0].unset:
            r.notes.append(f"line {n}: {name}: its value comes from {unknown[0].what}, which postrl does not run (see where it is used)")
        elif not unknown:
            r.notes.append(f"line {n}: {name}={raw}: a variable of the script (used where ${name} appears), not a verl key")

    def item(self, key: str, raw: str, n: int) -> None:
        r = self.reading
        unknown = self.scope.unknowns_in(raw)
        for u in unknown:
            if u.unset:
                if u.var not in self.unset_refused:
                    self.unset_refused.add(u.var or "")
                    r.refused.append(
                        f"line {n}: ${u.var} is not set by the script (postrl reads the environment only for the names passed with "
                        f"--env), so its value is unknown. Fix: pass --env {u.var}=VALUE to convert-config / postrl train, or --env "
                        f"{u.var} to take your environment's value."
                    )
                return
        if unknown and key in self.names:
            value = self.scope.substitute(raw)
            for u in unknown:
                r.notes.append(
                    f"line {n}: {key}: {u.what} (line {u.line}) is not run; '{u.placeholder}' stands in for its output in "
                    f"the name ({value}). Fix, to choose the name: {self._fix(u)}"
                )
            raw = value
        elif unknown:
            u = unknown[0]
            r.refused.append(
                f"line {n}: {key} takes a value that comes from {self._chosen(u)}; postrl runs nothing of the script, and "
                f"this value decides what is trained. Fix: {self._fix(u)}."
            )
            return
        r.items.append(Item(key, yaml_value(raw), n, raw))

    @staticmethod
    def _chosen(u: Unknown) -> str:
        via = f" through {' and '.join(u.chooses)}" if u.chooses else ""
        return f"{u.what} (line {u.line}){via}"

    @staticmethod
    def _fix(u: Unknown) -> str:
        if u.var is None:
            return "write the value in the file"
        choices = f" (the script chooses by it among: {', '.join(u.choices)})" if u.choices else ""
        value = u.choices[0] if len(u.choices) == 1 else "VALUE"
        return f"pass --env {u.var}={value} to convert-config / postrl train (--env {u.var} alone takes your environment's value){choices}"


def _heredoc(line: str) -> str | None:
    """The terminator of a here-document a line opens (`cat <<EOF`, `<<-'EOF'`), found outside quotes and
    comments; None if it opens none."""
    try:
        for i, c in top_level(line):
            if c == "#" and (i == 0 or line[i - 1].isspace()):
                return None
            if line.startswith("<<", i) and not line.startswith("<<<", i):
                m = re.match(r"<<-?\s*(['\"]?)\\?([A-Za-z_][A-Za-z0-9_]*)\1", line[i:])
                return m[2] if m else None
    except ShellError:
        return None
    return None


def _blank_heredocs(text: str) -> tuple[str, list[str]]:
    """The text with here-document bodies blanked (they are a command's input, never configuration), lines kept."""
    out, notes, end, first, tabs = [], [], None, 0, False
    for n, line in enumerate(text.splitlines(), 1):
        if end is not None:
            if (line.lstrip("\t") if tabs else line) == end:
                notes.append(f"line {first}: a here-document (lines {first + 1}-{n}): the input of a command, not configuration")
                end = None
            out.append("")
            continue
        end = _heredoc(line)
        if end is not None:
            first, tabs = n, "<<-" in line
        out.append(line)
    return "\n".join(out), notes


def read_script(text: str, env: dict[str, str] | None = None) -> Reading:
    """A verl launch script or override file as bash would read it: `key=value` items with their lines.

    Variables come from `env` (`--env KEY=VALUE`) and the script's own assignments (`MODEL=...`, `export
    MODEL=...`); the process environment is never read. A command word and its flags are skipped with a note (the
    module after `-m` is kept as `Reading.entry`); the arguments of echo, printf and the like are text; a verl
    key written `key value` is refused. Every evaluation is bounded (postrl.guides.shell): a bound hit is refused
    like any line postrl cannot read."""
    reader = _Reader(dict(env or {}))
    text, heredocs = _blank_heredocs(text)
    lines, reader.reading.notes = _logical_lines(text)
    reader.reading.notes += heredocs
    for pieces in lines:
        if reader.stopped:
            break
        joined = "".join(t for _, t in pieces)
        try:
            spans = split_commands(joined)
        except ShellError:  # an unterminated quote: the command as one (its expansion says what is wrong)
            spans = [(0, len(joined), "")]
        chain: list[tuple[str, list]] = []
        op = ""
        for start, end, sep in spans:
            chain.append((op, _cut(pieces, start, end)))
            op = sep if sep in ("&&", "||") else ""
            if op:
                continue
            sub = [p for _, c in chain for p in c]
            try:
                reader.and_or(chain)
            except Exhausted as exc:
                reader.reading.refused.append(f"line {sub[0][0]}: {exc}. Fix: write the values out in the file.")
                reader.stopped = True
            except (ShellError, TooLarge, UserError) as exc:
                first, last = sub[0][0], sub[-1][0]
                where = f"line {first}" if first == last else f"lines {first}-{last}"
                why = (" ".join(exc.problems) if isinstance(exc, UserError) else str(exc)).rstrip(".")
                fix = "" if "Fix:" in why else ". Fix: write the value in the file (postrl runs nothing of the script)"
                reader.reading.refused.append(f"{where}: {why}{fix}.")
            chain = []
            if reader.stopped:
                break
    if not reader.stopped:
        for frame in reader.frames:
            reader.reading.refused.append(f"line {frame.line}: this {frame.kind} is never closed. Fix: close it ({'esac' if frame.kind == 'case' else 'fi'}).")
    reader.reading.notes.sort(key=lambda note: int(re.match(r"line (\d+)", note)[1]) if re.match(r"line \d+", note) else 0)
    return reader.reading


def _cut(pieces: list[tuple[int, str]], start: int, end: int) -> list[tuple[int, str]]:
    """The pieces (with their lines) of the command at [start, end) of their joined text."""
    sub, pos = [], 0
    for m, t in pieces:
        lo, hi = max(start - pos, 0), min(end - pos, len(t))
        if lo < hi:
            sub.append((m, t[lo:hi]))
        pos += len(t)
    return sub
