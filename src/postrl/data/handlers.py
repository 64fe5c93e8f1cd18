"""Dataset handlers: one raw row in, the parts of a verl-schema row out.

A handler reads the fields named by `map_keys` (defaults per handler, overridable in the
preprocess YAML; values are dotted paths, "" means unused) and returns an `Example`: the user's
content, the ground truth, optional system prompt / chat messages / images and extra_info fields.
A row it cannot use raises `RowError` with what is wrong and how to fix it; the preprocess step
reports it with the file and row number and carries on with the other rows.

Built in (guide names in brackets):
- dapo_math_17k [Math17kAlpacaStyleInstructionHandler]: DAPO-Math-17k parquet; `prompt` holds chat
  messages, `reward_model.ground_truth` the answer.
- deepscaler [R1AlpacaStyleInstructionHandler]: DeepScaleR JSON list; problem / answer (/ solution).
- gsm8k: question / answer whose last line is `#### <number>`; the number is the ground truth and
  the full answer is kept as extra_info.solution (for SFT).
- math: MATH / MATH-500; problem / answer (taken from the solution's last \\boxed{} when absent).
- geo3k: images + problem with `<image>` placeholders + answer.
- alpaca [AlpacaStyleInstructionHandler]: generic; prompt (+ query) / response / system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from postrl.modality.images import IMAGE_PLACEHOLDER, BadImageRow, decode_image, read_image
from postrl.utils import get_dotted

MAP_KEY_NAMES = ("prompt", "query", "response", "system", "images")
_ABSENT = object()


class RowError(Exception):
    """A row the handler cannot use: `str(exc)` says what is wrong and how to fix it."""


@dataclass
class Example:
    user: str = ""  # user content (before the template's prefix and the instruction)
    ground_truth: str = ""
    system: str | None = None  # per-row system prompt (None: the template's default)
    messages: list[dict[str, str]] | None = None  # the data's own chat messages, used as given
    images: list[dict[str, Any]] | None = None  # [{"bytes": ..., "path": ...}]
    extra: dict[str, Any] = field(default_factory=dict)
    data_source: str | None = None


@dataclass
class Context:
    """What a handler needs besides the row."""

    map_keys: dict[str, str]
    base_dir: Path | None = None  # image paths in the data are relative to the input file


def _field(row: dict, ctx: Context, role: str, required: bool = True) -> Any:
    key = ctx.map_keys.get(role, "")
    if not key:
        if required:
            raise RowError(f"map_keys has no '{role}' entry. Fix: set map_keys: {{{role}: <column>}}.")
        return None
    value = get_dotted(row, key, _ABSENT)
    if value is _ABSENT or value is None:
        if required:
            present = ", ".join(sorted(row)[:12]) or "(none)"
            raise RowError(
                f"field '{key}' ({role}) is missing or null; the row has: {present}. "
                f"Fix: correct the row, or point map_keys.{role} at the right column."
            )
        return None
    return value


def _text(value: Any, key: str, role: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    raise RowError(
        f"field '{key}' ({role}) is a {type(value).__name__}, expected text. "
        f"Fix: correct the row, or point map_keys.{role} at a text column."
    )


def _text_field(row: dict, ctx: Context, role: str, required: bool = True) -> str | None:
    value = _field(row, ctx, role, required)
    if value is None:
        return None
    text = _text(value, ctx.map_keys[role], role)
    if required and not text.strip():
        raise RowError(f"field '{ctx.map_keys[role]}' ({role}) is empty. Fix: fill it in or drop the row.")
    return text


def _ground_truth(row: dict, ctx: Context) -> str:
    value = _field(row, ctx, "response")
    if isinstance(value, dict):  # DAPO-17k's map_keys point "response" at the reward_model struct
        if value.get("ground_truth") is None:
            raise RowError(
                f"field '{ctx.map_keys['response']}' is a mapping without a 'ground_truth' value (keys: {sorted(value)}). "
                "Fix: fill in the answer, or point map_keys.response at the answer column."
            )
        value = value["ground_truth"]
    if isinstance(value, list) and value and all(isinstance(v, (str, int, float)) for v in value):
        value = ", ".join(_text(v, ctx.map_keys["response"], "response") for v in value)
    text = _text(value, ctx.map_keys["response"], "response").strip()
    if not text:
        raise RowError(f"field '{ctx.map_keys['response']}' (the answer) is empty. Fix: fill it in or drop the row.")
    return text


def _messages(value: Any, key: str) -> list[dict[str, str]]:
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError(f"field '{key}' should hold chat messages [{{role, content}}, ...], got {type(value).__name__}.")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise RowError(
                f"message {k} of '{key}' is not a {{role: str, content: str}} mapping. Fix: correct the row."
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise RowError(f"'{key}' has no user message. Fix: correct the row.")
    return out


# ------------------------------------------------------------------------------------ handlers
def dapo_math_17k(row: dict, ctx: Context) -> Example:
    value = _field(row, ctx, "prompt")
    ex = Example(ground_truth=_ground_truth(row, ctx))
    if isinstance(value, str):
        ex.user = value
    else:
        ex.messages = _messages(value, ctx.map_keys["prompt"])
    ex.system = _text_field(row, ctx, "system", required=False)
    ds = row.get("data_source")
    ex.data_source = ds if isinstance(ds, str) and ds else None
    info = row.get("extra_info")
    if isinstance(info, dict) and info.get("index") is not None:
        ex.extra["source_index"] = str(info["index"])
    return ex


def _problem_answer(row: dict, ctx: Context, keep: tuple[str, ...]) -> Example:
    user = _text_field(row, ctx, "prompt")
    query = _text_field(row, ctx, "query", required=False)
    if query:
        user = f"{user}\n{query}"
    ex = Example(user=user, ground_truth=_ground_truth(row, ctx))
    ex.system = _text_field(row, ctx, "system", required=False)
    for k in keep:
        v = row.get(k)
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            ex.extra[k] = v
    return ex


def deepscaler(row: dict, ctx: Context) -> Example:
    return _problem_answer(row, ctx, ("solution",))


GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$")


def gsm8k(row: dict, ctx: Context) -> Example:
    user = _text_field(row, ctx, "prompt")
    full = _text_field(row, ctx, "response")
    m = GSM8K_ANSWER.search(full.strip().splitlines()[-1]) if full.strip() else None
    if m is None:
        raise RowError(
            f"field '{ctx.map_keys['response']}' does not end with a '#### <number>' line, so there is no "
            "ground truth. Fix: correct the row, or use the 'alpaca' handler for data with bare answers."
        )
    number = m.group(1).replace(",", "").replace("$", "").strip()
    return Example(user=user, ground_truth=number, extra={"solution": full, "question": user})


def math(row: dict, ctx: Context) -> Example:
    user = _text_field(row, ctx, "prompt")
    answer = get_dotted(row, ctx.map_keys["response"], _ABSENT) if ctx.map_keys.get("response") else _ABSENT
    solution = row.get("solution") if isinstance(row.get("solution"), str) else None
    if (answer is _ABSENT or answer is None or answer == "") and solution:
        from postrl.rewards.text import last_boxed

        boxed = last_boxed(solution)
        if boxed is None:
            raise RowError("no 'answer' field and the solution has no \\boxed{} answer. Fix: add the answer.")
        truth = boxed.strip()
    else:
        truth = _ground_truth(row, ctx)
    ex = Example(user=user, ground_truth=truth)
    ex.system = _text_field(row, ctx, "system", required=False)
    if solution:
        ex.extra["solution"] = solution
    for k in ("subject", "level", "unique_id", "type"):
        v = row.get(k)
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            ex.extra[k] = str(v)
    return ex


def _image_item(item: Any, k: int, key: str, base_dir: Path | None) -> dict[str, Any]:
    """One image as {"bytes", "path"}; the bytes must decode as an image."""
    label = f"image {k} of '{key}'"
    try:
        data, path = read_image(item, label, base_dir)
        decode_image(data, label)
    except BadImageRow as exc:
        raise RowError(str(exc)) from None
    return {"bytes": data, "path": path}


def geo3k(row: dict, ctx: Context) -> Example:
    user = _text_field(row, ctx, "prompt")
    key = ctx.map_keys.get("images", "images")
    value = _field(row, ctx, "images")
    items = value if isinstance(value, (list, tuple)) else [value]
    images = [_image_item(item, k, key, ctx.base_dir) for k, item in enumerate(items)]
    if not images:
        raise RowError(f"field '{key}' holds no image. Fix: correct the row.")
    placeholders = user.count(IMAGE_PLACEHOLDER)
    if placeholders > len(images):
        raise RowError(
            f"the problem has {placeholders} <image> placeholders but the row has {len(images)} image(s). "
            "Fix: correct the row."
        )
    user = IMAGE_PLACEHOLDER * (len(images) - placeholders) + user  # each image needs a placeholder
    return Example(user=user, ground_truth=_ground_truth(row, ctx), images=images)


def alpaca(row: dict, ctx: Context) -> Example:
    return _problem_answer(row, ctx, ())


# ------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class HandlerSpec:
    name: str
    fn: Callable[[dict, Context], Example]
    map_keys: dict[str, str]
    data_source: str
    ability: str = "math"
    instruction: str = ""  # appended to the user's content unless the template already instructs
    aliases: tuple[str, ...] = ()


BOXED_HINT = " Let's think step by step and output the final answer within \\boxed{}."
HANDLERS: dict[str, HandlerSpec] = {}
for _spec in (
    HandlerSpec(
        "dapo_math_17k",
        dapo_math_17k,
        {"prompt": "prompt", "response": "reward_model.ground_truth"},
        "math_dapo",
        ability="MATH",
        aliases=("Math17kAlpacaStyleInstructionHandler", "dapo", "math17k"),
    ),
    HandlerSpec(
        "deepscaler",
        deepscaler,
        {"prompt": "problem", "response": "answer"},
        "deepscaler",
        instruction=BOXED_HINT,
        aliases=("R1AlpacaStyleInstructionHandler",),
    ),
    HandlerSpec(
        "gsm8k",
        gsm8k,
        {"prompt": "question", "response": "answer"},
        "openai/gsm8k",
        instruction=' Let\'s think step by step and output the final answer after "####".',
        aliases=("GSM8KHandler",),
    ),
    HandlerSpec("math", math, {"prompt": "problem", "response": "answer"}, "math", instruction=BOXED_HINT,
                aliases=("MATHHandler", "math500")),
    HandlerSpec(
        "geo3k",
        geo3k,
        {"prompt": "problem", "response": "answer", "images": "images"},
        "hiyouga/geometry3k",
        instruction=" First think about the reasoning process inside <think> </think> tags, then put the final "
        "answer in \\boxed{}.",
        aliases=("Geo3kHandler",),
    ),
    HandlerSpec(
        "alpaca",
        alpaca,
        {"prompt": "instruction", "query": "input", "response": "output", "system": "system"},
        "alpaca",
        aliases=("AlpacaStyleInstructionHandler",),
    ),
):
    for _name in (_spec.name, *_spec.aliases):
        HANDLERS[_name] = _spec


def get_handler(name: str) -> HandlerSpec:
    from postrl.errors import UserError

    if name not in HANDLERS:
        names = sorted({s.name for s in HANDLERS.values()})
        raise UserError(
            f"handler_name '{name}' is not known. Handlers: {', '.join(names)} (guide names also accepted: "
            f"{', '.join(sorted(n for n in HANDLERS if n not in names))})."
        )
    return HANDLERS[name]
