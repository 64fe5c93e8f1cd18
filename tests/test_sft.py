"""The SFT warm start's progress: a plain line every 5% of the steps when output is not a terminal."""

from __future__ import annotations


from conftest import quiet_console

from postrl.sft import _Progress


def _lines(total: int, bar: bool, terminal: bool) -> list[str]:
    console = quiet_console(200, force_terminal=terminal)
    with _Progress(console, total, bar=bar) as progress:
        for step in range(1, total + 1):
            progress.update(step, loss=1.0 / step)
    return [ln for ln in console.file.getvalue().splitlines() if ln.startswith("SFT step")]


def test_a_file_gets_a_line_every_5_percent_of_the_steps_and_the_last():
    lines = _lines(45, bar=True, terminal=False)
    assert [ln.split()[2] for ln in lines] == [f"{s}/45" for s in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                                   32, 34, 36, 38, 40, 42, 44, 45)]  # fmt: skip
    assert "loss 0.5000" in lines[0] and "loss 0.0222" in lines[-1]


def test_a_terminal_gets_the_bar_and_no_lines_unless_the_bar_is_off():
    assert _lines(10, bar=True, terminal=True) == []
    assert len(_lines(10, bar=False, terminal=True)) == 10
