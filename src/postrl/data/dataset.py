"""Prompt datasets for training and validation.

Rows come in the verl schema (data_source, prompt as chat messages, reward_model.ground_truth,
extra_info) from parquet / JSONL / JSON files, or from the built-in tasks (`builtin:arithmetic:<split>`,
`builtin:shapes:<split>`). Prompts are rendered with the tokenizer's chat template and tokenised once,
up front. Rows with images (`data.image_key`, `<image>` placeholders in the prompt) are encoded by the policy's
modality adapter (`postrl.modality`) and carry their images as plain data in `PromptExample.multi_modal`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from postrl.modality.images import BadImageRow, has_image_data, mentions_images
from postrl.errors import UserError
from postrl.modality import TEXT, Modality
from postrl.utils import get_dotted

RowsOf = Callable[[str, "dict | None"], list[dict]]  # 'verifiers:<split>', the environment's settings -> rows


@dataclass
class PromptExample:
    prompt_ids: list[int]
    ground_truth: str
    row: dict
    data_source: str
    multi_modal: dict | None = None  # VLMs: plain image data, e.g. {"images", "image_grid_thw"} (postrl.modality)


def read_rows(
    path: str, builtin_knobs: dict | None = None, shapes_knobs: dict | None = None, tool_knobs: dict | None = None,
    environment: dict | None = None, rows_of: RowsOf | None = None,
) -> list[dict]:
    """All rows of one data file (parquet, jsonl, json list) or built-in split, or 'verifiers:train' / 'verifiers:eval':
    the dataset / eval_dataset of rollout.environment (`environment`: its settings, DataConfig._environment), read
    by `rows_of` (agents/verifiers/env.py `dataset_rows`). The command hands that reader in: the environment runs
    in a process of agents/, above this package, which imports nothing from agents."""
    if path.startswith("verifiers:"):
        if rows_of is None:
            raise UserError(f"data file '{path}' is a verifiers environment's dataset, which this command does not read. Fix: name data files.")
        return rows_of(path, environment)
    if path.startswith("builtin:"):
        from postrl.builtin.tasks import task_file

        path = str(task_file(path, {"arithmetic": builtin_knobs, "shapes": shapes_knobs, "tool_arithmetic": tool_knobs}))
    try:
        from postrl.data.readers import read_records  # full readers (row-numbered errors)

        return list(read_records(path))
    except ImportError:
        pass
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".jsonl":
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if p.suffix == ".json":
        return json.loads(p.read_text())
    raise UserError(f"{path}: unsupported file type '{p.suffix}'. Use .parquet, .jsonl or .json.")


def render_prompt(tokenizer, prompt: Any, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template (plain text, said once, without one);
    `tools`: the agent loop's tool schemas, for the template's `tools=`."""
    from postrl.data.templates import render_chat

    return render_chat(tokenizer, prompt, tools)


def encode_prompt(
    tokenizer, row: dict, prompt: Any, data_cfg, where: str, base_dir: Path | None = None, modality: Modality | None = None,
    tools: list[dict] | None = None,
):
    """(token ids, image inputs or None) of a row's prompt; None for a malformed image row when
    data.skip_bad_rows is set (else a UserError that names the row: `where`).

    A row goes the image way when it has images, or when the model takes images and its prompt has
    `<image>` placeholders; then `modality` (the policy's adapter; None: text) encodes it.
    """
    modality = modality or TEXT
    images = row.get(data_cfg.image_key) if data_cfg.image_key else None
    if not has_image_data(images) and not (modality.takes_images and mentions_images(prompt)):
        return render_prompt(tokenizer, prompt, tools), None
    try:
        return modality.encode_prompt(tokenizer, prompt, images, data_cfg, base_dir)
    except BadImageRow as exc:
        if data_cfg.skip_bad_rows:
            return None
        raise UserError(f"{where}: {exc} (Or set data.skip_bad_rows: true to skip and count such rows.)") from None


