"""Command line: postrl train | sft | rm | eval | doctor | preprocess | verify | export | check-config | convert-config | report | serve-tinker | tiny-model.

Every command takes a YAML config and dotted overrides (`algorithm.clip_ratio_high=0.3`). A problem
the user can fix is printed as one short paragraph per problem, without a traceback, and the
command exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

# vLLM must run in-process for colocated weight sync; set before anything imports it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from rich.console import Console  # noqa: E402

from postrl.errors import Stopped, UserError  # noqa: E402

console = Console()


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. train.total_steps=5")


def _quiet_console(cfg) -> None:
    """Third-party warnings and logs to the run's log file (postrl.console), said once on the terminal."""
    from postrl.console import quiet_console

    path = quiet_console(cfg.logging)
    if path is not None and os.environ.get("RANK", "0") == "0":
        console.print(f"third-party warnings and logs: {path} (logging.verbose=true shows them here)", highlight=False, soft_wrap=True)


def cmd_train(args) -> int:
    from postrl.checks import load_config

    if _is_script(args.config):  # a verl launch script: converted in memory, the mapping printed, then trained
        cfg, args.config, args.overrides = (*_from_script(args), [])
    else:
        cfg = load_config(args.config, args.overrides)
    _quiet_console(cfg)  # before torch is imported (postrl.console)
    if args.nproc and args.nproc > 1 or cfg.cluster.launcher != "local" or args.ray_address or "LOCAL_RANK" in os.environ:
        from postrl.launch import launch  # starts torchrun / Ray, or runs one rank under them

        return launch(args, cfg)
    from postrl.trainer import train

    train(cfg, console)
    return 0


def cmd_sft(args) -> int:
    from postrl.checks import load_config

    cfg = load_config(args.config, args.overrides)
    _quiet_console(cfg)  # before torch is imported (postrl.console)
    from postrl.sft import run_sft

    run_sft(cfg, console)
    return 0


def cmd_rm(args) -> int:
    from postrl.checks import load_config
    from postrl.rm import run_rm

    run_rm(load_config(args.config, args.overrides), console)
    return 0


def cmd_check_config(args) -> int:
    from postrl.checks import load_config
    from postrl.config import dump_config

    cfg = load_config(args.config, args.overrides, check_paths=not args.no_path_check)
    console.print(dump_config(cfg), markup=False, highlight=False)
    console.print(f"[green]{args.config}: configuration is valid[/green]")
    _print_memory(cfg, args.device_memory)
    return 0


def _print_memory(cfg, device_gib: float | None) -> None:
    """The per-device memory estimate (postrl.memory) for the config's strategy and world size."""
    from postrl.memory import estimate_for_config, report

    assumed = False
    if device_gib is None:
        from postrl.runtime import accelerator

        total = accelerator().memory_stats().get("total")  # this machine's device, none on CPU
        device_gib, assumed = (total / (1 << 30), False) if total else (80.0, True)
    est, what = estimate_for_config(cfg, device_gib)
    lines = [what] if est is None else report(est, what, device_gib, cfg.rollout.engine, cfg.rollout.gpu_memory_utilization, assumed)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def cmd_eval(args) -> int:
    from postrl.eval_cli import run_eval

    return run_eval(args, console)


def cmd_doctor(args) -> int:
    from postrl.checks import load_config

    cfg = load_config(args.config, args.overrides)
    _quiet_console(cfg)  # before torch is imported (postrl.console)
    if args.mismatch:
        return _doctor_mismatch(cfg, args)
    from postrl.doctor import diagnose, print_report

    print_report(diagnose(cfg, args.prompts, console.print), console)
    return 0


def _doctor_mismatch(cfg, args) -> int:
    """postrl doctor --mismatch: the engine's log-probs vs the trainer's on one rollout batch (docs/debugging.md)."""
    from pathlib import Path

    from postrl.diagnose.mismatch import diagnose_mismatch
    from postrl.diagnose.report import print_mismatch, write_json

    report = diagnose_mismatch(cfg, full_distribution=args.full_distribution, top_k=args.top_k, log=console.print)
    print_mismatch(report, console)
    path = write_json(report, Path(args.json or Path(cfg.logging.dir) / "doctor_mismatch.json"))
    console.print(f"JSON: {path}", highlight=False)
    return 0


def cmd_export(args) -> int:
    from postrl.checkpoint import export, model_dtype

    out = export(args.checkpoint, args.out, args.dtype)
    console.print(f"exported to {out}: {model_dtype(out)} weights (load with AutoModelForCausalLM.from_pretrained or vllm.LLM)")
    return 0


def cmd_preprocess(args) -> int:
    from postrl.data.preprocess import main_preprocess

    return main_preprocess(args.config)


