"""The GPU check (issue 39): one prepared run, on one GPU, in well under 8 minutes, whenever a GPU is at hand.

Phases, each in its own subprocess with its own time limit (one that fails or runs out of time leaves the
others' figures), in this order, within --budget seconds in all (default 420; a phase that no longer fits is skipped):

  tests               pytest -m gpu over the test files that carry the `gpu` marker (passed / failed / skipped)
  postrl-0.5b         GRPO on a Qwen2.5-0.5B-shaped model (the published config, random weights, the built-in
                      tokenizer trained locally; benchmarks/gpu_step.py builds both): model.dtype bfloat16 (fp32
                      masters), train.strategy fsdp2, packing (train.use_remove_padding) and chunked log-probs
                      (train.logprob_chunk_tokens), gradient checkpointing, the HF engine generating, --steps
                      steps (the first a warm-up). Per step: e2e and update tokens/s, and the peak device memory
                      (torch.cuda.max_memory_allocated) of the step, of its rollout and of its update, beside
                      `postrl check-config`'s estimate for the same config (postrl.memory.estimate_for_config)
                      and the estimate's error in % of the measurement.
  trl-0.5b            TRL's GRPOTrainer on the same model directory, prompts, lengths, group size, micro-batch,
                      checkpointing and precision (gpu_step.run_trl); the ratio postrl / TRL of e2e tokens/s.
  postrl-0.5b-lora64  the same with LoRA adapters (--lora-rank, alpha 2 x rank, all linear layers) ...
  trl-0.5b-lora64     ... and TRL with the same adapters (peft_config)
  postrl-1.5b, trl-1.5b   the next --shapes, if the budget still allows

Everything goes to OUT (three files, within the GPU machine's limits on what comes back):
gpu_check.json (settings, device, every phase's figures and per-step rows), gpu_check.md (the tables,
printed last too) and gpu_check.log (every phase's own output).

On the lent GPU machine (docs/gpu.md "The GPU check"), with the wheels of benchmarks/gpu_wheels.txt:

    bash scripts/gpu_check.sh "$OUT"
    python benchmarks/gpu_check.py --out DIR [--budget 420] [--shapes 0.5b 1.5b] [--lora-rank 64]

The CPU dry run (tests/test_gpu_check.py) runs this same script with --device cpu and tiny sizes:

    python benchmarks/gpu_check.py --out /tmp/gc --device cpu --shapes smoke --prompts 2 --samples 2 \\
        --prompt 16 --response 8 --micro 4 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MARK = "@@ "  # a worker's result lines: MARK + a JSON object (a "step" key: one step's row; others: fields)
GiB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and gpu_check.log")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all phases together (a phase that no longer fits is skipped)")
    ap.add_argument("--tests-limit", type=float, default=150.0, help="seconds the tests phase may take")
    ap.add_argument("--phase-limit", type=float, default=150.0, help="seconds a training phase may take (x 1.5 for shapes after the first)")
    ap.add_argument("--min-phase", type=float, default=45.0, help="a phase starts only with at least this many seconds of budget left")
    ap.add_argument("--phases", nargs="+", default=None, help="run only these phases (names as in the docstring)")
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], help="Qwen2.5 shapes (postrl.memory.QWEN25; smoke: a tiny one)")
    ap.add_argument("--lora-rank", type=int, default=64, help="LoRA phases' adapter rank, first shape only (0: no LoRA phases)")
    ap.add_argument("--no-trl", action="store_true", help="leave TRL's phases out")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per training phase (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--response", type=int, default=512, help="response tokens (rollout.max_tokens; a random model runs to it)")
    ap.add_argument("--micro", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--chunk", type=int, default=1024, help="train.logprob_chunk_tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn", default="auto", help="model.attn_implementation (auto: flash_attention_2 where installed, else sdpa)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="train.device (cpu: the dry run)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: PHASE,WORKDIR
    args = ap.parse_args(argv)
    args.engine, args.no_checkpointing = "hf", False  # what gpu_step's runners read: HF generate, checkpointing on
    return args


# ------------------------------------------------------------------------------------------ phases


def plan(args) -> list[dict]:
    """The phases in order: name, kind, shape, LoRA rank, time limit."""
    phases = [{"name": "tests", "kind": "tests", "limit": args.tests_limit}]
    for i, shape in enumerate(args.shapes):
        limit = args.phase_limit * (1.0 if i == 0 else 1.5)
        for lora in [0] + ([args.lora_rank] if args.lora_rank and i == 0 else []):
            for fw in ["postrl"] + ([] if args.no_trl else ["trl"]):
                name = f"{fw}-{shape}" + (f"-lora{lora}" if lora else "")
                phases.append({"name": name, "kind": fw, "shape": shape, "lora": lora, "limit": limit})
    if args.phases:
        unknown = sorted(set(args.phases) - {p["name"] for p in phases})
        if unknown:
            sys.exit(f"gpu_check: unknown phase(s) {unknown}; valid: {', '.join(p['name'] for p in phases)}")
        phases = [p for p in phases if p["name"] in args.phases]
    return phases


def run_phase(phase: dict, argv: list[str], work: Path, limit: float, log) -> dict:
    """Run one phase in a subprocess of its own session (killed with its children past `limit`)."""
    cmd = [sys.executable, __file__, *argv, "--worker", f"{phase['name']},{work}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    phase_log = work / f"{phase['name']}.log"
    start = time.perf_counter()
    with phase_log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=15)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    seconds = time.perf_counter() - start
    text = phase_log.read_text(errors="replace")
    log.write(f"\n===== {phase['name']} ({seconds:.0f} s, exit {rc}) =====\n{text}")
    log.flush()
    result: dict = {"name": phase["name"], "kind": phase["kind"], "seconds": round(seconds, 1), "steps": []}
    for k in ("shape", "lora"):
        if k in phase:
            result[k] = phase[k]
    for line in text.splitlines():
        if line.startswith(MARK):
            try:
                row = json.loads(line[len(MARK) :])
            except json.JSONDecodeError:  # the last line of a killed worker, cut short
                continue
            if "step" in row:
                result["steps"].append(row["step"])
            else:
                result.update(row)
    if rc is None:
        result["status"] = f"killed at its limit of {limit:.3g} s"
    elif "unavailable" in result:  # TRL absent
        result["status"] = f"skipped: {result.pop('unavailable')}"
    elif rc != 0 or not result.get("done"):
        tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(MARK)][-1:] or ["no output"]
        result["status"] = f"failed (exit {rc}): {tail[0][:300]}"
    else:
        result["status"] = "ok"
    result.pop("done", None)
    if phase["kind"] == "tests" and "passed" not in result:  # killed before the junit file: count pytest -v's lines
        outcomes = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M)
        result.update({k.lower(): sum(o == k for _, o in outcomes) for k in ("PASSED", "SKIPPED")})
        result["failed"] = sum(o in ("FAILED", "ERROR") for _, o in outcomes)
        result["failures"] = [t for t, o in outcomes if o in ("FAILED", "ERROR")]
        result["files"] = sorted({t.split("::")[0] for t, _ in outcomes})
    summarise(result)
    return result


def summarise(r: dict) -> None:
    """Means over the timed steps (all but the first, the warm-up) and the estimate's errors."""
    timed = r["steps"][1:] or r["steps"]
    for key in ("e2e_tps", "update_tps", "rollout_tps", "step_s", "peak_gib", "rollout_peak_gib", "update_peak_gib"):
        vals = [s[key] for s in timed if s.get(key) is not None]
        if vals:
            r[key] = sum(vals) / len(vals) if not key.endswith("peak_gib") else max(s[key] for s in r["steps"] if s.get(key) is not None)
    r["steps_timed"] = len(timed)
    est = r.get("estimate")
    if est and r.get("peak_gib"):
        for measured, estimated in (("peak_gib", "peak_gib"), ("rollout_peak_gib", "rollout_gib"), ("update_peak_gib", "update_gib")):
            if r.get(measured):
                r[f"error_{measured.removesuffix('_gib')}_pct"] = 100.0 * (est[estimated] - r[measured]) / r[measured]


