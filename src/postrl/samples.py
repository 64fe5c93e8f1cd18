"""Samples a user can read: the rollouts trained on and the validation generations, as JSONL.

    <logging.dir>/samples/rollout_step_N.jsonl   the batch step N trained on (logging.samples.rollout_freq)
    <logging.dir>/samples/val_step_N.jsonl       every generation of the validation at step N (logging.samples.val)

One line per trajectory (verl's `trainer.rollout_data_dir` / `validation_data_dir`, TRL's `log_completions`):

    {"step": 10, "version": 9, "prompt": "...", "turns": [
        {"role": "assistant", "text": "...", "tool_calls": [{"name": "calculator", "arguments": {...}}]},
        {"role": "tool", "text": "<tool_response> 42 </tool_response> ..."},
        {"role": "assistant", "text": "... \\boxed{42}", "tool_calls": []}],
     "response": "<what the policy wrote, all its turns: what the verifiers read>",
     "reward": 1.0, "score": 1.0, "acc": 1.0, "finished": true, "tool_calls": 1, ...}

A trajectory is one token list (DESIGN.md section 10); its turns are the runs of its loss mask: a run of 1s
is a model turn (its tool calls parsed as the agent loop parses them), a run of 0s is what the loop appended
(a tool's result rendered with the chat template, or an environment's turn). Rollout lines add the sampling
`version` (the policy version whose weights sampled it: step - 1 in sync rollout), `reward` (after overlong
shaping), `score` (the raw verifier score) and `group` (the prompt's index in the batch); validation lines the
validation `set` and the `ground_truth`. Only rank 0 writes. `logging.samples.print_val` prints that many
validation samples per validation set as a table on the console.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

SAMPLES_DIR = "samples"


def split_turns(tokenizer: Any, ids: list[int], mask: list[int] | None) -> list[dict]:
    """The turns of a trajectory after its prompt: one per run of equal loss-mask values (None: one model turn)."""
    from postrl.toolcall import ParseError, parse_tool_calls

    mask = mask if mask is not None else [1] * len(ids)
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    turns: list[dict] = []
    called = False  # the model turn before a masked run made a tool call: the run is the tool's answer
    for m, run in runs:
        text = tokenizer.decode(run, skip_special_tokens=True)
        if m:
            parsed = parse_tool_calls(tokenizer.decode(run, skip_special_tokens=False))
            calls = [{"error": parsed.message}] if isinstance(parsed, ParseError) else [
                {"name": c.name, "arguments": c.arguments} for c in parsed]  # fmt: skip
            called = bool(calls)
            turns.append({"role": "assistant", "text": text, "tool_calls": calls})
        else:
            turns.append({"role": "tool" if called else "environment", "text": text})
    return turns


def _policy_text(turns: list[dict]) -> str:
    return "".join(t["text"] for t in turns if t["role"] == "assistant")


class SampleWriter:
    """Writes the samples of one run (rank 0 only); every method is a no-op where its setting is off."""

    def __init__(self, cfg: Any, tokenizer: Any, log: Callable = print, enabled: bool = True):
        self.cfg = cfg.logging.samples
        self.dir = Path(cfg.logging.dir) / SAMPLES_DIR
        self.G = cfg.rollout.n_samples_per_prompt  # a batch is prompt-major: its groups are G contiguous rows
        self.tokenizer, self.log, self.enabled = tokenizer, log, enabled
        self._opened: set[Path] = set()  # files this process began: the first write replaces a file of a run resumed before

    def _write(self, name: str, rows: list[dict]) -> Path:
        path = self.dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a" if path in self._opened else "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._opened.add(path)
        return path

    def rollout(self, step: int, batch: Any) -> None:
        """The batch trained on at `step` (batch.Batch), every logging.samples.rollout_freq steps."""
        freq = self.cfg.rollout_freq
        if not (self.enabled and freq and step % freq == 0):
            return
        rows = []
        for i in range(batch.size):
            turns = split_turns(self.tokenizer, batch.response_ids[i], batch.loss_masks[i])
            metrics = batch.verifier_metrics[i]
            rows.append({
                "step": step, "version": batch.versions[i], "group": i // self.G,
                "prompt": self.tokenizer.decode(batch.prompt_ids[i], skip_special_tokens=True),
                "turns": turns, "response": _policy_text(turns),
                "reward": batch.rewards[i], "score": batch.scores[i], "acc": metrics.get("acc"),
                "finished": batch.finished[i], "tool_calls": sum(len(t.get("tool_calls", [])) for t in turns),
                "metrics": metrics,
            })  # fmt: skip
        self._write(f"rollout_step_{step}.jsonl", rows)

    def for_validation(self, step: int) -> Callable | None:
        """The `record` callback evaluate() takes for the validation at `step`; None when logging.samples is off."""
        if not (self.enabled and (self.cfg.val or self.cfg.print_val)):
            return None
        return lambda name, examples, completions, acc, scores: self.validation(step, name, examples, completions, acc, scores)

    def validation(self, step: int, name: str, examples: list, completions: list, acc: list, scores: list) -> None:
        """One validation set's generations at `step`: appended to val_step_N.jsonl, the first print_val printed."""
        rows = []
        for c, a, s in zip(completions, acc, scores):
            e = examples[c.prompt_index]
            turns = split_turns(self.tokenizer, c.token_ids, c.loss_mask)
            rows.append({
                "step": step, "version": step, "set": name,
                "prompt": self.tokenizer.decode(c.prompt_ids or e.prompt_ids, skip_special_tokens=True),  # rollout.agent: what the endpoint rendered
                "turns": turns, "response": _policy_text(turns), "ground_truth": e.ground_truth,
                "reward": s, "score": s, "acc": a, "finished": c.finished, "tool_calls": c.tool_calls,
            })  # fmt: skip
        if self.cfg.val:
            self._write(f"val_step_{step}.jsonl", rows)
        if self.cfg.print_val:
            self.log(sample_table(rows[: self.cfg.print_val], f"validation samples: {name}, step {step}"))


def _tail(text: str, n: int) -> str:
    """The end of `text` on one line, at most n characters, unprintable ones (a young model writes them) as '?'."""
    text = " ".join("".join(ch if ch.isprintable() else "?" for ch in text.replace("\n", " ")).split())
    return text if len(text) <= n else "..." + text[-(n - 3):]


def sample_table(rows: list[dict], title: str) -> Any:
    """A rich table of samples: the prompt's end, each turn (tool calls and results), the answer's verdict."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=True, title_justify="left", expand=True)
    table.add_column("prompt (end)", ratio=1)
    table.add_column("trajectory", ratio=3)
    table.add_column("ground truth", max_width=16)
    table.add_column("acc", justify="right")
    for r in rows:
        trajectory = "\n".join(f"[{t['role']}] {_tail(t['text'], 400)}" for t in r["turns"])
        acc = r.get("acc")
        table.add_row(Text(_tail(r["prompt"], 120)), Text(trajectory), Text(str(r.get("ground_truth", ""))),
                      "-" if acc is None else f"{acc:g}")  # fmt: skip
    return table


def read_samples(path: str | Path) -> list[dict]:
    """The lines of a samples file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
