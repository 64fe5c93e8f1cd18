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
- a variable that is not set is an error (the shell would give an empty string or 0);
- every evaluation is bounded: MAX_STEPS for the whole script (variables that expand into each other), words of
  at most 10 x MAX_WORD characters (measured before they are built), MAX_TERMS operators and MAX_DEPTH levels.

One scanner (`skip`, with `closing`, `top_level`, `split_commands`, `words`, `quoted_parts`) decides what is
quoted or substituted for every reader in postrl.guides. bashlex (a port of bash's parser) was considered: it is
GPL-3.0 (postrl is Apache-2.0) and parses without expanding, and the expansion, with its bounds and its unknown
values, is what this module is for.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable

MAX_WORD = 10_000  # characters of one arithmetic expression; one expanded word may be 10x that
MAX_DEPTH = 16  # nesting of ${...} defaults, $((...)) and variables holding expressions
MAX_TERMS = 200  # operators of one arithmetic expression (its tree is walked recursively)
MAX_STEPS = 200_000  # expansion and arithmetic steps for a whole script (variables that fan out are refused here)
INT64 = 2**63

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL = re.compile(r"[0-9@*#?$!-]")  # $1, $@, $#, ... (the script's arguments and the shell's state)
MARK = "\x00"  # brackets an Unknown's index in an expanded word: \x00<i>\x00


class ShellError(ValueError):
    """A construct that cannot be read as the shell reads it (the message says why, without the line)."""


class Exhausted(ShellError):
    """The script's evaluation budget (MAX_STEPS) is spent: nothing after it is read."""


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
    """The variables a script sees (--env, then its own assignments; never the process environment) and what is unknown."""

    values: dict[str, str]
    unknowns: list[Unknown] = field(default_factory=list)
    steps: int = 0  # spent of MAX_STEPS

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise Exhausted(
                f"reading the script takes more than {MAX_STEPS:,} expansion steps (variables that expand into each other "
                "many times over), more than postrl spends on one script"
            )

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
        what = f"${name} is not set by the script (nor by --env)"
        return self.mark(Unknown(what, line, var=name, placeholder=name, unset=True))

    def unknowns_in(self, text: str) -> list[Unknown]:
        return [self.unknowns[int(i)] for i in re.findall(f"{MARK}(\\d+){MARK}", text)]

    def substitute(self, text: str) -> str:
        """The text with every Unknown replaced by its placeholder."""
        return re.sub(f"{MARK}(\\d+){MARK}", lambda m: self.unknowns[int(m[1])].placeholder, text)


# ------------------------------------------------------------------------------------------ scanning
# One scanner for every reader of shell text in postrl.guides: `skip` steps over one quoted or substituted
# construct, so that splitting into lines, commands and words, and finding where a `$(`, `${` or `$((` ends,
# agree on what is quoted (backticks included).
def skip(text: str, i: int, depth: int = 0) -> int:
    """The index just past the construct that starts at text[i] (a quote, `...`, $(...), $((...)), ${...}, a
    backslash and its character); i + 1 for a plain character."""
    if depth > MAX_DEPTH * 4:
        raise ShellError("quotes and substitutions nested too deeply")
    c = text[i]
    if c == "\\":
        return min(i + 2, len(text))
    if c == "'":
        end = text.find("'", i + 1)
        if end < 0:
            raise ShellError("an unterminated '...' quote")
        return end + 1
    if c == "`":
        j = i + 1
        while j < len(text) and text[j] != "`":
            j += 2 if text[j] == "\\" else 1
        if j >= len(text):
            raise ShellError("an unterminated `...` command substitution")
        return j + 1
    if c == '"':
        j = i + 1
        while j < len(text) and text[j] != '"':
            j = skip(text, j, depth + 1) if text[j] in "\\`$" else j + 1
        if j >= len(text):
            raise ShellError('an unterminated "..." quote')
        return j + 1
    if c == "$" and text.startswith("$((", i):
        return _arith_end(text, i + 3, depth) + 2
    if c == "$" and text[i + 1 : i + 2] in ("(", "{"):
        return closing(text, i + 2, text[i + 1], ")" if text[i + 1] == "(" else "}", depth + 1) + 1
    return i + 1


def closing(text: str, i: int, open_: str, close: str, depth: int = 0) -> int:
    """Index of the `close` that ends the construct whose body starts at i (quotes and nesting respected)."""
    level = 0
    while i < len(text):
        c = text[i]
        if c == close and not level:
            return i
        if c in (open_, close):
            level += 1 if c == open_ else -1
            i += 1
        else:
            i = skip(text, i, depth)
    raise ShellError(f"an unterminated '{open_}...{close}'")


def _arith_end(text: str, i: int, depth: int = 0) -> int:
    """Index of the `))` that ends an arithmetic expansion whose body starts at i."""
    level = 0
    while i < len(text):
        c = text[i]
        if c == ")" and not level:
            if text.startswith("))", i):
                return i
            raise ShellError("an arithmetic expansion $(( ... )) closed by a single ')'")
        if c in "()":
            level += 1 if c == "(" else -1
            i += 1
        else:
            i = skip(text, i, depth + 1)
    raise ShellError("an unterminated arithmetic expansion $(( ... ))")


def top_level(text: str, start: int = 0):
    """(index, character) of `text` outside quotes and substitutions (a construct is reported by its first
    character only, e.g. the `"` of a quoted word)."""
    i = start
    while i < len(text):
        yield i, text[i]
        i = skip(text, i)


_SEPARATORS = (";;", "&&", "||", ";", "&")


def split_commands(text: str) -> list[tuple[int, int, str]]:
    """(start, end, separator) of one line's commands: split at `;`, `;;`, `&&`, `||` and `&` outside quotes and
    substitutions (and outside `[[ ... ]]`, where `&&` and `||` join tests); the separator that follows each
    ('' for the last); a `;;` (it ends a case clause) is a command of its own. A pipe `|` stays inside its command
    (it also separates case patterns): the reader ends a command's words at a `|` word."""
    spans, start, depth, test = [], 0, 0, False
    for i, c in top_level(text):
        if i < start:
            continue
        word_start = i == 0 or text[i - 1] in " \t;&|("
        if word_start and text.startswith("[[", i) and text[i + 2 : i + 3] in ("", " ", "\t"):
            test = True
        elif test and text.startswith("]]", i) and text[i + 2 : i + 3] in ("", " ", "\t", ";", "&", "|"):
            test = False
        elif c == "(":
            depth += 1  # `for ((i = 0; i < n; i++))`, a subshell: one command
        elif c == ")":
            depth = max(depth - 1, 0)  # a case pattern's `)` opens nothing
        elif c in ";&|" and not depth and not (test and c != ";") and (i == 0 or text[i - 1] not in "<>|") and text[i + 1 : i + 2] != ">":
            sep = next((s for s in _SEPARATORS if text.startswith(s, i)), None)
            if sep is None:
                continue  # a pipe
            if sep == ";;":
                spans += [(start, i, ";"), (i, i + 2, "")]
            else:
                spans.append((start, i, sep))
            start = i + len(sep)
    spans.append((start, len(text), ""))
    return [(a, b, s) for a, b, s in spans if text[a:b].strip()]


def words(text: str) -> list[tuple[int, str]]:
    """(offset, raw word) of a command: split at blanks outside quotes and substitutions."""
    out, start = [], None
    for i, c in top_level(text):
        if c.isspace():
            if start is not None:
                out.append((start, text[start:i]))
            start = None
        elif start is None:
            start = i
    if start is not None:
        out.append((start, text[start:]))
    return out


def quoted_parts(word: str) -> list[tuple[str, bool]]:
    """(text, quoted) pieces of a word after the shell's quote removal: '...' and "..." and a backslash's
    character are quoted (literal in a pattern); the rest is not."""
    parts, i, plain = [], 0, []
    while i < len(word):
        c = word[i]
        if c in "'\"\\":
            if plain:
                parts.append(("".join(plain), False))
                plain = []
            end = skip(word, i)
            body = word[i + 1 : end] if c == "\\" else word[i + 1 : end - 1]
            if c == '"':
                body = re.sub(r'\\([$`"\\\n])', r"\1", body)
            parts.append((body, True))
            i = end
        else:
            plain.append(c)
            i += 1
    if plain:
        parts.append(("".join(plain), False))
    return parts


def unquote(word: str) -> str:
    """A word after the shell's quote removal (an unbalanced quote: the word as written)."""
    try:
        return "".join(text for text, _ in quoted_parts(word))
    except ShellError:
        return word


# ----------------------------------------------------------------------------------------- expansion
def expand(text: str, scope: Scope, line: int, depth: int = 0) -> str:
    """The word(s) with parameters, arithmetic and command substitutions expanded (quotes kept for shlex)."""
    if depth > MAX_DEPTH:
        raise ShellError("expansions nested too deeply")
    scope.step(1 + len(text) // 64)
    parts, quote, i, size = [], None, 0, 0

    def add(part: str) -> None:
        nonlocal size
        size += len(part)
        scope.step(len(part) // 32)
        if size > MAX_WORD * 10:  # checked as the word grows: `$A$A$A...` never builds more than the cap
            raise ShellError("an expansion longer than postrl reads")
        parts.append(part)

    while i < len(text):
        c = text[i]
        if c == "'" and quote != '"':
            quote = None if quote == "'" else "'"
        elif c == '"' and quote != "'":
            quote = None if quote == '"' else '"'
        elif c == "\\" and quote != "'" and i + 1 < len(text):
            add(text[i : i + 2])
            i += 2
            continue
        elif c == "`" and quote != "'":
            end = skip(text, i) - 1
            add(_command(text[i + 1 : end], scope, line))
            i = end + 1
            continue
        elif c == "$" and quote != "'":
            if text.startswith("$((", i):
                end = _arith_end(text, i + 3)
                try:
                    add(str(arithmetic(expand(text[i + 3 : end], scope, line, depth + 1), scope, line, depth + 1)))
                except _UnknownUsed as exc:  # a value computed from an unknown one is unknown (for the same reason)
                    add(scope.mark_of(exc.unknown))
                i = end + 2
                continue
            if text.startswith("$(", i):
                end = closing(text, i + 2, "(", ")")
                add(_command(text[i + 2 : end], scope, line))
                i = end + 1
                continue
            if text.startswith("${", i):
                end = closing(text, i + 2, "{", "}")
                add(_parameter(text[i + 2 : end], scope, line, depth))
                i = end + 1
                continue
            m = _NAME.match(text, i + 1) or _SPECIAL.match(text, i + 1)
            if m:
                add(_lookup(m.group(0), scope, line))
                i = m.end()
                continue
        add(c)
        i += 1
    return "".join(parts)


def _command(cmd: str, scope: Scope, line: int) -> str:
    cmd = " ".join(cmd.split())
    if cmd == "pwd" and "PWD" in scope.values:  # the builtin prints $PWD: known without running anything
        return scope.values["PWD"]
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
    pattern, replacement = unquote(expand(pattern, scope, line, depth + 1)), expand(replacement, scope, line, depth + 1)
    if any(c in pattern for c in "*?["):
        raise ShellError(f"'${{{name}{op}{word}}}' edits by a glob pattern, which postrl does not evaluate. Fix: write the value in the file")
    if op == "//":
        if pattern and len(value) + value.count(pattern) * len(replacement) > MAX_WORD * 10:
            raise ShellError("an expansion longer than postrl reads")  # measured before the string is built
        return value.replace(pattern, replacement) if pattern else value
    if op == "/":
        return value.replace(pattern, replacement, 1) if pattern else value
    if op in ("#", "##"):
        return value.removeprefix(pattern)
    return value.removesuffix(pattern)


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
    scope.step(1 + len(text) // 16)
    if len(re.findall(r"[-+*/%]", text)) > MAX_TERMS:
        raise ShellError(f"an arithmetic expression with more than {MAX_TERMS} operators, more than postrl evaluates")
    if "**" in text or "//" in text:
        raise ShellError(f"'$(({text}))' uses an operator postrl does not evaluate (only + - * / % and parentheses)")
    try:
        tree = ast.parse(text or "0", mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
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
    scope.step()  # a variable holding an expression is evaluated each time it is read: the budget bounds a fan-out
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
    except (Exhausted, _UnknownUsed):
        raise
    except ShellError:
        raise ShellError(f"'$(({text}))' reads {name}={value!r}, which is not an integer") from None


# ------------------------------------------------------------------------------------------ patterns
def case_matches(value: str, patterns: list[str]) -> bool:
    """Whether a case word matches one of a clause's patterns (shell globs; quoted parts are literal)."""
    for pat in patterns:
        glob = "".join(_glob_part(p, q) for p, q in quoted_parts(pat))
        if fnmatch.fnmatchcase(value, glob):
            return True
    return False


def _glob_part(text: str, quoted: bool) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", text) if quoted else text


def condition_value(raw: list[str]) -> bool | None:
    """A test command's status as bash finds it: `[ A = B ]`, `test -n A`, `[[ A == pat* && ! -z B ]]`, integer
    comparisons; `raw` holds the expanded words with their quotes (a quoted right side of `[[ == ]]` is literal, an
    unquoted one a pattern). None when postrl does not evaluate the test."""
    if not raw:
        return None
    head = unquote(raw[0])
    if head == "[[" and unquote(raw[-1]) == "]]":
        return _double_bracket(raw[1:-1])
    if head == "[" and unquote(raw[-1]) == "]":
        return _single_test([unquote(w) for w in raw[1:-1]])
    if head == "test":
        return _single_test([unquote(w) for w in raw[1:]])
    return None


_INTS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__, "-gt": int.__gt__, "-ge": int.__ge__}


def _single_test(words: list[str], pattern: str | None = None) -> bool | None:
    """`[ ... ]` / `test ...` with one primary, `!` in front; `pattern`: the raw right side of `[[ == ]]`. A word
    holding an unknown value (its mark) makes the primary unknown."""
    if any(MARK in w for w in words) or (pattern is not None and MARK in pattern):
        return None
    if words and words[0] == "!" and len(words) > 1:
        inner = _single_test(words[1:], pattern)
        return None if inner is None else not inner
    if len(words) == 3:
        a, op, b = words
        if op in ("=", "==", "!=") and pattern is not None:
            return case_matches(a, [pattern]) != (op == "!=")
        if op in ("=", "=="):
            return a == b
        if op == "!=":
            return a != b
        if op in _INTS and re.fullmatch(r"-?\d+", a) and re.fullmatch(r"-?\d+", b):
            return _INTS[op](int(a), int(b))
        return None
    if len(words) == 2 and words[0] in ("-n", "-z"):
        return (words[1] != "") == (words[0] == "-n")
    if len(words) == 1:
        return words[0] != ""
    return None


def _double_bracket(raw: list[str]) -> bool | None:
    """The inside of `[[ ... ]]`: primaries joined by `&&` / `||` (left to right, `&&` first), `!`, `( ... )`;
    three-valued: a known side decides where the other cannot change the result (false && ?, true || ?)."""
    pos = 0

    def primary() -> bool | None:
        nonlocal pos
        if pos < len(raw) and raw[pos] == "!":
            pos += 1
            v = primary()
            return None if v is None else not v
        if pos < len(raw) and raw[pos] == "(":
            pos += 1
            v = disjunction()
            if pos >= len(raw) or raw[pos] != ")":
                raise ShellError("an unbalanced '(' inside [[ ... ]]")
            pos += 1
            return v
        end = pos
        while end < len(raw) and raw[end] not in ("&&", "||", ")"):
            end += 1
        words, pos = raw[pos:end], end
        pattern = words[2] if len(words) == 3 and words[1] in ("=", "==", "!=") else None
        return _single_test([unquote(w) for w in words], pattern)

    def chain(op: str, operand: Callable[[], bool | None], combine: Callable) -> bool | None:
        """operand (op operand)*, left to right: && binds tighter than ||, as in [[ ]]."""
        nonlocal pos
        v = operand()
        while pos < len(raw) and raw[pos] == op:
            pos += 1
            v = combine(v, operand())
        return v

    def disjunction() -> bool | None:
        return chain("||", lambda: chain("&&", primary, kleene_and), kleene_or)

    v = disjunction()
    return v if pos == len(raw) else None


def kleene_and(a: bool | None, b: bool | None) -> bool | None:
    return False if a is False or b is False else (None if a is None or b is None else True)


def kleene_or(a: bool | None, b: bool | None) -> bool | None:
    return True if a is True or b is True else (None if a is None or b is None else False)
