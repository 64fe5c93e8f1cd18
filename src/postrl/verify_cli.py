"""`postrl verify`: score a file of completions offline with the registered verifiers.

    postrl verify --verifier math_17k_acc --input completions.jsonl
    postrl verify --verifier acc_for_dapo,format=0.1 --input out.jsonl --response-key output \\
        --answer-key reward_model.ground_truth --output scored.jsonl

Prints the mean score, the mean acc, the per-verifier means and the number of time-outs. With
`--output`, writes one JSON line per input record, in input order:
`{"index", "score", "acc", "metrics": {...}, "timeout"}`, or, for a record that could not be scored
(malformed line, missing field), `{"index", "score": null, "acc": null, "error": "..."}`; such
records are left out of the means and listed on stderr.

Keys are dotted paths (`reward_model.ground_truth`). A response may be a string, a chat message
(`{"role", "content"}`) or a list of them (the last assistant message is scored). When the default
keys are absent, common alternatives (`completion`, `output`, ...; `ground_truth`, ...) are used and
named in the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from postrl.errors import UserError
from postrl.utils import get_dotted

RESPONSE_FALLBACKS = ("response", "completion", "output", "generation", "model_output", "prediction", "text")
ANSWER_FALLBACKS = ("answer", "ground_truth", "reward_model.ground_truth", "gt", "label", "target", "final_answer")
BATCH = 512
_MISSING = object()


def as_completion(value: Any) -> str:
    """The text to score: a string, a message's content, or the last assistant message of a chat."""
    if isinstance(value, str):
        return value
    if value is None:  # the model produced nothing: scored as an empty completion
        return ""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        assistant = [m for m in value if m.get("role") == "assistant"]
        msg = (assistant or value)[-1]
        if isinstance(msg.get("content"), str):
            return msg["content"]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        raise ValueError(
            f"holds a list of {len(value)} strings; give one completion per record (one line per sample)"
        )
    raise ValueError(f"holds a {type(value).__name__}, not text or chat messages")


def as_ground_truth(value: Any) -> str:
    """A ground truth as text: strings as is, numbers printed, lists joined with ', '."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        raise ValueError(f"is {value!r}, not an answer")
    if isinstance(value, (int, float)):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if isinstance(value, dict) and "ground_truth" in value:
        return as_ground_truth(value["ground_truth"])
    if isinstance(value, (list, tuple)) and value and all(isinstance(x, (str, int, float)) for x in value):
        return ", ".join(as_ground_truth(x) for x in value)
    raise ValueError(f"holds a {type(value).__name__}, not an answer")


def parse_verifiers(spec: str, weights: str | None) -> list[dict]:
    """'a,b=0.5' -> [{name: a, weight: 1}, {name: b, weight: 0.5}]; --weights overrides in order."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise UserError("--verifier is empty. Fix: name at least one verifier, e.g. --verifier math_17k_acc.")
    out = []
    for item in items:
        name, sep, w = item.partition("=")
        try:
            weight = float(w) if sep else 1.0
        except ValueError:
            raise UserError(f"--verifier '{item}': weight '{w}' is not a number. Fix: write NAME=WEIGHT, e.g. format=0.1.") from None
        out.append({"name": name.strip(), "weight": weight})
    if weights:
        ws = [s.strip() for s in weights.split(",")]
        if len(ws) != len(out):
            raise UserError(f"--weights has {len(ws)} values for {len(out)} verifiers. Fix: give one weight per verifier.")
        try:
            for v, w in zip(out, ws):
                v["weight"] = float(w)
        except ValueError:
            raise UserError(f"--weights '{weights}' must be numbers separated by commas.") from None
    return out