def cmd_verify(argv: list[str]) -> int:
    from postrl.verify_cli import main_verify

    return main_verify(argv)


def cmd_report(args) -> int:
    from pathlib import Path

    from postrl.metrics import plot_run

    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path} does not exist. Fix: pass the logging.dir of a run (it holds metrics.jsonl).")
    out = plot_run(path, Path(args.run_dir) / "training.png", args.algo)
    console.print(f"plot written to {out}")
    return 0


def _is_script(config: str) -> bool:
    """A source `postrl train` converts first: a verl launch script or override file (not a YAML config)."""
    from pathlib import Path

    return Path(config).suffix not in (".yaml", ".yml", ".json") and Path(config).is_file()


def _from_script(args):
    """Convert a verl script for `postrl train`: print the mapping, refuse settings that run code without
    --allow-code, write the YAML beside the run (launched ranks read it), and return (the validated config, its path).
    The run is built from the validated tree; the written YAML reads back as that same tree (render_yaml checks)."""
    from pathlib import Path

    from postrl.checks import environment_problems, validate_tree
    from postrl.guides import code_keys, sends_keys

    conv, source, text = _convert(args.config, args.env, args.overrides, None, allow_code=args.allow_code)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    code = code_keys(conv.tree) + [(key, value, what) for key, value, what, gated in sends_keys(conv.tree) if gated]
    if code and not args.allow_code:
        raise UserError(
            *(f"{key} = {value!r}: {what}." for key, value, what in code),
            f"Fix: read the settings above and the code they name; if you trust it, run again with --allow-code "
            f"(`postrl train {args.config} --allow-code`), or remove them from {source}.",
            title=f"{source} sets {len(code)} setting(s) that run code other than postrl's or send the model's code away, and nothing of a script runs unless you allow it",
        )
    cfg = validate_tree(conv.tree, f"{source} converted")
    problems = environment_problems(cfg)
    if problems:
        raise UserError(*problems, title=f"{source} converted: {len(problems)} problem(s) in the configuration")
    out = Path(cfg.logging.dir) / "converted_from_verl.yaml"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror}. Fix: set logging.dir=<a directory you may write to>.") from None
    console.print(f"{source}: {len(conv.mapped)} keys mapped, {len(conv.unmapped)} not mapped (listed above); training with {out}",
                  markup=False, highlight=False, soft_wrap=True)  # fmt: skip
    return cfg, str(out)


def _env(env_args: list[str]) -> dict[str, str]:
    """--env NAME=VALUE, or --env NAME: the value of NAME in this process's environment (read only when named)."""
    bad = [e for e in env_args if not e.partition("=")[0].isidentifier()]
    if bad:
        raise UserError(*(f"--env {e}: not of the form NAME=VALUE or NAME (a shell variable's name). Fix: e.g. --env DATA_DIR=/data." for e in bad))
    missing = [e for e in env_args if "=" not in e and e not in os.environ]
    if missing:
        raise UserError(*(f"--env {e}: {e} is not set in your environment, so there is no value to take. Fix: --env {e}=VALUE." for e in missing))
    env = {}
    for e in env_args:
        name, given, value = e.partition("=")
        env[name] = value if given else os.environ[name]
    return env


def _convert(source_arg: str, env_args: list[str], overrides: list[str], base: str | None, allow_code: bool = False):
    """(conversion, source name, postrl YAML) of a MindSpeed-RL YAML, a verl script or override list, or an
    inline verl command line; validated (a problem names the source line its postrl key came from) without
    importing the user's code unless `allow_code`."""
    from postrl.checks import validate_tree
    from postrl.config import is_config_key, parse_overrides, read_yaml_mapping
    from postrl.guides import Mapped, build_tree, convert_file, convert_verl, flatten, inert, render_yaml

    env = _env(env_args)
    if source_arg == "-" or "=" in source_arg:  # verl overrides on the command line
        conv, source = convert_verl([source_arg, *overrides] if source_arg != "-" else overrides, "the command line"), "the command line"
    else:
        conv, source = convert_file(source_arg, env, overrides), source_arg
    unknown = [o for o in conv.rest if not is_config_key(o.split("=", 1)[0].lstrip("+"))]
    if unknown:
        raise UserError(*(f"override '{o}' names neither a key of {source} ({conv.dialect}) nor a postrl key, so it cannot "
                          "be applied. Fix: correct the key (docs/guides.md lists both)." for o in unknown))  # fmt: skip
    conv.mapped += [Mapped(f"{k} (command line)", v, {k: v}) for k, v in parse_overrides(conv.rest)]
    if base:
        tree = flatten(read_yaml_mapping(base, example="configs/tiny_grpo.yaml", keys="sections (model:, data:, ...)"))
        conv.mapped.insert(0, Mapped(f"--base {base}", None, tree, ""))
    build_tree(conv)
    if not (conv.tree.get("model") or {}).get("path"):
        raise UserError(
            f"{source} converts to a fragment ({len(conv.mapped)} keys, no model path: tokenizer_name_or_path / "
            "actor_rollout_ref.model.path), not a whole configuration. Fix: convert it together with your configuration, "
            f"`postrl convert-config {source_arg} --base your_config.yaml` (the fragment's keys win), or add the model key."
        )
    text = render_yaml(conv, source)
    try:
        validate_tree(conv.tree if allow_code else inert(conv.tree), f"{source} converted")  # a bad value: say so now
    except UserError as exc:  # name the source line each postrl key came from
        origin = {k: (f"line {conv.lines[m.source]}: " if m.source in conv.lines else "") + m.source for m in conv.mapped for k in m.targets}
        raise UserError(*(_with_origin(p, origin) for p in exc.problems), title=exc.title) from None
    return conv, source, text


