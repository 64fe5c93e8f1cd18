"""Knobs of the built-in tasks: the `data.builtin.*` (arithmetic) and `data.shapes.*` config sections.

They are the demo tasks' settings, kept apart from the core sections (schema.py) in a module of their own;
`postrl.config.DataConfig` holds one of each, so the YAML keys stay where users put them and validation
still reports every problem at once. The config package does not import the tasks (postrl.builtin).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())  # a misspelt knob is refused, as in config


class MixedTeacherKnobs(_Knobs):
    """SFT reference solutions from a mixed teacher (both built-in tasks); prompts and answers never change."""

    terse_ratio: float = Field(
        0.0, ge=0, le=1, description="Fraction of training rows whose reference solution is the bare boxed answer."
    )
    hasty_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fraction of those bare answers that are wrong: the total before the last step (a hasty solver).",
    )


class TaskKnobs(MixedTeacherKnobs):
    """What both built-in tasks have."""

    seed: int = Field(1234, description="Seed of the task's generator (problems, pictures).")
    train_size: int = Field(20000, ge=1, description="Number of training rows.")
    val_size: int = Field(500, ge=1, description="Number of held-out rows (disjoint from training).")


class BuiltinTaskConfig(TaskKnobs):
    """Knobs of the built-in synthetic arithmetic word problems (`builtin:arithmetic:<split>`)."""

    max_value: int = Field(20, ge=2, description="Operands are drawn from 1..max_value.")
    min_operands: int = Field(2, ge=2, description="Fewest numbers in a problem.")
    max_operands: int = Field(3, ge=2, description="Most numbers in a problem.")
    subtraction: bool = Field(True, description="Allow 'gives away' steps (subtraction, never below zero).")
    instruction: str = Field(
        "", description="Text after each question, e.g. 'Answer with just the number.' for a pretrained instruct model."
    )


class ShapesTaskConfig(TaskKnobs):
    """Knobs of the built-in visual task: count the shapes in a picture, then add / take away (`builtin:shapes:<split>`)."""

    train_size: int = Field(4000, ge=1, description="Number of training pictures.")
    val_size: int = Field(200, ge=1, description="Number of held-out pictures (disjoint from training).")
    image_size: int = Field(56, ge=28, description="Picture side in pixels, a multiple of 28 (56: 4 image tokens).")
    min_shapes: int = Field(1, ge=1, description="Fewest shapes in a picture.")
    max_shapes: int = Field(5, ge=1, description="Most shapes in a picture (at most one per 14-pixel cell).")
    max_value: int = Field(20, ge=1, description="Numbers added are drawn from 1..max_value.")
    max_ops: int = Field(2, ge=1, description="Most add / take-away steps after counting.")

    @model_validator(mode="after")
    def _check(self) -> "ShapesTaskConfig":
        problems = []
        if self.image_size % 28:
            problems.append(
                f"image_size ({self.image_size}) must be a multiple of 28 (whole 2 x 2 merges of 14-pixel "
                "patches). Fix: use 56, 84 or 112."
            )
        cells = (self.image_size // 14) ** 2
        if not self.min_shapes <= self.max_shapes <= cells:
            problems.append(
                f"needs min_shapes ({self.min_shapes}) <= max_shapes ({self.max_shapes}) <= {cells}, the "
                f"cells of a {self.image_size}-pixel picture. Fix: lower max_shapes or raise image_size."
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self


class ToolArithmeticConfig(_Knobs):
    """Knobs of the built-in task where tools matter (`builtin:tool_arithmetic:<split>`): a * b +/- c."""

    seed: int = Field(1234, description="Seed of the task's generator.")
    train_size: int = Field(20000, ge=1, description="Number of training rows.")
    val_size: int = Field(500, ge=1, description="Number of held-out rows (disjoint from training).")
    tool_ratio: float = Field(
        0.3, ge=0, le=1,
        description="Fraction of training rows whose SFT reference is a calculator trace (the rest: a rough guess).",
    )  # fmt: skip
    max_digits: int = Field(4, ge=3, le=6, description="Most digits of the added / subtracted number c.")