def load_prompts(
    files: list[str], tokenizer, data_cfg, max_rows: int | None = None, modality: Modality | None = None,
    tools: list[dict] | None = None, rows_of: RowsOf | None = None,
) -> tuple[list[PromptExample], dict]:
    """Tokenised prompts of `files` and a summary {rows, dropped_overlong, dropped_bad, kept}.

    `modality` is the policy's adapter (None: text); it encodes the rows with images. `tools` are the agent
    loop's tool schemas (postrl.agents.loop.loop.tool_schemas), rendered by the chat template.
    """
    examples: list[PromptExample] = []
    dropped, total, bad = 0, 0, 0
    empty_truths: list[str] = []
    knobs = data_cfg.builtin.model_dump()
    for f in files:
        rows = read_rows(f, knobs, data_cfg.shapes.model_dump(), data_cfg.tool_arithmetic.model_dump(), getattr(data_cfg, "_environment", None), rows_of)
        name = _dataset_name(f)
        for i, row in enumerate(rows):
            if max_rows is not None and i >= max_rows:
                break
            total += 1
            prompt = get_dotted(row, data_cfg.prompt_key)
            gt = get_dotted(row, data_cfg.answer_key)
            if prompt is None or gt is None:
                missing = data_cfg.prompt_key if prompt is None else data_cfg.answer_key
                raise UserError(
                    f"{f}, row {i}: no '{missing}' field. The trainer reads the prompt from data.prompt_key "
                    f"('{data_cfg.prompt_key}') and the ground truth from data.answer_key ('{data_cfg.answer_key}'). "
                    "Fix: set those keys to your columns, or convert the file with `postrl preprocess`."
                )
            if isinstance(gt, str) and not gt.strip():
                empty_truths.append(f"{f}, row {i}")
                continue
            encoded = encode_prompt(tokenizer, row, prompt, data_cfg, f"{f}, row {i}", file_dir(f), modality, tools)
            if encoded is None:  # malformed image row, skipped by data.skip_bad_rows
                bad += 1
                continue
            ids, multi_modal = encoded
            if multi_modal is not None:
                row = {k: v for k, v in row.items() if k != data_cfg.image_key}  # verifiers get no image bytes
            if len(ids) > data_cfg.max_prompt_length:
                if not data_cfg.filter_overlong_prompts:
                    raise UserError(
                        f"{f}, row {i}: prompt has {len(ids)} tokens > data.max_prompt_length "
                        f"({data_cfg.max_prompt_length}). Fix: raise max_prompt_length or set filter_overlong_prompts: true."
                    )
                dropped += 1
                continue
            examples.append(PromptExample(ids, str(gt), row, row.get("data_source") or name, multi_modal))
    if empty_truths:
        more = f" and {len(empty_truths) - 10} more" if len(empty_truths) > 10 else ""
        raise UserError(
            f"{', '.join(empty_truths[:10])}{more}: the ground truth (data.answer_key '{data_cfg.answer_key}') is empty. "
            "A verifier compares each response with it, so every response would score as wrong and the prompt teach "
            "nothing. Fix: fill in the answers, or drop those rows (`postrl preprocess` writes them from the raw data)."
        )
    if not examples:
        raise UserError(
            f"no usable prompts in {files} ({total} rows read, {dropped} too long, {bad} malformed image rows). "
            "Fix: check the files and data.max_prompt_length."
        )
    return examples, {"rows": total, "dropped_overlong": dropped, "dropped_bad": bad, "kept": len(examples)}


def file_dir(path: str) -> Path | None:
    """Relative image paths in a data file are taken from the file's directory (when not found from the cwd)."""
    return None if path.startswith(("builtin:", "verifiers:")) else Path(path).expanduser().resolve().parent


def _dataset_name(path: str) -> str:
    if path.startswith("builtin:"):
        return path.split(":")[1]
    return Path(path).stem


@dataclass
class PromptSampler:
    """Shuffled epochs over `size` prompts; its state (epoch, position) is saved in checkpoints."""

    size: int
    shuffle: bool = True
    seed: int = 0
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            take = min(k - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()


def load_train_prompts(cfg, tokenizer, modality: Modality | None, tools: list[dict] | None, log, rows_of: RowsOf | None = None) -> list[PromptExample]:
    """The run's training prompts (`load_prompts`), said at start; a warning when the prompts ask for an answer
    format no verifier reads. (`train.total_epochs` becomes steps in config.derive_total_steps.)"""
    from postrl.rewards.math import answer_format_problem

    examples, summary = load_prompts(cfg.data.train_files, tokenizer, cfg.data, modality=modality, tools=tools, rows_of=rows_of)
    bad = f", {summary['dropped_bad']} malformed image rows skipped" if summary.get("dropped_bad") else ""
    log(f"train prompts: {summary['kept']} ({summary['dropped_overlong']} dropped as overlong{bad})")
    head = [tokenizer.decode(e.prompt_ids) for e in examples[:32]]
    if (problem := answer_format_problem(head, [v.name for v in cfg.reward.verifiers])) is not None:
        log(f"[yellow]{problem}[/yellow]")  # e.g. DAPO-Math-17k's "Answer:" prompts with math_17k_acc
    return examples
