"""The mismatch doctor's console report (rich tables) and its JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table


def _gap_table(title: str, rows: list[dict], first: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in (first, "tokens", "mean", "p50", "p99", "max", "k1 KL", "k3 KL"):
        table.add_column(col, justify="right" if col != first else "left", no_wrap=True)
    for r in rows:
        table.add_row(str(r["bucket"]), str(r["tokens"]), *(f"{r[k]:.2e}" for k in ("mean", "p50", "p99", "max", "k1", "k3")))
    return table


def print_mismatch(report: dict[str, Any], console: Any) -> None:
    e, g = report["engine"], report["gap"]
    console.print(
        f"{report['sequences']} sequences, {report['tokens']} sampled tokens at temperature {report['temperature']:g}; "
        f"engine: {e['logprobs']}; trainer: the old-log-prob pass (model.dtype {e['dtype']})", highlight=False,
    )  # fmt: skip
    console.print(_gap_table("per-token |Δ log p| = |trainer - engine| (k1, k3: KL(engine || trainer))", [{"bucket": "all", **g}], ""))
    console.print(_gap_table("by response position", report["by_position"], "position"))
    console.print(_gap_table("by how often the token occurs in the batch", report["by_frequency"], "times"))
    console.print(_gap_table("by the trainer's probability of the token", report["by_probability"], "p"))
    c = report["corrections"]
    table = Table(title=f"what rollout correction would do at cap {c['cap']:g} (configured: {c['configured'] or 'off'})", title_justify="left")
    for col in ("correction", "level", "does", "tokens", "sequences"):
        table.add_column(col)
    for name, v in c.items():
        if isinstance(v, dict):
            table.add_row(name, v["level"], v["what"], f"{v['tokens']:.2%}", f"{v['sequences']:.2%}")
    console.print(table)
    table = Table(title=f"the {len(report['worst'])} worst tokens", title_justify="left")
    for col in ("row", "pos", "context ... [token]", "trainer", "engine", "|Δ|"):
        table.add_column(col)
    for w in report["worst"]:
        ctx = f"{w['context'][-40:]!r} [{w['token']!r}]"
        table.add_row(str(w["row"]), str(w["position"]), ctx, f"{w['trainer_logp']:.3f}", f"{w['engine_logp']:.3f}", f"{w['gap']:.2e}")
    console.print(table)
    fit = report["temperature_fit"]
    console.print(f"temperature fit: the trainer matches the engine best at T {fit['best']:g} (mean gap {fit['gap_at_best']:.2e}; "
                  f"{fit['gap_at_configured']:.2e} at rollout.temperature)", highlight=False)  # fmt: skip
    if report["probe"] is not None:
        p = report["probe"]
        console.print(f"probe at temperature 1 ({p['tokens']} tokens): mean {p['mean']:.2e}, max {p['max']:.2e}", highlight=False)
    if (fd := report.get("full_distribution")) is not None:
        if fd["available"]:
            console.print(f"full distribution at {fd['positions']} positions: top-{fd['topk']} overlap {fd['overlap']:.1%}, "
                          f"KL over the union of the top-k mean {fd['kl_mean']:.2e}, max {fd['kl_max']:.2e}", highlight=False)  # fmt: skip
        else:
            console.print(f"full distribution: not available ({fd['why']})", highlight=False)
    v = report["verdict"]
    console.print(f"[bold]verdict[/bold]: {v['summary']}", highlight=False)
    console.print(f"[bold]fix[/bold]: {v['fix']}", highlight=False)


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=float) + "\n")
    return path
