"""Where does RL lose the greedy answer? Per held-out prompt, the start model against a trained one.

For every prompt of the validation file: the greedy completion of each model and whether it is right;
the start model's sampled accuracy at the rollout temperature (8 samples: what RL trained on for such
a prompt); the start greedy path's log-prob (at T 1, what greedy decoding follows) and its smallest
top-1 / top-2 logit margin along the path, under both models; and the mean log-prob of the start
model's right and wrong samples under both models. Prints the flips (right -> wrong, wrong -> right)
by the start's sampled accuracy and margin, and how the greedy path moved against the samples.

    python benchmarks/greedy_drift.py START_MODEL END_MODEL VAL_PARQUET [--prompts 300] [--temperature 0.6]

Agent trajectories (a tool task): the validation samples a run wrote (logging.samples), two steps compared
per prompt: right -> wrong flips, and whether the first turn's tool call copies the prompt's entity (its
argument's text occurs in the prompt) or names another; prints a few lost trajectories.

    python benchmarks/greedy_drift.py --samples RUN_DIR/samples --steps BEST LAST [--show 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import user_tasks  # noqa: E402
from postrl.checks import load_config  # noqa: E402


def _generate(model, tok, prompts: list[list[int]], temperature: float, n: int, max_tokens: int, seed: int) -> list[list[list[int]]]:
    """n completions (token ids, eos excluded) per prompt; temperature 0 = greedy."""
    torch.manual_seed(seed)
    out: list[list[list[int]]] = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for i in range(0, len(prompts), 32):
        chunk = prompts[i : i + 32]
        L = max(map(len, chunk))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, num_return_sequences=n,
                                 pad_token_id=pad, eos_token_id=tok.eos_token_id, **kw)[:, L:]  # fmt: skip
        for j in range(len(chunk)):
            group = []
            for row in gen[j * n : (j + 1) * n].tolist():
                stop = next((k for k, t in enumerate(row) if t in (tok.eos_token_id, pad)), len(row))
                group.append(row[:stop])
            out.append(group)
    return out


def _path_stats(model, prompt: list[int], completion: list[int]) -> tuple[float, float]:
    """(log-prob at T 1 of `completion` after `prompt`, smallest top-1 minus top-2 logit margin along it)."""
    if not completion:
        return 0.0, 0.0
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).sum().item()
    top2 = logits.topk(2, -1).values
    return logp, (top2[:, 0] - top2[:, 1]).min().item()


def _first_call(row: dict) -> dict | None:
    """The first tool call of a validation trajectory (samples JSONL), or None when the first turn calls none."""
    turns = [t for t in row["turns"] if t["role"] == "assistant"]
    calls = turns[0]["tool_calls"] if turns else []
    return calls[0] if calls and "name" in calls[0] else None


def _copies_entity(row: dict) -> bool | None:
    """Whether the first tool call's string arguments all occur in the prompt's user text; None without a call."""
    call = _first_call(row)
    if call is None:
        return None
    values = [str(v) for v in (call.get("arguments") or {}).values()]
    user = row["prompt"].split("user", 1)[-1]
    return bool(values) and all(v and v in user for v in values)


def trajectory_flips(samples_dir: Path, best: int, last: int, show: int = 3) -> dict:
    """Per validation prompt, the samples at step `best` against step `last`: flips, and entity copying in the call."""
    import json

    load = lambda step: [json.loads(x) for x in (samples_dir / f"val_step_{step}.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = load(best), load(last)
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b], "the two validations hold different prompts"
    out = {"n": len(a), "acc": (sum(r["acc"] for r in a) / len(a), sum(r["acc"] for r in b) / len(b))}
    out["lost"] = [i for i, (x, y) in enumerate(zip(a, b)) if x["acc"] == 1 and y["acc"] != 1]
    out["gained"] = [i for i, (x, y) in enumerate(zip(a, b)) if x["acc"] != 1 and y["acc"] == 1]
    for tag, rows in (("best", a), ("last", b)):
        copied = [_copies_entity(r) for r in rows]
        out[f"{tag}_called"] = sum(c is not None for c in copied)
        out[f"{tag}_exact"] = sum(c is True for c in copied)
        out[f"{tag}_other_entity"] = sum(c is False for c in copied)
    out["lost_other_entity"] = sum(_copies_entity(b[i]) is False for i in out["lost"])
    print(f"{out['n']} prompts: step {best} {out['acc'][0]:.1%} -> step {last} {out['acc'][1]:.1%}; "
          f"lost {len(out['lost'])}, gained {len(out['gained'])}")  # fmt: skip
    for tag, step in (("best", best), ("last", last)):
        print(f"  step {step}: first turn calls the tool in {out[tag + '_called']}, with the prompt's entity in "
              f"{out[tag + '_exact']}, with another in {out[tag + '_other_entity']}")  # fmt: skip
    print(f"  of the {len(out['lost'])} lost, the call names another entity in {out['lost_other_entity']}")
    for i in out["lost"][:show]:
        user = a[i]["prompt"].split("user", 1)[-1].strip()
        print(f"--- lost: {user!r}\n  step {best}: {a[i]['response']!r}\n  step {last}: {b[i]['response']!r}")
        print(f"  step {last} turns: {json.dumps(b[i]['turns'], ensure_ascii=False)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("start", nargs="?")
    ap.add_argument("end", nargs="?")
    ap.add_argument("val", nargs="?")
    ap.add_argument("--samples", type=Path, help="a run's samples directory: compare two validations' trajectories")
    ap.add_argument("--steps", type=int, nargs=2, metavar=("BEST", "LAST"))
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    if args.samples:
        trajectory_flips(args.samples, *args.steps, show=args.show)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from postrl.data.dataset import load_prompts

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"model.path={args.start}", f"data.train_files=[{args.val}]"])
    tok = AutoTokenizer.from_pretrained(args.start)
    examples, _ = load_prompts([args.val], tok, cfg.data, max_rows=args.prompts)
    prompts = [e.prompt_ids for e in examples]
    models = {k: AutoModelForCausalLM.from_pretrained(p).eval() for k, p in (("start", args.start), ("end", args.end))}

    def right(ids: list[int], e) -> bool:
        return user_tasks.exact_boxed(tok.decode(ids, skip_special_tokens=True), e.ground_truth, e.row)["acc"] == 1.0

    greedy = {k: [g[0] for g in _generate(m, tok, prompts, 0.0, 1, args.max_tokens, 0)] for k, m in models.items()}
    samples = _generate(models["start"], tok, prompts, args.temperature, 8, args.max_tokens, 1)
    rows = []
    for i, e in enumerate(examples):
        g0, g1 = greedy["start"][i], greedy["end"][i]
        ok = [right(s, e) for s in samples[i]]
        (lp0, margin0), (lp1, _) = (_path_stats(models[k], e.prompt_ids, g0) for k in ("start", "end"))
        moves = {True: [], False: []}  # sampled completions' log-prob change, by correctness
        for s, r in zip(samples[i][:4], ok[:4]):
            moves[r].append(_path_stats(models["end"], e.prompt_ids, s)[0] - _path_stats(models["start"], e.prompt_ids, s)[0])
        rows.append({"before": right(g0, e), "after": right(g1, e), "p": sum(ok) / len(ok), "margin": margin0,
                     "d_greedy": lp1 - lp0, "d_right": moves[True], "d_wrong": moves[False]})  # fmt: skip

    n = len(rows)
    acc0, acc1 = sum(r["before"] for r in rows) / n, sum(r["after"] for r in rows) / n
    print(f"{n} prompts: greedy {acc0:.1%} -> {acc1:.1%}; start sampled acc at T {args.temperature}: {sum(r['p'] for r in rows) / n:.1%}")
    groups = {
        "kept right": [r for r in rows if r["before"] and r["after"]],
        "lost (right -> wrong)": [r for r in rows if r["before"] and not r["after"]],
        "gained (wrong -> right)": [r for r in rows if not r["before"] and r["after"]],
        "stayed wrong": [r for r in rows if not r["before"] and not r["after"]],
    }
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print("| prompts | n | start sampled acc | start greedy margin | d logp greedy path | d logp right samples | d logp wrong samples |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rs in groups.items():
        print(f"| {name} | {len(rs)} | {mean([r['p'] for r in rs]):.2f} | {mean([r['margin'] for r in rs]):.2f} | "
              f"{mean([r['d_greedy'] for r in rs]):+.3f} | {mean([x for r in rs for x in r['d_right']]):+.3f} | "
              f"{mean([x for r in rs for x in r['d_wrong']]):+.3f} |")  # fmt: skip
    print("greedy right at the start, by its sampled accuracy at T: n, lost")
    for lo, hi in ((0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.01)):
        rs = [r for r in rows if r["before"] and lo <= r["p"] < hi]
        print(f"  p in [{lo:.2f}, {min(hi, 1):.2f}): {len(rs)}, lost {sum(not r['after'] for r in rs)}")
    print("greedy wrong at the start, by its sampled accuracy at T: n, gained")
    for lo, hi in ((0, 0.01), (0.01, 0.25), (0.25, 0.5), (0.5, 1.01)):
        rs = [r for r in rows if not r["before"] and lo <= r["p"] < hi]
        print(f"  p in [{lo:.2f}, {min(hi, 1):.2f}): {len(rs)}, gained {sum(r['after'] for r in rs)}")


if __name__ == "__main__":
    main()
