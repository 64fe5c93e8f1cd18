"""benchmarks/gpu_check.py, the prepared GPU check (docs/gpu.md), on the CPU: the same script end to end with
tiny sizes (`--device cpu`), so it cannot rot between the rare runs on a lent GPU; its time limits and budget;
and the arithmetic of its table (the estimate's error, the ratio to TRL), which the CPU run has no device
memory to exercise."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRY = ["--device", "cpu", "--shapes", "smoke", "--prompts", "2", "--samples", "2", "--prompt", "16", "--response", "8",
       "--micro", "4", "--steps", "2", "--lora-rank", "4"]  # fmt: skip


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_cpu_dry_run_reports_every_phase(tmp_path):
    """Slow: about 35 s of CPU time, 160 s of wall time on the shared 2-core machine at a load of 17 (four
    subprocesses, each importing torch and transformers, TRL's also trl and datasets); the only end-to-end run of
    the script short of a GPU, which no session may have for weeks. TRL's LoRA phase is left out (TRL's phase
    with gpu_step's peft_config; it passed by hand: `--phases trl-smoke-lora4`)."""
    has_trl = importlib.util.find_spec("trl") is not None
    phases = ["tests", "postrl-smoke", "postrl-smoke-lora4"] + (["trl-smoke"] if has_trl else [])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path), *DRY, "--phases", *phases],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    by = {r["name"]: r for r in report["phases"]}
    assert [r["name"] for r in report["phases"]] == ["tests", "postrl-smoke"] + (["trl-smoke"] if has_trl else []) + ["postrl-smoke-lora4"]
    assert {r["status"] for r in report["phases"]} == {"ok"}, [r["status"] for r in report["phases"]]
    assert report["env"]["device"] == "cpu" and report["env"]["torch"]

    tests = by["tests"]  # no CUDA here: every gpu-marked test is collected and skipped, none run
    assert "tests/test_gpu.py" in tests["files"] and tests["skipped"] >= 9 and tests["passed"] == tests["failed"] == 0

    full, lora = by["postrl-smoke"], by["postrl-smoke-lora4"]
    for r in (full, lora):
        assert [s["step"] for s in r["steps"]] == [1, 2] and r["steps_timed"] == 1
        for s in r["steps"]:
            assert s["e2e_tps"] > 0 and s["update_tps"] > s["e2e_tps"]  # the update is part of the step
            assert s["prompt_len"] == 16 and 1 <= s["response_len"] <= 8
        assert r["engine"] == "hf" and r["world_size"] == 1 and r["sharded"] is False
        assert r["e2e_tps"] == r["steps"][1]["e2e_tps"]  # the mean leaves the warm-up step out
        assert r.get("peak_gib") is None  # no device memory on the CPU
    assert full["trained_params"] == full["params"] and 0 < lora["trained_params"] < full["params"] / 20
    assert 0 < lora["estimate"]["update_gib"] < full["estimate"]["update_gib"]  # frozen bf16 base: no fp32 masters, AdamW
    assert "0.02B parameters" in full["estimate"]["what"]

    md = (tmp_path / "gpu_check.md").read_text()
    assert md in proc.stdout  # the table is printed last, where the device tool's output tail keeps it
    assert "| postrl-smoke | ok |" in md and f"0 passed, 0 failed, {tests['skipped']} skipped" in md
    if has_trl:
        trl = by["trl-smoke"]
        assert trl["framework"] == "trl" and [s["step"] for s in trl["steps"]] == [1, 2] and trl["e2e_tps"] > 0
        ratio = f"{full['e2e_tps'] / trl['e2e_tps']:.2f} |"
        assert next(line for line in md.splitlines() if line.startswith("| postrl-smoke |")).endswith(ratio)
    log = (tmp_path / "gpu_check.log").read_text()
    assert "===== postrl-smoke (" in log and "[postrl-smoke] step 2:" in log


def test_a_phase_past_its_limit_is_killed_and_the_budget_skips_the_rest(tmp_path):
    gc = _gpu_check()
    gc.main(["--out", str(tmp_path), *DRY, "--tests-limit", "0.5", "--budget", "1", "--min-phase", "0.8"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = [r["status"] for r in report["phases"]]
    assert status[0] == "killed at its limit of 0.5 s" and report["phases"][0]["seconds"] < 20
    assert len(status) == 5 and all(s.startswith("skipped: ") and "of the 1 s budget left" in s for s in status[1:])
    assert "| postrl-smoke | skipped:" in (tmp_path / "gpu_check.md").read_text()


def test_the_table_gives_the_estimate_error_and_the_ratio_to_trl():
    """Hand-made figures: a step peak of 10 GiB against an estimate of 12 GiB is +20%; 300 against TRL's 200
    tokens/s (means of the steps after the warm-up) is 1.50."""
    gc = _gpu_check()
    postrl = {"name": "postrl-0.5b", "kind": "postrl", "status": "ok", "world_size": 1, "sharded": False,
              "estimate": {"peak_gib": 12.0, "rollout_gib": 6.0, "update_gib": 12.0, "what": "x"},
              "steps": [{"e2e_tps": 100.0, "update_tps": 500.0, "peak_gib": 10.0, "rollout_peak_gib": 5.0, "update_peak_gib": 10.0},
                        {"e2e_tps": 280.0, "update_tps": 900.0, "peak_gib": 9.0, "rollout_peak_gib": 5.0, "update_peak_gib": 9.0},
                        {"e2e_tps": 320.0, "update_tps": 1100.0, "peak_gib": 9.5, "rollout_peak_gib": 4.0, "update_peak_gib": 9.5}]}  # fmt: skip
    trl = {"name": "trl-0.5b", "kind": "trl", "status": "ok", "steps": [{"e2e_tps": 50.0}, {"e2e_tps": 190.0}, {"e2e_tps": 210.0}]}
    for r in (postrl, trl):
        gc.summarise(r)
    assert postrl["e2e_tps"] == 300.0 and postrl["update_tps"] == 1000.0 and trl["e2e_tps"] == 200.0
    assert postrl["peak_gib"] == 10.0  # the peak is over every step, the warm-up too
    assert postrl["error_peak_pct"] == pytest.approx(20.0) and postrl["error_rollout_peak_pct"] == pytest.approx(20.0)
    settings = {"prompts": 16, "samples": 8, "prompt": 256, "response": 512, "micro": 8, "dtype": "bfloat16", "chunk": 1024, "steps": 3}
    md = gc.markdown({"date": "d", "settings": settings, "env": {"device": "NVIDIA H100 80GB HBM3"}, "phases": [postrl, trl]})
    row = next(line for line in md.splitlines() if line.startswith("| postrl-0.5b |"))
    assert row.endswith("| 10.00 (5.00 / 10.00) | 12.00 (6.00 / 12.00) | +20% | 1.50 |"), row
    assert "100 / 280 / 320 | 300 |" in row and "unsharded" in md
