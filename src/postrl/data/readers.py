"""Readers for parquet, JSON (a list of objects) and JSONL files, with row-numbered problems.

`iter_records(path)` yields every record of a file as a `Record`: either a row (a dict) or a
problem saying what is wrong, where (file and 1-based row number; the line number too for text
files) and how to fix it. A malformed row never hides the good rows around it, so that every
problem of a file is found in one pass:

- JSONL: a bad line is reported and the next line is read;
- JSON list: a bad element is reported and reading resumes at the next element;
- parquet: a corrupt row group is reported with its row range and the other groups are read.

Only problems that make a whole file unreadable (missing, empty, truncated parquet footer, unknown
type) yield a single file-level problem (row 0).

What happens to a malformed row is the caller's choice, and the messages say only what is wrong
and how to fix it, never what happens next:

- `postrl preprocess` (and `postrl verify`) skip it, count it and report it in their summary;
- `read_records(path)`, the strict form the trainer uses, yields the rows and, if any problem was met,
  raises one `UserError` listing them all: training never runs on a silently shortened data set.
"""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from postrl.errors import UserError

SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}


@dataclass
class Record:
    """One record of a file: `row` when it could be read, else `problem` (what, and how to fix it)."""

    path: str
    number: int  # 1-based record number in the file; 0 for a problem with the whole file
    row: dict | None = None
    problem: str | None = None
    line: int | None = None  # text files: the line the record starts on

    @property
    def where(self) -> str:
        if self.number == 0:
            return self.path
        loc = f"{self.path} row {self.number}"
        return loc + (f" (line {self.line})" if self.line is not None and self.line != self.number else "")

    def describe(self) -> str:
        return f"{self.where}: {self.problem}"


def file_format(path: str | Path) -> str | None:
    return SUFFIXES.get(Path(path).suffix.lower())