def _pick_key(rows: list[dict], wanted: str, explicit: bool, fallbacks: tuple[str, ...], flag: str) -> str:
    """`wanted` if any row has it; otherwise (default only) the first fallback most rows have."""
    if any(get_dotted(r, wanted, _MISSING) is not _MISSING for r in rows) or not rows:
        return wanted
    keys = sorted({k for r in rows[:50] for k in r})
    if not explicit:
        for alt in fallbacks:
            if any(get_dotted(r, alt, _MISSING) is not _MISSING for r in rows[:50]):
                print(f"note: no '{wanted}' field; scoring '{alt}' (pass {flag} to choose another)", file=sys.stderr)
                return alt
    raise UserError(
        f"no record has the field '{wanted}'. Fields of the first records: {', '.join(keys) or '(none)'}. "
        f"Fix: pass {flag} with the (dotted) name of the field to use."
    )


class _Unscorable(Exception):
    """Why a record cannot be scored (its message goes to the output line and stderr)."""


def _field(row: dict, key: str, convert: Callable[[Any], str], what: str, flag: str) -> str:
    value = get_dotted(row, key, _MISSING)
    if value is _MISSING:
        raise _Unscorable(f"no field '{key}' ({what}). Fix: add it, or pass {flag}.")
    try:
        return convert(value)
    except ValueError as exc:
        raise _Unscorable(f"field '{key}' {exc}.") from None


def _extract(row: dict, resp_key: str, ans_key: str) -> tuple[str, str, dict] | str:
    try:
        completion = _field(row, resp_key, as_completion, "the completion", "--response-key")
        truth = _field(row, ans_key, as_ground_truth, "the ground truth", "--answer-key")
    except _Unscorable as exc:
        return str(exc)
    return completion, truth, row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="postrl verify",
        description="Score a file of completions (JSONL, JSON list or parquet) with postrl's verifiers.",
    )
    p.add_argument("--verifier", required=True, help="NAME[,NAME...] (NAME=WEIGHT allowed); registered or package.module:function")
    p.add_argument("--input", required=True, help="file of records holding a completion and a ground truth")
    p.add_argument("--response-key", default=None, help="dotted field of the completion (default: response)")
    p.add_argument("--answer-key", default=None, help="dotted field of the ground truth (default: answer)")
    p.add_argument("--output", default=None, help="write one scored JSON line per input record here")
    p.add_argument("--weights", default=None, help="W[,W...]: weights of the verifiers, in order (default 1)")
    p.add_argument("--timeout", type=float, default=5.0, help="hard time limit of one verifier call, seconds (default 5)")
    p.add_argument("--workers", type=int, default=2, help="verifier worker processes (default 2)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N records")
    p.add_argument("--list", action="store_true", help="list the registered verifiers and exit")
    return p


def main_verify(argv: list[str]) -> int:
    """Entry point of `postrl verify`; returns the exit code, raises UserError for bad input."""
    from postrl.rewards.registry import registered_verifiers

    if "--list" in argv:
        print("\n".join(registered_verifiers()))
        return 0
    args = build_parser().parse_args(argv)
    if args.timeout <= 0 or args.workers < 1:
        raise UserError("--timeout must be > 0 and --workers >= 1.")
    cfg = _reward_config(args)
    records = _read_records(args.input, args.limit)
    good_rows = [r.row for r in records if r.row is not None]
    resp_key = _pick_key(good_rows, args.response_key or "response", args.response_key is not None, RESPONSE_FALLBACKS, "--response-key")
    ans_key = _pick_key(good_rows, args.answer_key or "answer", args.answer_key is not None, ANSWER_FALLBACKS, "--answer-key")

    # Per record: (completion, ground truth, row), or why it cannot be scored.
    items = [_extract(rec.row, resp_key, ans_key) if rec.row is not None else (rec.problem or "unreadable") for rec in records]
    t0 = time.perf_counter()
    scored, timeouts, errors = _score(cfg, items)
    elapsed = time.perf_counter() - t0

    lines = [
        {"index": k, "score": None, "acc": None, "error": it} if isinstance(it, str) else {"index": k, **scored[k]}
        for k, it in enumerate(items)
    ]
    bad = [f"{records[k].where}: {it}" for k, it in enumerate(items) if isinstance(it, str)]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for ln in lines:
                f.write(json.dumps(ln, ensure_ascii=False) + "\n")
    for msg in bad[:10]:
        print(f"skipped {msg}", file=sys.stderr)
    if len(bad) > 10:
        print(f"skipped ... and {len(bad) - 10} more records", file=sys.stderr)
    ok = [ln for ln in lines if ln["score"] is not None]
    if not ok:
        raise UserError(f"{args.input}: none of the {len(records)} records could be scored (see above).")

    print(f"input: {args.input} (response: {resp_key}, answer: {ans_key})")
    print(f"verifiers: {', '.join(f'{v.name} (weight {v.weight:g})' for v in cfg.verifiers)}")
    print(f"records: {len(records)} ({len(ok)} scored, {len(bad)} skipped)")
    _print_means(ok, [v.name for v in cfg.verifiers])
    print(f"timeouts: {timeouts}")
    if errors:
        print(f"verifier errors: {errors} (scored as failures; see the warning above)")
    print(f"time: {elapsed:.2f} s ({len(ok) * len(cfg.verifiers) / elapsed:.1f} verifications/s)")
    if args.output:
        print(f"wrote {len(lines)} lines to {args.output}")
    return 0


