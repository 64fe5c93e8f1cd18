"""Answer extraction and normalisation: pure string functions shared by the verifiers.

Everything here reads model-written text, so it is linear (or bounded) in the length of its input: a
1 MB completion costs milliseconds, never a hang. No regex with nested unbounded repetition runs on
unbounded text, and a number is compared without being expanded (`1e999999999` costs nothing:
postrl/untrusted.py). tests/test_untrusted_text.py feeds each function generated hostile text.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from postrl.untrusted import exact_value, wide_decimal

_BRACES = re.compile(r"[{}]")


def matching_brace(text: str, open_at: int) -> int:
    """Index of the `}` closing the `{` at `open_at` (nested braces counted), or -1."""
    depth = 0
    for m in _BRACES.finditer(text, open_at):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    return -1


_BOX_AT = re.compile(r"\\(?:boxed|fbox)")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, or None.

    Nested braces are handled: `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. An unclosed box gives None.
    The commands are found in one pass and tried from the last, so `\\boxedx` a hundred thousand times
    costs one scan, not one per candidate.
    """
    for start in reversed([m.start() for m in _BOX_AT.finditer(text)]):
        cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
        i = start + len(cmd)
        if text.startswith("{", i):
            end = matching_brace(text, i)
            return text[i + 1 : end] if end >= 0 else None
        if text.startswith(" ", i):
            # `\boxed 5`: the argument runs to the next space or `$`.
            m = re.match(r" +([^\s$]+)", text[i : i + 200])
            if m:
                return m.group(1)
        # `\boxedfoo` or a bare `\boxed`: not a box; look further left.
    return None


def strip_wrapper(s: str, command: str) -> str:
    """`\\text{abc}` -> `abc` for every occurrence of `command` (nested braces handled)."""
    out, pos = [], 0
    needle = command + "{"
    while True:
        i = s.find(needle, pos)
        if i < 0:
            out.append(s[pos:])
            return "".join(out)
        end = matching_brace(s, i + len(command))
        if end < 0:
            out.append(s[pos:])
            return "".join(out)
        out.append(s[pos:i])
        out.append(s[i + len(needle) : end])
        pos = end + 1


# ------------------------------------------------------------------------------ number parsing
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


MAX_NUMBER_CHARS = 100  # a number written longer than this is not an answer


def parse_number(s: str) -> Decimal | None:
    """`"1,234.50"`, `"-3"`, `"$18"`, `"42."` -> Decimal; anything else (`"1,-2"`, `"x"`) -> None.

    At most MAX_NUMBER_CHARS characters, but the exponent may be huge (`1e999999999`): compare the
    result with `numbers_equal`, and take its exact value with `untrusted.exact_value`, never `Fraction`."""
    s = s.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",").strip()
    if len(s) > MAX_NUMBER_CHARS * 4 // 3:  # before any regex: commas add a third at most
        return None
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if len(s) > MAX_NUMBER_CHARS or not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex only admits valid literals
        return None


def numbers_equal(a: Decimal, b: Decimal) -> bool:
    """Integers exactly (1000000001 != 1000000000); other numbers up to a relative 1e-12, which
    forgives binary-float noise (0.30000000000000004) but not a rounded answer (3.14 != 3.14159)."""
    with wide_decimal():  # 1e999999999 - 5 rounds, neither overflows nor expands
        if a == b:
            return True
        if a == a.to_integral_value() and b == b.to_integral_value():
            return False
        return abs(a - b) <= Decimal("1e-12") * max(abs(a), abs(b))


_SIMPLE_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?)\\frac(\d)(\d)|(-?\d+)/(-?\d+)")


def simple_value(s: str) -> tuple[Fraction, bool] | None:
    """Exact value of a plain number or a simple fraction (`\\frac{3}{4}`, `\\frac34`, `-3/4`), and
    whether it was written as a decimal; None for anything else (a number past the exact-arithmetic cap of
    `untrusted.exact_value` included). Expects `normalize_math` output."""
    num = parse_number(s)
    if num is not None:
        value = exact_value(num)
        return None if value is None else (value, "." in s or "e" in s.lower())
    m = _SIMPLE_FRACTION.fullmatch(s)
    if m is None:
        return None
    if m.group(2) is not None:
        sign, a, b = m.group(1), m.group(2), m.group(3)
    elif m.group(5) is not None:
        sign, a, b = m.group(4), m.group(5), m.group(6)
    else:
        sign, a, b = "", m.group(7), m.group(8)
    if len(a) > 50 or len(b) > 50 or int(b) == 0:
        return None
    value = Fraction(int(a), int(b))
    return (-value if sign else value), False


# ------------------------------------------------------------------- MATH-style normalisation
# A cheap canonical form used for the fast path of the math verifiers: two answers that
# normalise to the same string are equal; anything else goes to the symbolic checker.
_MATH_DROP = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "^\\circ", "^{\\circ}",
    "\\%", "%", "\\$", "$", "~", "°",
)


def normalize_math(s: str) -> str:
    """Spacing, `\\left`, `\\dfrac`, `$`, degrees, `\\text{}` wrappers and trailing dots removed."""
    s = s.strip()
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox", "\\mathbf"):
        if cmd + "{" in s:
            s = strip_wrapper(s, cmd)
    for tok in _MATH_DROP:
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split())
    s = s.rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


# --------------------------------------------------------------- DAPO / Minerva normalisation
# The normalisation of Minerva (Lewkowycz et al. 2022, appendix) as DAPO applies it to both the
# model's "Answer:" line and the ground truth. The tables are the published ones; order matters.
MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
_FIRST_INLINE_MATH = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_SHORTHAND_FRAC = re.compile(r"(frac)([^{])(.)")
_SHORTHAND_SQRT = re.compile(r"(sqrt)([^{])")


def _unwrap(pattern: re.Pattern[str], s: str) -> str:
    return pattern.sub(lambda m: m.group(2), s)


_TEXT_ARG = re.compile(r"(\\text\{)(.*?)(\})")
_TEXTBF_ARG = re.compile(r"(\\textbf\{)(.*?)(\})")
_OVERLINE_ARG = re.compile(r"(\\overline\{)(.*?)(\})")
_BOXED_ARG = re.compile(r"(\\boxed\{)(.*)(\})")


def minerva_normalize(answer: str) -> str:
    """Normalise a final answer as DAPO's reward does (so that `5 units` == `5`, `1,000` == `1000`).

    Steps: keep the text after the last `=`; apply the substitution and removal tables; keep only
    the first `$...$` span; unwrap `\\text{}`, `\\textbf{}`, `\\overline{}`, `\\boxed{}`; expand
    `\\frac12` to `\\frac{1}{2}` and `\\sqrt2` to `\\sqrt{2}`; drop `$`; drop commas of a plain integer.
    Callers bound the input length (DAPO looks at the last 300 characters only).
    """
    s = answer.split("=")[-1]
    for before, after in MINERVA_SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in MINERVA_REMOVED:
        s = s.replace(expr, "")
    s = _FIRST_INLINE_MATH.sub(lambda m: "$" + m.group(3) + "$", s)
    for pattern in (_TEXT_ARG, _TEXTBF_ARG, _OVERLINE_ARG, _BOXED_ARG):
        s = _unwrap(pattern, s)
    s = _SHORTHAND_FRAC.sub(lambda m: "frac{" + m.group(2) + "}{" + m.group(3) + "}", s)
    s = _SHORTHAND_SQRT.sub(lambda m: "sqrt{" + m.group(2) + "}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()