def expand_inputs(inputs: str | list[str]) -> tuple[list[str], list[str]]:
    """Files named by paths, directories (their supported files) and glob patterns; and problems."""
    items = [inputs] if isinstance(inputs, str) else list(inputs)
    files, problems = [], []
    for item in items:
        p = Path(str(item)).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.iterdir() if f.is_file() and file_format(f))
            if not found:
                problems.append(f"{item}: directory holds no .parquet, .json or .jsonl file. Fix: point input at the data files.")
            files.extend(found)
        elif any(ch in str(item) for ch in "*?["):
            found = sorted(f for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
            if not found:
                problems.append(f"{item}: no file matches this pattern. Fix: check the path.")
            files.extend(found)
        elif p.is_file():
            files.append(str(p))
        else:
            problems.append(f"{item}: file does not exist. Fix: check the path (a relative path is taken from the current directory).")
    return files, problems


def iter_records(path: str | Path) -> Iterator[Record]:
    """Every record of one file, good or bad, in order (see the module docstring)."""
    path = str(path)
    p = Path(path)
    fmt = file_format(p)
    if not p.is_file():
        yield Record(path, 0, problem="file does not exist. Fix: check the path.")
        return
    if fmt is None:
        yield Record(
            path, 0, problem=f"unsupported file type '{p.suffix}'. Fix: convert it to .parquet, .jsonl or .json (a list)."
        )
        return
    if p.stat().st_size == 0:
        yield Record(path, 0, problem="file is empty (0 bytes). Fix: re-download or re-export it, or remove it from the input.")
        return
    if fmt == "parquet":
        yield from _iter_parquet(path)
    elif fmt == "jsonl":
        yield from _iter_jsonl(path)
    else:
        yield from _iter_json(path)


def read_records(path: str | Path) -> Iterator[dict]:
    """The rows of one file; raises a UserError listing every problem (after the last row)."""
    problems = []
    for rec in iter_records(path):
        if rec.row is not None:
            yield rec.row
        else:
            problems.append(rec.describe())
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        shown.append(
            "Training reads every row or stops, so that it never runs on a silently shortened data set. "
            "Fix the rows above, or run `postrl preprocess` on the raw file, which skips and counts malformed rows."
        )
        raise UserError(*shown, title=f"{path}: {len(problems)} malformed record(s); training stops")


# ------------------------------------------------------------------------------------- parquet
def _iter_parquet(path: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        size = Path(path).stat().st_size
        yield Record(
            path,
            0,
            problem=f"cannot be opened as parquet ({exc}; {size} bytes). A truncated download or an interrupted "
            "write leaves no footer, and without it no row can be located. Fix: re-download or re-export the file.",
        )
        return
    start = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        try:
            rows = pf.read_row_group(g).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as exc:
            yield Record(
                path,
                start + 1,
                problem=f"rows {start + 1}-{start + n} (row group {g}) cannot be read ({exc}). Fix: re-export the file.",
            )
            start += n
            continue
        for k, row in enumerate(rows):
            yield Record(path, start + k + 1, row=row)
        start += n


# --------------------------------------------------------------------------------------- jsonl
def _not_object(value: Any) -> str:
    return (
        f"holds a JSON {type(value).__name__}, not an object. Each record must be an object "
        '({"question": ..., "answer": ...}). Fix: wrap or remove it.'
    )


def _iter_jsonl(path: str) -> Iterator[Record]:
    number = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            number += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Record(path, number, line=line_no, problem=f"is not UTF-8 ({exc}). Fix: re-encode the file as UTF-8.")
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                truncated = not raw.endswith(b"\n")
                hint = " It is the last line and has no newline: the file looks truncated." if truncated else ""
                yield Record(
                    path,
                    number,
                    line=line_no,
                    problem=f"is not valid JSON ({exc.msg} at column {exc.colno}).{hint} "
                    "Fix: correct or delete that line.",
                )
                continue
            if not isinstance(value, dict):
                yield Record(path, number, line=line_no, problem=_not_object(value))
                continue
            yield Record(path, number, row=value, line=line_no)


# ---------------------------------------------------------------------------------------- json
_NEXT_ELEMENT = re.compile(r"[\[,]\s*\{|\n\s*\{")


def _iter_json(path: str) -> Iterator[Record]:
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        yield Record(path, 0, problem=f"is not UTF-8 ({exc}). Fix: re-encode the file as UTF-8.")
        return
    start = len(text) - len(text.lstrip())
    if start == len(text):
        yield Record(path, 0, problem="holds only whitespace. Fix: re-export the file.")
        return
    if text[start] == "{":
        # Either one object (maybe {"data": [...]}) or JSON Lines saved as .json.
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            yield from _iter_jsonl(path)
            return
        lists = [v for v in value.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        if len(lists) == 1:
            for k, row in enumerate(lists[0], start=1):
                yield Record(path, k, row=row)
        else:
            yield Record(path, 1, row=value)
        return
    if text[start] != "[":
        yield Record(
            path, 0, problem="is not a JSON list of objects (it starts with neither '[' nor '{'). Fix: export a list or JSON Lines."
        )
        return
    yield from _iter_json_list(path, text, start + 1)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _iter_json_list(path: str, text: str, pos: int) -> Iterator[Record]:
    decoder = json.JSONDecoder()
    number = 0
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            yield Record(
                path,
                number + 1,
                line=_line_of(text, n),
                problem="the file ends before the closing ']' (truncated?). Fix: re-export the file.",
            )
            return
        if text[pos] == "]":
            return
        number += 1
        line = _line_of(text, pos)
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            yield Record(
                path,
                number,
                line=line,
                problem=f"is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). "
                "Fix: correct or delete this element.",
            )
            m = _NEXT_ELEMENT.search(text, max(exc.pos, pos + 1))
            if m is None:
                return
            pos = m.end() - 1
            continue
        if not isinstance(value, dict):
            yield Record(path, number, line=line, problem=_not_object(value))
        else:
            yield Record(path, number, row=value, line=line)
        pos = end