def cmd_convert_config(args) -> int:
    """A MindSpeed-RL YAML or a verl script / override list -> a postrl YAML (postrl.guides; docs/guides.md)."""
    from pathlib import Path

    conv, source, text = _convert(args.source, args.env, args.overrides, args.base)
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise UserError(f"-o {out} is a directory. Fix: name the YAML file to write, e.g. -o {out / 'converted.yaml'}.")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except OSError as exc:
            raise UserError(f"cannot write {out}: {exc.strerror}. Fix: pick a path you may write to.") from None
        console.print(
            f"wrote {out}: {len(conv.mapped)} keys mapped, {len(conv.unmapped)} not mapped, {len(conv.notes)} notes (listed at its end)",
            markup=False, highlight=False,
        )  # fmt: skip
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    return 0


def _with_origin(problem: str, origin: dict[str, str]) -> str:
    key = problem.split(":", 1)[0]
    return f"{problem} (It came from {origin[key]}.)" if key in origin else problem


def cmd_tiny_model(args) -> int:
    from postrl.builtin.tiny import build_tiny_model

    console.print(str(build_tiny_model(out_dir=args.out)))
    return 0


def cmd_serve_tinker(args) -> int:
    from postrl.agents.endpoint.server import HttpLimits
    from postrl.checks import load_config
    from postrl.serve import serve
    from postrl.serve.app import Limits

    if args.config and "=" in args.config and not os.path.exists(args.config):  # no CONFIG, only overrides
        args.config, args.overrides = None, [args.config, *args.overrides]
    cfg = load_config(args.config, args.overrides)
    if args.export:
        from postrl.serve.engine import Engine

        engine = Engine(cfg.model.path, args.model_name or cfg.model.path, args.state_dir, cfg.model.dtype, tiny=cfg.model.tiny)
        console.print(f"exported {args.export} to {engine.export(args.export, args.out or 'exported')}", highlight=False)
        return 0
    serve(cfg, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("TINKER_API_KEY", ""),
          state_dir=args.state_dir, name=args.model_name, max_samplers=args.max_samplers, allow_remote=args.allow_remote, log=console.print, http=HttpLimits(max_body_bytes=args.max_body_bytes),
          limits=Limits(max_datums=args.max_datums, max_tokens=args.max_tokens))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="postrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="GRPO / DAPO training (CONFIG may be a verl launch script: converted first)")
    _config_args(p)
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a verl script's variable ($NAME); NAME alone takes its value from your environment (read for no other name)")
    p.add_argument("--allow-code", action="store_true",
                   help="a verl script may set what runs code (trust_remote_code, reward functions, tools, agents): allow it")
    p.add_argument("--nproc", type=int, default=0, help="processes on this machine (torchrun underneath)")
    p.add_argument("--ray-address", default=None, help="run through Ray Train on this cluster")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="supervised warm start (prompt tokens masked)")
    _config_args(p)
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("rm", help="train a reward model from preference pairs or labelled outcomes")
    _config_args(p)
    p.set_defaults(fn=cmd_rm)
    p = sub.add_parser("check-config", help="print the resolved config, or every problem in it")
    _config_args(p)
    p.add_argument("--no-path-check", action="store_true", help="do not check that model and data paths exist")
    p.add_argument(
        "--device-memory", type=float, default=None, metavar="GIB",
        help="memory of one device for the fit verdict of the memory estimate (default: this GPU's / NPU's, else 80)",
    )  # fmt: skip
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("eval", help="evaluate a model or checkpoint on a data set")
    _config_args(p)
    p.add_argument("--model", default=None, help="model directory or checkpoint (default: model.path)")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("doctor", help="greedy vs sampled accuracy and pass@k: does RL have headroom here?")
    _config_args(p)
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts to measure on")
    p.add_argument("--mismatch", action="store_true", help="the rollout engine's log-probs vs the trainer's on one rollout batch")
    p.add_argument("--full-distribution", action="store_true", help="with --mismatch: compare the whole next-token distributions")
    p.add_argument("--top-k", type=int, default=20, help="with --full-distribution: the top-k compared")
    p.add_argument("--json", default=None, help="with --mismatch: the JSON report (default <logging.dir>/doctor_mismatch.json)")
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("export", help="checkpoint -> plain Hugging Face model directory")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
        help="weights of the export (default auto: the run's model.dtype; checkpoints hold fp32 masters)",
    )  # fmt: skip
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("preprocess", help="raw data -> verl-schema parquet")
    p.add_argument("config")
    p.set_defaults(fn=cmd_preprocess)
    sub.add_parser("verify", help="score a JSONL file of completions offline (see postrl verify --help)", add_help=False)
    p = sub.add_parser("report", help="plot a run's metrics")
    p.add_argument("run_dir")
    p.add_argument("--algo", default="dapo")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("convert-config", help="a MindSpeed-RL YAML or verl overrides -> a postrl YAML")
    p.add_argument("source", help="MindSpeed-RL YAML, a file of verl key=value overrides, or the first override itself")
    p.add_argument("overrides", nargs="*", default=[], help="more verl overrides (key=value)")
    p.add_argument("-o", "--out", default=None, help="write the postrl YAML here (default: print it)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a variable the script uses ($NAME); NAME alone takes its value from your environment (read for no other name)")
    p.add_argument("--base", default=None, metavar="CONFIG", help="a postrl config the converted keys go over (for fragments)")
    p.set_defaults(fn=cmd_convert_config)
    p = sub.add_parser("serve-tinker", help="serve the Tinker API (training clients, samplers) on this machine")
    p.add_argument("config", nargs="?", default=None, help="YAML config (model.path is the base model; default builtin:tiny-qwen2)")
    p.add_argument("overrides", nargs="*", default=[], help="dotted overrides, e.g. model.path=builtin:tiny-qwen2")
    p.add_argument("--host", default="127.0.0.1", help="listen address (loopback unless --allow-remote)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="the key clients send (tml-...; default $TINKER_API_KEY)")
    p.add_argument("--model-name", default=None, help="the base_model name clients use (default model.path)")
    p.add_argument("--allow-remote", action="store_true", help="listen on a non-loopback --host")
    p.add_argument("--state-dir", default="runs/tinker", help="where saved weights and optimizer states go (tinker:// paths)")
    p.add_argument("--max-samplers", type=int, default=32, help="sampler adapters held in memory at once (least recently used "
                   "released; a named one reloads from --state-dir)")
    p.add_argument("--export", default=None, metavar="TINKER_PATH", help="write a saved sampler (tinker://.../sampler_weights/NAME) "
                   "as a plain Hugging Face model directory to --out, and exit")
    p.add_argument("--out", default=None, help="the directory --export writes")
    p.add_argument("--max-body-bytes", type=int, default=256 * 2**20, help="largest request body (default 256 MiB)")
    p.add_argument("--max-datums", type=int, default=4096, help="most datums per forward_backward")
    p.add_argument("--max-tokens", type=int, default=32768, help="most tokens per datum or prompt")
    p.set_defaults(fn=cmd_serve_tinker)
    p = sub.add_parser("tiny-model", help="build (or find in the cache) the tiny Qwen2 model")
    p.add_argument("--out", default=None)
    p.set_defaults(fn=cmd_tiny_model)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; options may stand anywhere among the overrides
    (`postrl train CONFIG --nproc 2 key=value`), hence intermixed parsing of the subcommand's arguments.
    (`parse_intermixed_args` refuses a parser with subcommands, so the subcommand is picked first.)"""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or argv[0] not in sub.choices:
        return parser.parse_args(argv)  # --help, or an unknown command: argparse's own message
    args = sub.choices[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def print_user_error(exc: UserError) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/bold red] {escape(_printable(exc.title))}")
    for problem in exc.problems:
        console.print(f"  - {_printable(problem)}", markup=False, highlight=False)


def _printable(text: str) -> str:
    """Text from a user's file shown on a terminal: control characters (an escape sequence in a script) as escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in str(text))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "verify":
            return cmd_verify(argv[1:])
        args = parse_args(argv)
        return args.fn(args)
    except UserError as exc:
        print_user_error(exc)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130
    except Stopped as exc:  # SIGTERM / SIGINT: the trainer saved a checkpoint and said so
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
