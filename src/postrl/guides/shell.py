"""The part of POSIX shell that verl's launch scripts use to compute their settings, read without running anything.

verl's recipe scripts compute token budgets with arithmetic (`actor_ppo_max_token_len=$(((max_prompt_length +
max_response_length) * 2))`), choose settings by device in `case "${DEVICE}" in npu) ... ;; *) ... ;; esac`
or `if [ "$mode" = "async" ]; then ... fi`, and name runs with a command's output (`$(date +%Y%m%d)`). This
module expands words as the shell would, with three differences that keep it safe and honest:

- arithmetic `$(( ... ))` is parsed with Python's `ast` restricted to integers, names, `+ - * / %`, unary
  minus and parentheses (C semantics: `/` truncates toward zero, `%` takes the dividend's sign); nothing else;
- a command substitution `$(...)` or `` `...` `` is never run: it becomes an `Unknown` value, carried through
  the variables it flows into; where it is used, the reader decides (a name: a placeholder with a note; a
  setting that decides what is trained: refused, naming the `--env VAR=...` that settles it);
- a variable that is not set is an error (the shell would give an empty string or 0).
"""

from __future__ import annotations

import ast
import fnmatch
import re
from dataclasses import dataclass, field

MAX_WORD = 10_000  # characters of one arithmetic expression or one expanded word
MAX_DEPTH = 16  # nesting of ${...} defaults, $((...)) and variables holding expressions
INT64 = 2**63

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL = re.compile(r"[0-9@*#?$!-]")  # $1, $@, $#, ... (the script's arguments and the shell's state)
MARK = "\x00"  # brackets an Unknown's index in an expanded word: \x00<i>\x00


class ShellError(ValueError):
    """A construct that cannot be read as the shell reads it (the message says why, without the line)."""


@dataclass
class Unknown:
    """A value postrl does not know: a command's output, or a variable set in a branch it cannot choose."""

    what: str  # e.g. "the command `date +%Y%m%d`"
    line: int
    var: str | None = None  # the variable whose value it is (what --env VAR=... sets), once assigned
    choices: list[str] = field(default_factory=list)  # the values that choose a branch (case patterns)
    placeholder: str = "unknown"  # stands in a name (trainer.experiment_name=run_<placeholder>)
    unset: bool = False  # a variable that is not set (a name that needs it is refused too)
    chooses: list[str] = field(default_factory=list)  # what it decides in the script ("the case at line 12")


@dataclass
class Scope:
    """The variables a script sees (--env, then its own assignments, then the environment) and what is unknown."""

    values: dict[str, str]
    unknowns: list[Unknown] = field(default_factory=list)

    def mark(self, unknown: Unknown) -> str:
        self.unknowns.append(unknown)
        return f"{MARK}{len(self.unknowns) - 1}{MARK}"

    def mark_of(self, unknown: Unknown) -> str:
        i = next((i for i, u in enumerate(self.unknowns) if u is unknown), None)
        return self.mark(unknown) if i is None else f"{MARK}{i}{MARK}"

    def unset(self, name: str, line: int) -> str:
        """The mark of a variable that is not set (one record per variable)."""
        for u in self.unknowns:
            if u.unset and u.var == name:
                return self.mark_of(u)
        what = f"${name} is not set (neither by the script nor in the environment)"
        return self.mark(Unknown(what, line, var=name, placeholder=name, unset=True))

    def unknowns_in(self, text: str) -> list[Unknown]:
        return [self.unknowns[int(i)] for i in re.findall(f"{MARK}(\\d+){MARK}", text)]

    def substitute(self, text: str) -> str:
        """The text with every Unknown replaced by its placeholder."""
        return re.sub(f"{MARK}(\\d+){MARK}", lambda m: self.unknowns[int(m[1])].placeholder, text)


# ------------------------------------------------------------------------------------------ scanning
def _closing(text: str, i: int, open_: str, close: str) -> int:
    """Index of the `close` that ends the construct whose body starts at i (quotes and nesting respected)."""
    depth, quote = 0, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == open_:
            depth += 1
        elif c == close:
            if depth == 0:
                return i
            depth -= 1
        i += 1
    raise ShellError(f"an unterminated '{open_}...{close}'")


