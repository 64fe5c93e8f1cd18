"""Built-in visual task: picture arithmetic, "count the shapes, add 12, then take away 3" -> \\boxed{}.

    picture (56 x 56: a 4 x 4 grid of 14-pixel cells, one vision patch each) with 1-5 shapes
    (circle, square, triangle; red, green or blue), at most one per cell, on white
    "Count the shapes, add 12, then take away 3."  ->  "4+12=16. 16-3=13. \\boxed{13}"

The starting number is only in the picture, as a geo3k diagram holds part of its problem, so the
task exercises the whole vision-language path (pixels -> vision tower -> image tokens -> answer);
the arithmetic is a short chain of thought in which every number feeds the answer. Pictures stay
tiny on purpose: a 56 x 56 picture is 16 patches and 4 image tokens after the 2 x 2 merge, so an RL
step on a 2-core CPU costs about what a text step does.

Why this shape of task (measured on the tiny Qwen2.5-VL, see docs/vision.md): questions about one
colour ("How many red shapes?") need the vision features to separate colours per cell; a short SFT
does not get them there, and RL with the vision tower frozen cannot either (even supervised
training with the tower frozen gained nothing). A chain of thought that only listed the counts
("red 2, green 0, blue 1. \\boxed{2}") was worse: the answer did not follow from the listing, so
DAPO let the unrewarded listing drift into noise. Counting all shapes is learned early; the
arithmetic is what the tiny model gets wrong, and RL does not teach it arithmetic in minutes.

Two answer styles, as in the text task (postrl.builtin.arithmetic): the worked solution above and a bare
answer ("\\boxed{13}"). A fraction `terse_ratio` (default 0) of the training rows carries the bare
answer as its reference solution, and a fraction `hasty_ratio` (default 0) of those bare answers is
wrong the way a hasty solver is: it stops before the last step ("\\boxed{16}"; with one step, the
bare count). Worked solutions are always right. The SFT model inherits the mix, and RL with the
verifiable reward has something real to learn: that working the steps out pays. Prompts, rewards
and validation rows do not depend on either ratio.

Problems are deterministic from a seed. Train and validation are disjoint: no validation problem's
(layout, operations) signature appears in training. Rows are written as parquet in the verl schema
with the picture as PNG bytes under `images` and an `<image>` placeholder in the prompt (as geo3k
rows are), so the trainer reads them like any user data set: `builtin:shapes:train` / `:val`.
"""

from __future__ import annotations

import io
import random

from postrl.builtin import cache

TASK_VERSION = 5  # bump when pictures, questions or solutions change (invalidates the cache)
PATCH = 14  # pixels per cell: one vision patch of Qwen2/2.5-VL
COLORS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220)}
KINDS = ("circle", "square", "triangle")


def _jitter(rng: random.Random, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in rgb)  # type: ignore[return-value]


def render(layout: list[tuple[int, str, str]], image_size: int, rng: random.Random) -> bytes:
    """PNG bytes of the picture: `layout` holds (cell, colour, kind) with cells numbered row-major."""
    from PIL import Image, ImageDraw

    grid = image_size // PATCH
    im = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(im)
    for cell, color, kind in layout:
        r, c = divmod(cell, grid)
        size = rng.randint(9, 11)
        x0 = c * PATCH + rng.randint(1, PATCH - size - 1)
        y0 = r * PATCH + rng.randint(1, PATCH - size - 1)
        box = (x0, y0, x0 + size, y0 + size)
        fill = _jitter(rng, COLORS[color])
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + size / 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def make_problem(
    rng: random.Random, image_size: int, min_shapes: int, max_shapes: int, max_value: int = 20, max_ops: int = 2
) -> dict:
    grid = image_size // PATCH
    k = rng.randint(min_shapes, max_shapes)
    cells = sorted(rng.sample(range(grid * grid), k))
    layout = [(cell, rng.choice(list(COLORS)), rng.choice(KINDS)) for cell in cells]
    total, words, steps, ops = k, [], [], []
    for _ in range(rng.randint(1, max_ops)):
        if total > 1 and rng.random() < 0.4:
            x = rng.randint(1, total - 1)
            words.append(f"take away {x}")
            steps.append(f"{total}-{x}={total - x}.")
            ops.append(-x)
            total -= x
        else:
            x = rng.randint(1, max_value)
            words.append(f"add {x}")
            steps.append(f"{total}+{x}={total + x}.")
            ops.append(x)
            total += x
    said = words[0] if len(words) == 1 else ", ".join(words[:-1]) + ", then " + words[-1]
    return {
        "question": f"Count the shapes, {said}.",
        "layout": layout,
        "solution": " ".join(steps) + f" \\boxed{{{total}}}",
        "terse_solution": f"\\boxed{{{total}}}",
        "hasty_solution": f"\\boxed{{{total - ops[-1]}}}",  # the total before the last step
        "answer": str(total),
        "signature": (tuple(layout), tuple(ops)),
    }


def to_verl_row(problem: dict, png: bytes, index: int, split: str, style: str = "solution") -> dict:
    return {
        "data_source": "shapes",
        "prompt": [{"role": "user", "content": "<image>" + problem["question"]}],
        "images": [{"bytes": png, "path": None}],
        "ability": "visual_math",
        "reward_model": {"style": "rule", "ground_truth": problem["answer"]},
        "extra_info": {"index": index, "split": split, "solution": problem[style]},
    }


def generate_splits(
    train_size: int, val_size: int, image_size: int = 56, min_shapes: int = 1,
    max_shapes: int = 5, max_value: int = 20, max_ops: int = 2, terse_ratio: float = 0.0, hasty_ratio: float = 0.0, seed: int = 1234,
) -> dict[str, list[dict]]:
    """Rows of both splits; validation signatures never occur in training."""
    if image_size % (2 * PATCH):
        raise ValueError(f"image_size must be a multiple of {2 * PATCH} (whole 2 x 2 patch merges), got {image_size}")
    cells = (image_size // PATCH) ** 2
    if not 1 <= min_shapes <= max_shapes <= cells:
        raise ValueError(f"need 1 <= min_shapes <= max_shapes <= {cells} (cells of a {image_size}-pixel picture)")
    rng = random.Random(seed)

    def to_row(p: dict, index: int, split: str) -> dict:
        png = render(p["layout"], image_size, rng)
        style = "solution"
        if split == "train":  # two draws per training row whatever the ratios, so prompts do not depend on them
            terse, hasty = rng.random() < terse_ratio, rng.random() < hasty_ratio
            style = ("hasty_solution" if hasty else "terse_solution") if terse else "solution"
        return to_verl_row(p, png, index, split, style)

    return cache.disjoint_splits(
        {"val": val_size, "train": train_size},
        lambda: make_problem(rng, image_size, min_shapes, max_shapes, max_value, max_ops),
        to_row,
        "pictures; raise image_size or max_shapes",
    )


def tokenizer_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Text of the task (questions and solutions) for the tiny vision-language tokenizer."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        p = make_problem(rng, 56, 1, 9, 30, 3)
        texts += [p["question"], p["solution"]]
    return texts
