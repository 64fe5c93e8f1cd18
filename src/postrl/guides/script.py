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

from postrl.guides.reading import Item, Reading, _logical_lines, yaml_value
from postrl.guides.shell import Scope, ShellError, Unknown, case_matches, condition_value, expand, split_commands

_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_FUNCTION = re.compile(r"(?:function\s+)?[A-Za-z_][A-Za-z0-9_.-]*\s*\(\)\s*\{?$|function\s+[A-Za-z_][A-Za-z0-9_.-]*\s*\{?$")
_LOOPS = ("for", "while", "until", "select")
_KEY = re.compile(r"~?[A-Za-z_][A-Za-z0-9_.\-/@]*")  # a Hydra key (after its + / ++ prefix)


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


def _words(text: str) -> list[tuple[int, str]]:
    """(offset, raw word) of a command: split at blanks outside quotes, $(...), ${...} and `...`."""
    out, start, quote, i, depth = [], None, None, 0, 0
    while i < len(text):
        c = text[i]
        if start is None and not c.isspace():
            start = i
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"`":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "$" and text[i + 1 : i + 2] in ("(", "{"):
            depth += 1
            i += 1
        elif c in "({" and depth:
            depth += 1
        elif c in ")}" and depth:
            depth -= 1
        elif c.isspace() and not depth and start is not None:
            out.append((start, text[start:i]))
            start = None
        i += 1
    if start is not None:
        out.append((start, text[start:]))
    return out


def _unquote(word: str) -> str:
    try:
        return " ".join(shlex.split(word))
    except ValueError:
        return word


class _Reader:
    def __init__(self, env: dict[str, str]):
        from postrl.guides.verl import NAMES, VERL, VERL_HEADS

        self.table, self.names = VERL, NAMES
        self.heads = (*VERL_HEADS, "data.", "algorithm.")
        self.given = dict(env)
        self.scope = Scope({**os.environ, **env})
        self.reading = Reading()
        self.frames: list[_Frame] = []
        self.unset_refused: set[str] = set()

    def expand(self, word: str, n: int) -> str:
        """The word expanded; a construct postrl does not read makes it unknown (refused only where it matters)."""
        try:
            return expand(word, self.scope, n)
        except ShellError as exc:
            key, value = re.match(r"([^=$`'\"\\]+=)?(.*)", word, re.S).groups()  # NAME= / key= stays readable
            return (key or "") + self.scope.mark(Unknown(f"`{value[:60]}` ({str(exc).split('. Fix:')[0]})", n))

    @property
    def mode(self) -> str:
        return self.frames[-1].mode if self.frames else "on"

    # ----------------------------------------------------------------------------------- control
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
        self.simple(pieces)

    def open_case(self, word: str, n: int) -> None:
        frame = _Frame("case", self.mode, n)
        if frame.outer != "off":
            value = self.expand(word, n)
            unknown = self.scope.unknowns_in(value)
            if unknown or frame.outer == "unknown":
                frame.unknown = unknown[0] if unknown else self.frames[-1].unknown  # (the enclosing frame's)
            frame.value = _unquote(value)
        self.frames.append(frame)

    def clause(self, frame: _Frame, text: str, n: int, pieces: list) -> None:
        m = re.match(r"\(?\s*((?:[^)'\"]|'[^']*'|\"[^\"]*\")+)\)\s*(.*)$", text, re.S)
        if not m:
            raise ShellError(f"'{text[:60]}' is neither a case pattern `pat)` nor `esac`")
        patterns = [p.strip() for p in re.split(r"\|(?=(?:[^'\"]|'[^']*'|\"[^\"]*\")*$)", m[1])]
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
            self.reading.notes.append(f"line {n}: case `{frame.value}` takes the branch `{m[1].strip()})`, as the shell would")
        else:
            frame.mode = "off"
        if m[2].strip():
            self.command([(n, m[2].strip())])

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
        value = self.expand(cond, n)
        unknown = self.scope.unknowns_in(value)
        try:
            result = None if unknown else condition_value(shlex.split(value))
        except ValueError:
            result = None
        if result is None:
            frame.unknown = unknown[0] if unknown else Unknown(f"the condition `{cond[:60]}` (a test postrl does not evaluate)", n)
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
        for offset, word in _words(text):
            n = line_at(offset)
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
                        f"line {n}: ${u.var} is not set (neither by the script nor in the environment), so its value is unknown. "
                        f"Fix: pass --env {u.var}=VALUE to convert-config, or export {u.var}."
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
        return f"pass --env {u.var}={value} to convert-config / postrl train, or export {u.var}{choices}"


def _blank_heredocs(text: str) -> tuple[str, list[str]]:
    """The text with here-document bodies (`cat <<EOF ... EOF`) blanked, lines kept; a note for each."""
    out, notes, end, first = [], [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if end is not None:
            if line.strip() == end:
                notes.append(f"line {first}: a here-document (lines {first + 1}-{n}): the input of a command, not configuration")
                end = None
            out.append("")
            continue
        m = None if line.lstrip().startswith("#") else re.search(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1", line.replace("<<<", "   "))
        if m:
            end, first = m[2], n
        out.append(line)
    return "\n".join(out), notes


def read_script(text: str, env: dict[str, str] | None = None) -> Reading:
    """A verl launch script or override file as a shell would read it: `key=value` items with their lines.

    Variables come from `env` (`--env KEY=VALUE`), the script's own assignments (`MODEL=...`,
    `export MODEL=...`), then the environment. A command word and its flags are skipped with a note
    (the module after `-m` is kept as `Reading.entry`); a verl key written `key value` is refused."""
    reader = _Reader(dict(env or {}))
    text, heredocs = _blank_heredocs(text)
    lines, reader.reading.notes = _logical_lines(text)
    reader.reading.notes += heredocs
    for pieces in lines:
        joined = "".join(t for _, t in pieces)
        for start, end in split_commands(joined):
            sub, pos = [], 0
            for m, t in pieces:  # the command's own pieces, with their lines
                lo, hi = max(start - pos, 0), min(end - pos, len(t))
                if lo < hi:
                    sub.append((m, t[lo:hi]))
                pos += len(t)
            try:
                reader.command(sub)
            except ShellError as exc:
                first, last = sub[0][0], sub[-1][0]
                where = f"line {first}" if first == last else f"lines {first}-{last}"
                why = str(exc).rstrip(".")
                fix = "" if "Fix:" in why else ". Fix: write the value in the file (postrl runs nothing of the script)"
                reader.reading.refused.append(f"{where}: {why}{fix}.")
    for frame in reader.frames:
        reader.reading.refused.append(f"line {frame.line}: this {frame.kind} is never closed. Fix: close it ({'esac' if frame.kind == 'case' else 'fi'}).")
    reader.reading.notes.sort(key=lambda note: int(re.match(r"line (\d+)", note)[1]) if re.match(r"line \d+", note) else 0)
    return reader.reading