def _arith_end(text: str, i: int) -> int:
    """Index of the `))` that ends an arithmetic expansion whose body starts at i."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                if text.startswith("))", i):
                    return i
                raise ShellError("an arithmetic expansion $(( ... )) closed by a single ')'")
            depth -= 1
        i += 1
    raise ShellError("an unterminated arithmetic expansion $(( ... ))")


def split_commands(text: str) -> list[tuple[int, int]]:
    """(start, end) of one line's commands: split at `;` and `;;` outside quotes, $(...) and ${...}; a `;;` is a
    command of its own (it ends a case clause)."""
    spans, start, quote, i, depth = [], 0, None, 0, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == quote:
                quote = None
            elif c == "\\" and quote == '"':
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "\\":
            i += 1
        elif c == "$" and text[i + 1 : i + 2] in ("(", "{"):
            try:
                i = _closing(text, i + 2, text[i + 1], ")" if text[i + 1] == "(" else "}")
            except ShellError:
                i = len(text)
        elif c == "(":
            depth += 1  # `for ((i = 0; i < n; i++))`, a subshell: one command
        elif c == ")":
            depth = max(depth - 1, 0)  # a case pattern's `)` opens nothing
        elif c == ";" and not depth:
            spans.append((start, i))
            if text.startswith(";;", i):
                spans.append((i, i + 2))
                i += 1
            start = i + 1
        i += 1
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]


# ----------------------------------------------------------------------------------------- expansion
def expand(text: str, scope: Scope, line: int, depth: int = 0) -> str:
    """The word(s) with parameters, arithmetic and command substitutions expanded (quotes kept for shlex)."""
    if depth > MAX_DEPTH:
        raise ShellError("expansions nested too deeply")
    parts, quote, i = [], None, 0
    while i < len(text):
        c = text[i]
        if c == "'" and quote != '"':
            quote = None if quote == "'" else "'"
        elif c == '"' and quote != "'":
            quote = None if quote == '"' else '"'
        elif c == "\\" and quote != "'" and i + 1 < len(text):
            parts.append(text[i : i + 2])
            i += 2
            continue
        elif c == "`" and quote != "'":
            end = text.find("`", i + 1)
            if end < 0:
                raise ShellError("an unterminated `...` command substitution")
            parts.append(_command(text[i + 1 : end], scope, line))
            i = end + 1
            continue
        elif c == "$" and quote != "'":
            if text.startswith("$((", i):
                end = _arith_end(text, i + 3)
                try:
                    parts.append(str(arithmetic(expand(text[i + 3 : end], scope, line, depth + 1), scope, line, depth + 1)))
                except _UnknownUsed as exc:  # a value computed from an unknown one is unknown (for the same reason)
                    parts.append(scope.mark_of(exc.unknown))
                i = end + 2
                continue
            if text.startswith("$(", i):
                end = _closing(text, i + 2, "(", ")")
                parts.append(_command(text[i + 2 : end], scope, line))
                i = end + 1
                continue
            if text.startswith("${", i):
                end = _closing(text, i + 2, "{", "}")
                parts.append(_parameter(text[i + 2 : end], scope, line, depth))
                i = end + 1
                continue
            m = _NAME.match(text, i + 1) or _SPECIAL.match(text, i + 1)
            if m:
                parts.append(_lookup(m.group(0), scope, line))
                i = m.end()
                continue
        parts.append(c)
        i += 1
    out = "".join(parts)
    if len(out) > MAX_WORD * 10:
        raise ShellError("an expansion longer than postrl reads")
    return out


def _command(cmd: str, scope: Scope, line: int) -> str:
    cmd = " ".join(cmd.split())
    word = re.sub(r"[^A-Za-z0-9_.-]", "", cmd.split(" ", 1)[0] if cmd else "") or "command"
    return scope.mark(Unknown(f"the command `{cmd[:80]}`", line, placeholder=word))


def _lookup(name: str, scope: Scope, line: int) -> str:
    if name in scope.values:
        return scope.values[name]
    if name in ("@", "*", "#") or name.isdigit():  # the script's arguments: postrl passes none (overrides follow it)
        return "0" if name == "#" else ""
    if not _NAME.fullmatch(name):
        raise ShellError(f"${name} (the shell's own state) has no value postrl can know. Fix: write the value in the file")
    return scope.unset(name, line)


def _parameter(body: str, scope: Scope, line: int, depth: int) -> str:
    """${NAME}, ${NAME:-word}, ${NAME-word}, ${NAME:=word}, ${NAME=word}; a positional ${1:-word} too."""
    edit = re.match(r"(#?)([A-Za-z_][A-Za-z0-9_]*)(?:(//?|##?|%%?)(.*))?$", body, re.S)
    if edit and (edit[1] or edit[3]):  # ${#NAME}, ${NAME/a/b}, ${NAME//a/b}, ${NAME#a}, ${NAME%a}
        return _edit(edit[2], edit[1], edit[3], edit[4], scope, line, depth)
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:(:?)([-=])(.*))?$", body, re.S)
    if not m:
        raise ShellError(f"'${{{body}}}' is a form of parameter expansion postrl does not read. Fix: write the value in the file")
    name, colon, op, word = m.groups()
    if op is None:
        return _lookup(name, scope, line)
    value = scope.values.get(name)
    if value is not None and (value != "" or not colon):
        return value
    result = expand(word, scope, line, depth + 1)
    for u in scope.unknowns_in(result):
        u.var = u.var or (None if name.isdigit() else name)  # `--env NAME=...` settles a default computed by a command
    if op == "=":
        scope.values[name] = result
    return result


def _edit(name: str, length: str, op: str | None, word: str | None, scope: Scope, line: int, depth: int) -> str:
    """${#NAME} and the substitutions with a literal pattern (a glob pattern is refused)."""
    value = _lookup(name, scope, line)
    if scope.unknowns_in(value):
        return value
    if length:
        if op:
            raise ShellError(f"'${{#{name}{op}{word}}}' is not a parameter expansion")
        return str(len(value))
    pattern, _, replacement = (word or "").partition("/") if op in ("/", "//") else (word or "", "", "")
    pattern, replacement = _unquote_literal(expand(pattern, scope, line, depth + 1)), expand(replacement, scope, line, depth + 1)
    if any(c in pattern for c in "*?["):
        raise ShellError(f"'${{{name}{op}{word}}}' edits by a glob pattern, which postrl does not evaluate. Fix: write the value in the file")
    if op == "//":
        return value.replace(pattern, replacement) if pattern else value
    if op == "/":
        return value.replace(pattern, replacement, 1) if pattern else value
    if op in ("#", "##"):
        return value.removeprefix(pattern)
    return value.removesuffix(pattern)


def _unquote_literal(text: str) -> str:
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


# ---------------------------------------------------------------------------------------- arithmetic
def arithmetic(expr: str, scope: Scope, line: int, depth: int = 0) -> int:
    """The value of a POSIX arithmetic expression over integers and known variables (never eval)."""
    if depth > MAX_DEPTH:
        raise ShellError("arithmetic nested too deeply (a variable that names itself?)")
    unknown = scope.unknowns_in(expr)
    if unknown:
        u = unknown[0]
        raise _UnknownUsed(u, f"$(( {scope.substitute(expr).strip()} ))")
    text = " ".join(expr.split())
    if len(text) > MAX_WORD:
        raise ShellError("an arithmetic expression longer than postrl reads")
    if "**" in text or "//" in text:
        raise ShellError(f"'$(({text}))' uses an operator postrl does not evaluate (only + - * / % and parentheses)")
    try:
        tree = ast.parse(text or "0", mode="eval")
    except SyntaxError:
        raise ShellError(f"'$(({text}))' is not an arithmetic expression postrl evaluates (integers, variables, + - * / %, parentheses)") from None
    return _eval(tree.body, scope, line, depth, text)


class _UnknownUsed(ShellError):
    def __init__(self, unknown: Unknown, where: str):
        super().__init__(where)
        self.unknown = unknown


def _eval(node: ast.AST, scope: Scope, line: int, depth: int, text: str) -> int:
    def go(n: ast.AST) -> int:
        return _eval(n, scope, line, depth, text)

    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value, text)
    if isinstance(node, ast.Name):
        return _variable(node.id, scope, line, depth, text)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = go(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod)):
        a, b = go(node.left), go(node.right)
        if isinstance(node.op, ast.Add):
            return _bounded(a + b, text)
        if isinstance(node.op, ast.Sub):
            return _bounded(a - b, text)
        if isinstance(node.op, ast.Mult):
            return _bounded(a * b, text)
        if b == 0:
            raise ShellError(f"'$(({text}))' divides by zero")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # C: truncate toward zero
        return q if isinstance(node.op, ast.Div) else a - q * b
    raise ShellError(f"'$(({text}))' holds '{ast.unparse(node)}', which postrl does not evaluate (only integers, variables, + - * / % and parentheses)")


