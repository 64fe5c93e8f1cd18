"""`postrl preprocess CONFIG.yaml`: raw data -> training parquet in the verl schema.

The YAML uses the keys of the MindSpeed-RL guides (configs/datasets/*.yaml are examples):

    input: ../shared/data/gsm8k_test.jsonl   # file, directory, glob, or a list of them
    tokenizer_name_or_path: runs/tiny_sft/model  # local HF tokenizer (counts prompt tokens)
    output_prefix: data/gsm8k/test           # writes data/gsm8k/test.parquet + .summary.json
    handler_name: gsm8k                      # or the guides' names (R1AlpacaStyleInstructionHandler, ...)
    prompt_type: qwen                        # empty | qwen | qwen_r1 | qwen_math_r1 | qwen3 | llama3
    seq_length: 1024                         # drop prompts longer than this (tokens)
    workers: 2                               # parallel processes
    log_interval: 1000                       # progress line every N rows
    map_keys: {prompt: question, response: answer}   # a mapping or the guides' JSON string
    dataset_additional_keys: [labels]        # raw columns copied into extra_info

Each output row: {data_source, prompt: [{role, content}], ability, reward_model: {style: "rule",
ground_truth}, extra_info: {index, split, ...}, images (vision data only)}. `prompt` holds chat
messages (the template's system prompt, then the user's content); the trainer renders them with
the model's chat template. Malformed rows are reported with file and row number and skipped; the
summary (printed, and written next to the parquet) counts rows in, rows out and drops by reason.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from postrl.data.handlers import MAP_KEY_NAMES, Context, RowError, get_handler
from postrl.data.readers import expand_inputs, iter_records
from postrl.data.templates import get_template, has_chat_template
from postrl.errors import UserError
from postrl.models import load_tokenizer
from postrl.utils import scratch_path

CHUNK_ROWS = 256


class PreprocessConfig(BaseModel):
    """Keys of a preprocess YAML (the guides' names, plus a few of postrl's own)."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] = Field(description="Raw data: a file, directory or glob, or a list of them.")
    output_prefix: str = Field(description="Output path without suffix: <prefix>.parquet and <prefix>.summary.json.")
    handler_name: str = Field(description="How to read a row: dapo_math_17k, deepscaler, gsm8k, math, geo3k, alpaca.")
    tokenizer_name_or_path: str | None = Field(
        None, description="Local HF tokenizer directory (counts prompt tokens), or 'builtin:tiny-qwen2'."
    )
    tokenizer_type: str | None = Field(None, description="Accepted for compatibility with the guides; ignored.")
    prompt_type: str = Field("empty", description="Chat template: empty, qwen, qwen_r1, qwen_math_r1, qwen3, llama3.")
    prompt_type_path: str | None = Field(
        None, description="A JSON file of templates as MindSpeed-RL's configs/model/templates.json; prompt_type names one of its entries.",
    )
    seq_length: int | None = Field(None, ge=1, description="Drop prompts longer than this many tokens (needs a tokenizer).")
    workers: int = Field(1, ge=1, description="Parallel worker processes.")
    log_interval: int = Field(1000, ge=1, description="Print progress every N rows.")
    map_keys: dict[str, str] | None = Field(
        None, description="Columns read as prompt / query / response / system / images (dotted paths; '' = unused)."
    )
    dataset_additional_keys: list[str] = Field(
        default_factory=list, description="Raw columns copied into extra_info ('labels' is the answer: always kept)."
    )
    split: str = Field("train", description="Stored as extra_info.split.")
    data_source: str | None = Field(None, description="data_source of every row (default: the handler's).")
    instruction: str | None = Field(
        None, description="Text appended to each user prompt (default: the handler's hint, unless the template instructs)."
    )
    system_prompt: str | None = Field(None, description="System prompt ('' for none; default: the template's).")
    max_rows: int | None = Field(None, ge=1, description="Process only the first N input rows (for a quick look).")

    @field_validator("map_keys", mode="before")
    @classmethod
    def _map_keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else None
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"is a string but not JSON ({exc.msg}); write a mapping like {{prompt: question, response: answer}}"
                ) from None
        if isinstance(v, dict):
            bad = [k for k in v if k not in MAP_KEY_NAMES]
            if bad:
                raise ValueError(f"unknown map_keys {bad}; valid: {', '.join(MAP_KEY_NAMES)}")
            return {k: ("" if x is None else str(x)) for k, x in v.items()}
        return v

    @field_validator("dataset_additional_keys", mode="before")
    @classmethod
    def _additional(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [s.strip() for s in v.replace(",", " ").split() if s.strip()]
        return v


def load_preprocess_config(path: str) -> PreprocessConfig:
    from postrl.config import read_yaml_mapping

    tree = read_yaml_mapping(path, example="configs/datasets/gsm8k.yaml", keys="keys (input:, handler_name:, ...)")
    tree = {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in tree.items()}  # --map-keys style too
    try:
        cfg = PreprocessConfig.model_validate(tree)
    except ValidationError as exc:
        problems = []
        valid = sorted(PreprocessConfig.model_fields)
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                guess = difflib.get_close_matches(str(err["loc"][0]), valid, n=1)
                hint = f" Did you mean '{guess[0]}'?" if guess else ""
                problems.append(f"{loc}: unknown key.{hint} Valid keys: {', '.join(valid)}.")
            elif err["type"] == "missing":
                problems.append(f"{loc}: required. Fix: add `{loc}: ...` to {path}.")
            else:
                msg = str(err.get("ctx", {}).get("error", err["msg"]))
                problems.append(f"{loc}: {msg}.")
        raise UserError(*problems, title=f"{path}: {len(problems)} problem(s)") from None
    return cfg


def _resolve(path: str, config_dir: Path) -> str:
    """A relative input path is taken from the current directory, else from the config's directory."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or any(c in path for c in "*?["):
        return str(p)
    alt = config_dir / p
    return str(alt) if alt.exists() else str(p)


def _tokenizer_path(name: str | None, config_dir: Path) -> str | None:
    """A local directory; 'builtin:tiny-qwen2' is built (once, cached) like model.path."""
    if not name:
        return None
    if name.startswith("builtin:"):
        from postrl.models import resolve_model_path

        return resolve_model_path(name)
    path = _resolve(name, config_dir)
    if not Path(path).exists():
        raise UserError(
            f"tokenizer_name_or_path: '{name}' does not exist. Preprocessing loads the tokenizer from a local "
            "directory (no downloads). Fix: point it at a model or tokenizer directory with tokenizer.json."
        )
    return path


# --------------------------------------------------------------------------------- row pipeline
@dataclass
class Settings:
    """Everything a worker needs to turn raw rows into output rows (picklable)."""

    handler_name: str
    map_keys: dict[str, str]
    prompt_type: str
    prompt_type_path: str | None
    instruction: str
    system_prompt: str | None
    data_source: str
    ability: str
    split: str
    additional_keys: list[str]
    tokenizer_path: str | None
    seq_length: int | None


@dataclass
class ChunkResult:
    rows: list[dict] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)


class RowProcessor:
    """Handler + template + token counting for one process."""

    def __init__(self, s: Settings):
        self.s = s
        self.spec = get_handler(s.handler_name)
        self.template = get_template(s.prompt_type, s.prompt_type_path)
        self.tokenizer = load_tokenizer(s.tokenizer_path) if s.tokenizer_path else None

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
            return len(ids)
        return len(tok(self.template.render(messages), add_special_tokens=False)["input_ids"])

    def process(self, items: list[tuple[int, str, int, dict]], base_dir: Path | None) -> ChunkResult:
        out = ChunkResult()
        ctx = Context(self.s.map_keys, base_dir)
        for index, path, number, raw in items:
            where = f"{path} row {number}"
            try:
                ex = self.spec.fn(raw, ctx)
            except RowError as exc:
                out.problems.append(("malformed row", f"{where}: {exc}"))
                continue
            except Exception as exc:  # noqa: BLE001 - a handler bug must not lose the other rows
                out.problems.append(("malformed row", f"{where}: {type(exc).__name__}: {exc}"))
                continue
            system = self.s.system_prompt if self.s.system_prompt is not None else ex.system
            if ex.messages is not None:
                messages = list(ex.messages)
                default = self.template.default_system if system is None else system
                if default and not any(m["role"] == "system" for m in messages):
                    messages.insert(0, {"role": "system", "content": default})
            else:
                messages = self.template.messages(ex.user + self.s.instruction, system)
            n_tokens = -1
            if self.tokenizer is not None:
                try:
                    n_tokens = self.count_tokens(messages)
                except Exception as exc:  # noqa: BLE001
                    out.problems.append(("tokenizer error", f"{where}: the tokenizer failed on this prompt ({exc})."))
                    continue
                if self.s.seq_length is not None and n_tokens > self.s.seq_length:
                    out.problems.append(
                        (f"prompt longer than seq_length ({self.s.seq_length} tokens)", f"{where}: {n_tokens} tokens")
                    )
                    continue
            extra: dict[str, Any] = {"index": index, "split": self.s.split}
            extra.update(ex.extra)
            for key in self.s.additional_keys:
                if key != "labels":
                    extra[key] = raw.get(key)
            row: dict[str, Any] = {
                "data_source": self.s.data_source or ex.data_source or self.spec.data_source,
                "prompt": messages,
                "ability": self.s.ability,
                "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
                "extra_info": extra,
            }
            if ex.images is not None:
                row["images"] = ex.images
            out.rows.append(row)
            out.lengths.append(n_tokens)
        return out


_WORKER: RowProcessor | None = None


def _init_worker(settings: Settings) -> None:
    global _WORKER
    _WORKER = RowProcessor(settings)


def _process_chunk(items: list[tuple[int, str, int, dict]], base_dir: str | None) -> ChunkResult:
    assert _WORKER is not None, "worker not initialised"
    return _WORKER.process(items, Path(base_dir) if base_dir else None)


# ------------------------------------------------------------------------------------ the run
@dataclass
class Summary:
    files: list[str]
    rows_in: int = 0
    rows_out: int = 0
    dropped: Counter = field(default_factory=Counter)  # rows, by reason
    problems: list[tuple[str, str]] = field(default_factory=list)  # (reason, "<file> row N: what; fix")
    unreadable_files: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def as_dict(self, output: str, seconds: float) -> dict:
        lens = [n for n in self.lengths if n >= 0]
        return {
            "output": output,
            "files": self.files,
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "dropped": dict(self.dropped),
            "unreadable_files": self.unreadable_files,
            "prompt_tokens": {"min": min(lens), "mean": sum(lens) / len(lens), "max": max(lens)} if lens else None,
            "seconds": round(seconds, 2),
            "problems": [msg for _, msg in self.problems],
        }


def _chunks(files: list[str], summary: Summary, max_rows: int | None) -> Iterator[tuple[str, list]]:
    """(file, [(index, path, number, raw row)]) chunks; unreadable records go straight to the summary."""
    index = 0
    for path in files:
        chunk: list = []
        for rec in iter_records(path):
            if max_rows is not None and summary.rows_in >= max_rows:
                break
            if rec.number == 0:  # the whole file is unreadable
                summary.unreadable_files.append(rec.describe())
                break
            summary.rows_in += 1
            if rec.row is None:
                summary.dropped["malformed row"] += 1
                summary.problems.append(("malformed row", rec.describe()))
                index += 1
                continue
            chunk.append((index, path, rec.number, rec.row))
            index += 1
            if len(chunk) >= CHUNK_ROWS:
                yield path, chunk
                chunk = []
        if chunk:
            yield path, chunk


def _absorb(summary: Summary, res: ChunkResult) -> None:
    summary.rows_out += len(res.rows)
    summary.lengths.extend(res.lengths)
    for reason, msg in res.problems:
        summary.dropped[reason] += 1
        summary.problems.append((reason, msg))


def run_preprocess(cfg: PreprocessConfig, config_dir: Path = Path("."), out=sys.stdout) -> dict:
    """Run the whole preprocessing; returns the summary dict (also written next to the parquet)."""
    t0 = time.perf_counter()
    spec = get_handler(cfg.handler_name)
    templates_file = _resolve(cfg.prompt_type_path, config_dir) if cfg.prompt_type_path else None
    template = get_template(cfg.prompt_type, templates_file)
    if cfg.seq_length is not None and not cfg.tokenizer_name_or_path:
        raise UserError("seq_length needs tokenizer_name_or_path to count prompt tokens. Fix: set both, or neither.")
    inputs = [cfg.input] if isinstance(cfg.input, str) else cfg.input
    files, problems = expand_inputs([_resolve(i, config_dir) for i in inputs])
    if problems:
        raise UserError(*problems, title="input: file(s) not found")
    map_keys = dict(spec.map_keys)
    map_keys.update(cfg.map_keys or {})
    instruction = cfg.instruction if cfg.instruction is not None else ("" if template.instructs else spec.instruction)
    settings = Settings(
        handler_name=cfg.handler_name,
        map_keys=map_keys,
        prompt_type=cfg.prompt_type,
        prompt_type_path=templates_file,
        instruction=instruction,
        system_prompt=cfg.system_prompt,
        data_source=cfg.data_source or "",
        ability=spec.ability,
        split=cfg.split,
        additional_keys=cfg.dataset_additional_keys,
        tokenizer_path=_tokenizer_path(cfg.tokenizer_name_or_path, config_dir),
        seq_length=cfg.seq_length,
    )
    if settings.tokenizer_path:  # counting on a template's text, not the tokenizer's own format: say so
        has_chat_template(load_tokenizer(settings.tokenizer_path), f"prompt tokens are counted on prompt_type '{cfg.prompt_type}' text")
    summary = Summary(files)
    results: list[dict] = []
    last_log = 0

    def log_progress(force: bool = False) -> None:
        nonlocal last_log
        done = summary.rows_out + sum(summary.dropped.values())
        if (force and done != last_log) or done - last_log >= cfg.log_interval:
            last_log = done
            rate = done / max(time.perf_counter() - t0, 1e-9)
            print(
                f"processed {done} rows: kept {summary.rows_out}, dropped {done - summary.rows_out} ({rate:.0f} rows/s)",
                file=out,
                flush=True,
            )

    def take(res: ChunkResult) -> None:
        results.extend(res.rows)
        _absorb(summary, res)
        log_progress()

    if cfg.workers <= 1:
        proc = RowProcessor(settings)
        for path, chunk in _chunks(files, summary, cfg.max_rows):
            take(proc.process(chunk, Path(path).parent))
    else:
        import multiprocessing as mp

        from concurrent.futures.process import BrokenProcessPool

        if settings.tokenizer_path and not Path(settings.tokenizer_path).exists():
            load_tokenizer(settings.tokenizer_path)  # raises the UserError before starting workers
        try:
            with ProcessPoolExecutor(
                cfg.workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(settings,)
            ) as pool:
                inflight: list[Future] = []
                for path, chunk in _chunks(files, summary, cfg.max_rows):
                    inflight.append(pool.submit(_process_chunk, chunk, str(Path(path).parent)))
                    while len(inflight) > 2 * cfg.workers:  # bounded memory; results kept in input order
                        take(inflight.pop(0).result())
                for fut in inflight:
                    take(fut.result())
        except BrokenProcessPool:
            RowProcessor(settings)  # a worker failed to start: surface its error here (e.g. a bad tokenizer)
            raise
    log_progress(force=True)

    output = cfg.output_prefix if cfg.output_prefix.endswith(".parquet") else cfg.output_prefix + ".parquet"
    if not results:
        shown = summary.unreadable_files + [msg for _, msg in summary.problems[:20]]
        raise UserError(
            *shown,
            f"no row survived ({summary.rows_in} read; dropped: {dict(summary.dropped) or 'none'}). Fix the problems "
            "above (map_keys, handler_name, seq_length).",
            title="postrl preprocess produced no rows",
        )
    write_parquet(results, output, summary)
    report = summary.as_dict(output, time.perf_counter() - t0)
    notable = summary.unreadable_files + [m for r, m in summary.problems if not r.startswith("prompt longer")]
    summary_path = output[: -len(".parquet")] + ".summary.json"
    Path(summary_path).write_text(json.dumps(report, indent=2, ensure_ascii=False, default=str))
    _print_summary(report, notable, summary_path, out)
    return report


def write_parquet(rows: list[dict], output: str, summary: Summary) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(output).parent.mkdir(parents=True, exist_ok=True)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        # Mixed types in an extra_info column (e.g. an additional key that is a number in one row and a
        # string in another): store extra_info values as JSON text rather than lose the rows.
        summary.problems.append(("note", f"extra_info values have mixed types ({exc}); they are stored as JSON strings."))
        for r in rows:
            r["extra_info"] = {
                k: (v if k in ("index", "split") else json.dumps(v, ensure_ascii=False, default=str))
                for k, v in r["extra_info"].items()
            }
        table = pa.Table.from_pylist(rows)
    tmp = scratch_path(Path(output))
    pq.write_table(table, tmp)
    os.replace(tmp, output)


def _print_summary(report: dict, problems: list[str], summary_path: str, out) -> None:
    """Counts by reason; each malformed row or unreadable file individually (overlong ones only counted)."""
    print(f"rows in: {report['rows_in']}  rows out: {report['rows_out']}  dropped: {sum(report['dropped'].values())}", file=out)
    for reason, n in sorted(report["dropped"].items(), key=lambda kv: -kv[1]):
        print(f"  dropped {n}: {reason}", file=out)
    for p in problems[:20]:
        print(f"  - {p}", file=out)
    if len(problems) > 20:
        print(f"  ... {len(problems) - 20} more in {summary_path}", file=out)
    if report["prompt_tokens"]:
        t = report["prompt_tokens"]
        print(f"prompt tokens: min {t['min']}  mean {t['mean']:.1f}  max {t['max']}", file=out)
    print(f"wrote {report['output']} and {summary_path} in {report['seconds']:.1f} s", file=out)


# The guides' short names (`bash examples/data/preprocess_data.sh math_17k`) -> shipped YAMLs.
SHIPPED = Path(__file__).resolve().parents[3] / "configs" / "datasets"


def resolve_config(name: str) -> str:
    """A YAML path as given, or a short name (math_17k, dapo_math_17k, deepscaler, gsm8k, math, geo3k,
    geo3k_test) of configs/datasets/<name>.yaml, here or in postrl's source checkout."""
    if Path(name).exists() or name.endswith((".yaml", ".yml")) or "/" in name:
        return name
    for base in (Path("configs") / "datasets", SHIPPED):
        if (base / f"{name}.yaml").is_file():
            return str(base / f"{name}.yaml")
    known = sorted(p.stem for p in SHIPPED.glob("*.yaml")) if SHIPPED.is_dir() else []
    raise UserError(
        f"'{name}' is neither a YAML file nor the short name of a shipped dataset config"
        + (f" ({', '.join(known)})" if known else "") + ". Fix: pass a path, or one of those names."
    )


def main_preprocess(config_path: str) -> int:
    """Entry point of `postrl preprocess CONFIG.yaml | NAME`; raises UserError for bad config or input."""
    config_path = resolve_config(config_path)
    cfg = load_preprocess_config(config_path)
    run_preprocess(cfg, Path(config_path).resolve().parent)
    return 0
