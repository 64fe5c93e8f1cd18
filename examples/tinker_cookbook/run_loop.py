"""Run tinker-cookbook's own `sl_loop.py` or `rl_loop.py`, unedited, against `postrl serve-tinker`, offline.

What an offline machine lacks is supplied from outside the loop, the way a user without the Hugging Face hub
would supply it, and nothing inside the loop changes:

- the tokenizer: registered under the loop's `model_name` with the cookbook's own `register_tokenizer`
  (the server's base model's tokenizer, from a local directory);
- the renderer: the cookbook picks it by `model_name` from its model table (`model_info`), which has no
  registry; name the served model after a table entry whose renderer is `role_colon` (plain "User: ... /
  Assistant: ..." text, any tokenizer), e.g. serve with `--model-name Qwen/Qwen3-8B-Base` - only the name
  is borrowed, the weights are postrl's `model.path`;
- the datasets: `datasets.load_dataset` answers the two hub names the loops ask for from local files:
  `openai/gsm8k` from a GSM8K jsonl (question, answer), and `HuggingFaceH4/no_robots` with GSM8K turned into
  chats (user: question, assistant: worked answer) - no_robots itself is not on this machine.

    TINKER_API_KEY=tml-... python examples/tinker_cookbook/run_loop.py rl --tokenizer DIR --gsm8k FILE -- \\
        base_url=http://127.0.0.1:8000 model_name=Qwen/Qwen3-8B-Base loss_fn=importance_sampling \\
        batch_size=4 group_size=4 max_tokens=64 max_steps=5 log_path=runs/rl-loop

Everything after `--` goes to the loop's own command line (chz: key=value). docs/tinker.md has the server side.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

LOOPS = {"sl": "tinker_cookbook.recipes.sl_loop", "rl": "tinker_cookbook.recipes.rl_loop"}


def local_datasets(gsm8k: Path, limit: int | None):
    """`datasets.load_dataset` for the loops' two hub names, from the local GSM8K file."""
    import datasets

    rows = [json.loads(line) for line in gsm8k.read_text().splitlines() if line.strip()][:limit]
    real = datasets.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        if path == "openai/gsm8k":
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
        if path == "HuggingFaceH4/no_robots":
            chats = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]} for r in rows]
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(chats)})
        return real(path, name, *args, **kwargs)

    return load_dataset


def main() -> None:
    own, _, loop_args = " ".join(sys.argv[1:]).partition(" -- ")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=sorted(LOOPS))
    parser.add_argument("--tokenizer", required=True, help="a directory with the served model's tokenizer")
    parser.add_argument("--gsm8k", required=True, help="GSM8K as jsonl rows {question, answer}")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N rows")
    args = parser.parse_args(own.split())
    chz_args = loop_args.split()
    model_name = next((a.split("=", 1)[1] for a in chz_args if a.startswith("model_name=")), None)
    if model_name is None:
        parser.error("pass model_name=... after -- (the name the server serves, see --model-name)")

    import datasets
    from transformers import AutoTokenizer

    from tinker_cookbook.tokenizer_utils import register_tokenizer

    register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(args.tokenizer))
    datasets.load_dataset = local_datasets(Path(args.gsm8k), args.limit)
    sys.argv = [LOOPS[args.loop], *chz_args]
    runpy.run_module(LOOPS[args.loop], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