def _bounded(v: int, text: str) -> int:
    if not -INT64 <= v < INT64:
        raise ShellError(f"'$(({text}))' overflows the shell's 64-bit integers")
    return v


def _variable(name: str, scope: Scope, line: int, depth: int, text: str) -> int:
    if name not in scope.values:
        mark = scope.unset(name, line)
        raise _UnknownUsed(scope.unknowns_in(mark)[0], f"$(({text}))")
    value = scope.values[name].strip()
    if scope.unknowns_in(value):
        raise _UnknownUsed(scope.unknowns_in(value)[0], f"$(({text}))")
    if re.fullmatch(r"[+-]?\d+", value):
        return _bounded(int(value), text)
    if value == "":
        return 0
    try:  # the shell evaluates a variable that holds an expression
        return arithmetic(value, scope, line, depth + 1)
    except ShellError:
        raise ShellError(f"'$(({text}))' reads {name}={value!r}, which is not an integer") from None


# ------------------------------------------------------------------------------------------ patterns
def case_matches(value: str, patterns: list[str]) -> bool:
    """Whether a case word matches one of a clause's patterns (shell globs; quoted parts are literal)."""
    for pat in patterns:
        glob = "".join(_glob_part(p, q) for p, q in _quoted_parts(pat))
        if fnmatch.fnmatchcase(value, glob):
            return True
    return False