def _reward_config(args: argparse.Namespace) -> Any:
    """The reward section the command line describes (config.RewardConfig), its problems as a UserError."""
    from pydantic import ValidationError

    from postrl.config import RewardConfig
    from postrl.config.schema import VERIFIER_CHECK
    from postrl.rewards.registry import verifier_problems

    section = {"verifiers": parse_verifiers(args.verifier, args.weights), "timeout_s": args.timeout, "workers": args.workers}
    try:
        return RewardConfig.model_validate(section, context={VERIFIER_CHECK: verifier_problems})
    except ValidationError as exc:
        raise UserError(*(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def _read_records(path: str, limit: int | None) -> list:
    """The input's records (at most `limit`); an unreadable file is a UserError, a bad line a record."""
    from postrl.data.readers import iter_records

    records = []
    for rec in iter_records(path):
        if rec.number == 0:
            raise UserError(f"{rec.where}: {rec.problem}", title="cannot read the input")
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise UserError(f"{path}: no records. Fix: pass a file with one completion per record.")
    return records


def _score(cfg: Any, items: list) -> tuple[dict[int, dict], int, int]:
    """The scorable items' results by index, in batches of BATCH, and the time-outs and verifier errors."""
    from postrl.rewards.registry import RewardFunction

    reward = RewardFunction(cfg)
    scored: dict[int, dict] = {}
    timeouts = errors = 0
    try:
        todo = [(k, it) for k, it in enumerate(items) if not isinstance(it, str)]
        for b in range(0, len(todo), BATCH):
            chunk = todo[b : b + BATCH]
            out = reward([it[0] for _, it in chunk], [it[1] for _, it in chunk], [it[2] for _, it in chunk])
            timeouts += out.timeouts
            errors += out.errors
            for j, (k, _) in enumerate(chunk):
                scored[k] = {
                    "score": out.scores[j],
                    "acc": out.metrics["acc"][j],
                    "metrics": {name: vals[j] for name, vals in out.metrics.items()},
                    "timeout": bool(out.timed_out[j]) if out.timed_out else False,
                }
    finally:
        reward.close()
    return scored, timeouts, errors


def _print_means(ok: list[dict], names: list[str]) -> None:
    print(f"mean score: {sum(ln['score'] for ln in ok) / len(ok):.4f}")
    print(f"acc: {sum(ln['acc'] for ln in ok) / len(ok):.4f}")
    for name in dict.fromkeys(names):
        print(f"{name}/mean: {sum(ln['metrics'][name] for ln in ok) / len(ok):.4f}")