# ----------------------------------------------------------------------------------------- workers


def emit(**fields) -> None:
    print(MARK + json.dumps(fields), flush=True)


def environment() -> dict:
    import importlib.metadata as md

    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("transformers", "peft", "accelerate", "trl", "datasets", "pyarrow", "pydantic"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_gib=round(p.total_memory / GiB, 1), cuda=torch.version.cuda)
    else:
        env.update(device="cpu", device_gib=None)
    return env


def model_for(args, shape: str, root: Path) -> tuple[Path, Path]:
    """The shape's model directory and prompts, built by the first phase that needs them (atomically: a
    phase killed while building leaves nothing half-written for the next)."""
    import shutil

    import gpu_step

    final = root / f"model-{shape}"
    if not (final / "prompts.jsonl").is_file():
        tmp = root / f"model-{shape}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        device = "cuda" if args.device != "cpu" and _cuda() else "cpu"
        t0 = time.perf_counter()
        gpu_step.build_model_dir(shape, tmp, device)
        gpu_step.write_prompts(tmp, tmp / "prompts.jsonl", args.prompts, args.prompt)
        tmp.rename(final)
        print(f"[{shape}] model and prompts built in {time.perf_counter() - t0:.0f} s", flush=True)
    return final, final / "prompts.jsonl"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def tests_worker(args, work: Path) -> None:
    """pytest -m gpu over the files that carry the marker (a whole-suite collection would also import
    modules whose optional packages the GPU machine lacks)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-rs", "--durations=5", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(junit).getroot().iter("testcase") if junit.is_file() else []:
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    emit(files=files, pytest_exit=rc, failures=failures, **counts)
    emit(done=rc in (0, 1, 5))  # 1: some failed (counted above); 5: none selected


def postrl_worker(args, phase: dict, work: Path) -> None:
    import torch

    import gpu_step
    from postrl import distributed
    from postrl.checks import load_config
    from postrl.memory import estimate_for_config
    from postrl.trainer import Trainer

    args.lora_rank = phase["lora"]
    model_dir, data = model_for(args, phase["shape"], work)
    run = work / phase["name"]
    overrides = gpu_step.postrl_overrides(args, model_dir, data, run) + [
        "train.strategy=fsdp2", "train.use_remove_padding=true", f"train.logprob_chunk_tokens={args.chunk}",
    ]  # fmt: skip
    cfg = load_config(None, overrides, check_paths=False)
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    device_gib = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else 80.0
    est, what = estimate_for_config(cfg, device_gib)
    if est is not None:
        emit(estimate={"peak_gib": est.peak / GiB, "update_gib": est.update / GiB, "rollout_gib": est.rollout / GiB, "what": what})
    tr = Trainer(cfg)
    emit(
        framework="postrl", engine=tr.engine.name, attn=tr.model.config._attn_implementation, world_size=tr.runtime.world_size,
        sharded=distributed.is_sharded(tr.model), params=sum(p.numel() for p in tr.model.parameters()),
        trained_params=sum(p.numel() for p in tr.model.parameters() if p.requires_grad),
    )  # fmt: skip
    meter = PeakMeter(cuda)
    tr.experience.collect = meter.around("rollout", tr.experience.collect)
    tr.actor.update = meter.around("update", tr.actor.update)
    step = tr.train_step

    def train_step() -> dict:
        meter.start()
        m = step()
        row = {
            "step": tr.step + 1, "e2e_tps": m["e2e_tps"], "update_tps": m["update_tps"], "rollout_tps": m["rollout_tps"],
            "step_s": m["timing/all"], "update_s": m["timing/update"], "rollout_s": m["timing/rollout"],
            "response_len": m["response_length/mean"], "prompt_len": m["prompt_length/mean"], **meter.stop(),
        }  # fmt: skip
        emit(step=row)
        print(f"[{phase['name']}] step {row['step']}: e2e {row['e2e_tps']:,.0f} tok/s, update {row['update_tps']:,.0f} tok/s, "
              f"{row['step_s']:.1f} s, peak {row.get('peak_gib') or 0:.2f} GiB", flush=True)  # fmt: skip
        return m

    tr.train_step = train_step
    tr.fit()
    emit(done=True)


class PeakMeter:
    """Peak device memory of a step and of its named parts (torch.cuda.max_memory_allocated, reset around each)."""

    def __init__(self, cuda: bool):
        self.cuda, self.step_max, self.parts = cuda, 0, {}

    def _flush(self) -> int:
        import torch

        peak = torch.cuda.max_memory_allocated()
        self.step_max = max(self.step_max, peak)
        torch.cuda.reset_peak_memory_stats()
        return peak

    def around(self, name: str, fn):
        if not self.cuda:
            return fn

        def wrapped(*a, **k):
            self._flush()
            out = fn(*a, **k)
            self.parts[name] = max(self.parts.get(name, 0), self._flush())
            return out

        return wrapped

    def start(self) -> None:
        self.step_max, self.parts = 0, {}
        if self.cuda:
            self._flush()
            self.step_max = 0

    def stop(self) -> dict:
        if not self.cuda:
            return {"peak_gib": None}
        self._flush()
        return {"peak_gib": self.step_max / GiB, **{f"{k}_peak_gib": v / GiB for k, v in self.parts.items()}}


def trl_worker(args, phase: dict, work: Path) -> None:
    import gpu_step

    args.lora_rank = phase["lora"]
    model_dir, data = model_for(args, phase["shape"], work)
    r = gpu_step.run_trl(args, model_dir, data, work / phase["name"])
    steps = r.pop("steps", [])
    for i, s in enumerate(steps):
        emit(step={"step": i + 1, **s, "peak_gib": None})
    if "peak_mem_gib" in r:
        r["peak_gib"] = r.pop("peak_mem_gib") or None  # the whole run's (0 on the CPU)
    r.pop("e2e_tps", None), r.pop("step_s", None)  # means are taken by the driver, as for postrl
    if "skipped" in r:
        r["unavailable"] = r.pop("skipped")
    emit(**r)
    emit(done="unavailable" not in r)


def worker(args) -> None:
    name, work = args.worker.split(",", 1)
    work = Path(work)
    phase = next(p for p in plan(args) if p["name"] == name)
    emit(env=environment())
    if phase["kind"] == "tests":
        tests_worker(args, work)
    elif phase["kind"] == "postrl":
        postrl_worker(args, phase, work)
    else:
        trl_worker(args, phase, work)


# ----------------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": vars(args), "env": None, "phases": []}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, (out / "gpu_check.log").open("w") as log:
        for phase in plan(args):
            left = args.budget - (time.perf_counter() - started)
            if left < args.min_phase:
                r = {"name": phase["name"], "kind": phase["kind"], "status": f"skipped: {left:.0f} s of the {args.budget:.0f} s budget left"}
            else:
                r = run_phase(phase, argv, Path(tmp), min(phase["limit"], left), log)
            report["env"] = report["env"] or r.pop("env", None)
            r.pop("env", None)
            report["phases"].append(r)
            print(f"{r['name']:<22} {r['status']}" + (f" ({r['seconds']:.0f} s)" if "seconds" in r else ""), flush=True)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # after every phase: a kill keeps the rest
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "gpu_check.md").write_text(md)
    print("\n" + md)
    return 0


def _layout(report: dict) -> str:
    """What FSDP2 did in the postrl phases: on one rank postrl shards nothing (distributed.wrap_model returns
    the model) and casts to bf16 by autocast over the fp32 masters, which is what check-config estimates."""
    runs = [r for r in report["phases"] if r["kind"] == "postrl" and "world_size" in r]
    if not runs:
        return "one rank"
    r = runs[0]
    return f"{r['world_size']} rank(s), " + ("sharded" if r.get("sharded") else "unsharded: one rank wraps nothing, bf16 by autocast")


def markdown(report: dict) -> str:
    env, s = report["env"] or {}, report["settings"]
    lines = [
        f"GPU check, {report['date']}: {env.get('device', '?')} ({env.get('device_gib') or '-'} GiB), torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}, TRL {env.get('trl') or 'absent'}; {report.get('seconds', 0):.0f} s in all.",
        f"{s['prompts']} prompts x {s['samples']} samples, {s['prompt']} prompt + {s['response']} response tokens, micro-batch "
        f"{s['micro']}, {s['dtype']}, gradient checkpointing, HF generate; postrl: train.strategy fsdp2 on {_layout(report)}, "
        f"packing, log-prob chunks of {s['chunk']}; means over steps 2..{s['steps']} (step 1 warms up). Estimate error: "
        "(estimate - measured) / measured, of the step's peak (torch.cuda.max_memory_allocated).",
        "",
    ]
    for r in report["phases"]:
        if r["kind"] == "tests" and "passed" in r:
            fails = f": {', '.join(r['failures'])}" if r.get("failures") else ""
            done = "" if r["status"] == "ok" else f" before it stopped ({r['status']})"
            lines.append(
                f"GPU tests ({', '.join(r['files'])}): {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped{done}{fails}"
            )
            lines.append("")
    lines += [
        "| phase | status | e2e tok/s per step | e2e tok/s | update tok/s per step | update tok/s | peak GiB (rollout / update) "
        "| estimate GiB (rollout / update) | estimate error | postrl / TRL |",
        "| --- | --- | --- | ---: | --- | ---: | --- | --- | ---: | ---: |",
    ]
    trl = {r["name"].removeprefix("trl-"): r.get("e2e_tps") for r in report["phases"] if r["kind"] == "trl"}

    def num(v, fmt=",.0f"):
        return "-" if v is None else format(v, fmt)

    for r in report["phases"]:
        if r["kind"] == "tests":
            continue
        steps = r.get("steps", [])
        e2e = " / ".join(num(x.get("e2e_tps")) for x in steps) or "-"
        upd = " / ".join(num(x.get("update_tps")) for x in steps) or "-"
        peak = f"{num(r.get('peak_gib'), '.2f')} ({num(r.get('rollout_peak_gib'), '.2f')} / {num(r.get('update_peak_gib'), '.2f')})"
        est = r.get("estimate") or {}
        estimate = f"{num(est.get('peak_gib'), '.2f')} ({num(est.get('rollout_gib'), '.2f')} / {num(est.get('update_gib'), '.2f')})"
        error = num(r.get("error_peak_pct"), "+.0f") + ("%" if r.get("error_peak_pct") is not None else "")
        ratio = "-"
        peer = trl.get(r["name"].removeprefix("postrl-"))
        if r["kind"] == "postrl" and r.get("e2e_tps") and peer:
            ratio = f"{r['e2e_tps'] / peer:.2f}"
        status = r["status"] if len(r["status"]) < 60 else r["status"][:57] + "..."
        lines.append(
            f"| {r['name']} | {status} | {e2e} | {num(r.get('e2e_tps'))} | {upd} | {num(r.get('update_tps'))} | {peak} | {estimate} "
            f"| {error} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