def _quoted_parts(pat: str) -> list[tuple[str, bool]]:
    parts, i = [], 0
    for m in re.finditer(r"'([^']*)'|\"([^\"]*)\"", pat):
        if m.start() > i:
            parts.append((pat[i : m.start()], False))
        parts.append((m[1] if m[1] is not None else m[2], True))
        i = m.end()
    if i < len(pat):
        parts.append((pat[i:], False))
    return parts


def _glob_part(text: str, quoted: bool) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", text) if quoted else text


def condition_value(words: list[str]) -> bool | None:
    """`[ A = B ]`, `[[ A != B ]]`, `test -n A`, integer comparisons; None when postrl cannot decide it."""
    if words and words[0] in ("[", "[["):
        close = "]" if words[0] == "[" else "]]"
        if words[-1] != close:
            return None
        words = words[1:-1]
    elif words and words[0] == "test":
        words = words[1:]
    else:
        return None
    negate = False
    if words and words[0] == "!":
        negate, words = True, words[1:]
    result: bool | None = None
    if len(words) == 3:
        a, op, b = words
        ints = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__, "-gt": int.__gt__, "-ge": int.__ge__}
        if op in ("=", "=="):
            result = a == b
        elif op == "!=":
            result = a != b
        elif op in ints and re.fullmatch(r"-?\d+", a) and re.fullmatch(r"-?\d+", b):
            result = ints[op](int(a), int(b))
    elif len(words) == 2 and words[0] in ("-n", "-z"):
        result = (words[1] != "") == (words[0] == "-n")
    elif len(words) == 1:
        result = words[0] != ""
    return None if result is None else result != negate
