"""Score Tinker samplers on held-out problems with rl_loop.py's own prompt and grader, through the `tinker` SDK.

rl_loop.py logs the reward of each training batch: new problems every step, sampled at temperature 1. This asks
the other question, whether the trained weights answer problems they never saw better than the base does: each
sampler (the base model, and saved weights such as the loop's `tinker://<model_id>/sampler_weights/final`) answers
every held-out question once greedily and `--samples` times at temperature 1, in the loop's conversation (its
worked example, its `\\boxed{}` instruction, the renderer its model name picks), graded by the loop's `get_reward`.

    TINKER_API_KEY=tml-... python examples/tinker_cookbook/heldout.py --base-url http://127.0.0.1:8761 \\
        --model-name Qwen/Qwen3-4B-Instruct-2507 --tokenizer DIR --gsm8k heldout.jsonl \\
        base tinker://<model_id>/sampler_weights/final
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samplers", nargs="+", help="'base' (the served model) or tinker:// sampler paths")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True, help="the name the server serves (picks the renderer)")
    parser.add_argument("--tokenizer", required=True, help="a directory with the served model's tokenizer")
    parser.add_argument("--gsm8k", required=True, help="held-out problems as jsonl rows {question, answer: '... #### n'}")
    parser.add_argument("--samples", type=int, default=4, help="samples per question at temperature 1")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    import tinker
    from transformers import AutoTokenizer

    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.recipes import rl_loop
    from tinker_cookbook.tokenizer_utils import register_tokenizer

    register_tokenizer(args.model_name, lambda: AutoTokenizer.from_pretrained(args.tokenizer))
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(args.model_name), AutoTokenizer.from_pretrained(args.tokenizer))
    rows = [json.loads(line) for line in Path(args.gsm8k).read_text().splitlines() if line.strip()]
    suffix = " Provide a numerical answer without units, written inside \\boxed{}."
    example = [  # rl_loop.py's worked example, as it writes it
        {"role": "user", "content": "How many r's are in strawberry?" + suffix},
        {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. "
                                         "We have r's at positions 3, 8, and 9. \\boxed{3}"},
    ]  # fmt: skip
    prompts = [renderer.build_generation_prompt([*example, {"role": "user", "content": r["question"] + suffix}]) for r in rows]
    stop = renderer.get_stop_sequences()
    service = tinker.ServiceClient(base_url=args.base_url)
    for name in args.samplers:
        client = service.create_sampling_client(base_model=args.model_name) if name == "base" else service.create_sampling_client(model_path=name)
        scores = {}
        for label, n, params in (("greedy", 1, tinker.types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop)),
                                 ("t1", args.samples, tinker.types.SamplingParams(max_tokens=args.max_tokens, stop=stop, seed=0))):  # fmt: skip
            futures = [client.sample(prompt=p, num_samples=n, sampling_params=params) for p in prompts]
            rewards = []
            for future, row in zip(futures, rows):
                for seq in future.result().sequences:
                    message, _ = renderer.parse_response(seq.tokens)
                    rewards.append(rl_loop.get_reward(renderers.get_text_content(message), row["answer"]))
            scores[label] = sum(rewards) / len(rewards)
        print(json.dumps({"sampler": name, "problems": len(rows), "greedy_acc": round(scores["greedy"], 3),
                          f"t1_mean_reward_{args.samples}": round(scores["t1"], 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
