"""verl's tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`) in postrl's names.

verl reads the file with OmegaConf from the directory it runs in: a list `tools` of {class_name, config,
tool_schema}. postrl reads the same file as data (bounded YAML, nothing imported): SandboxFusion's code tool
(`verl.tools.sandbox_fusion_tools.SandboxFusionTool`) becomes `builtin:python` on the sandbox_fusion backend
with the file's URL and limits; every other tool is listed as not carried, with why (a verl tool is a
BaseTool class with async create / execute / release, which postrl does not call; postrl's tools are
functions, `package.module:function`, docs/agents.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from postrl.guides.reading import TooLarge, safe_load_bounded
from postrl.guides.rules import Conversion, Mapped, Unmapped

KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
MAX_BYTES = 1 << 20  # a tool config is a few hundred bytes

_VERL_TOOL = (
    "verl's own {name}: postrl has no counterpart; postrl's tools are builtin:python, builtin:calculator or your "
    "package.module:function (rollout.multi_turn.tools, docs/agents.md)"
)
_USER_TOOL = (
    "a verl BaseTool class: calling it would import your code and drive verl's async create / execute / release "
    "lifecycle with verl's request types, which postrl does not have, so it is not carried (the model would call a tool "
    "that is not there). Fix: write its execute step as a function (its type hints and docstring are the schema the "
    "model sees), name it as package.module:function in rollout.multi_turn.tools, and run with --allow-code (docs/agents.md)"
)


def locate(value: str, script_dir: Path | None) -> tuple[Path | None, list[Path]]:
    """(the file, the places looked at): as verl opens it (from the directory it runs in), then beside the script."""
    p = Path(value).expanduser()
    tried = [p] if p.is_absolute() else [Path.cwd() / p] + ([script_dir / p] if script_dir is not None else [])
    return next((t for t in tried if t.is_file()), None), tried


def carry(conv: Conversion, given: dict[str, Any], script_dir: Path | None) -> None:
    """Map the tools of the file `tool_config_path` names (a refusal names the file when it cannot be read)."""
    value = given.get(KEY)
    if value in (None, "", "null", "None"):
        return
    where = f"line {conv.lines[KEY]}: {KEY}" if KEY in conv.lines else KEY
    path, tried = locate(str(value), script_dir)
    if path is None:
        conv.refused.append(
            f"{where} = {value!r}: the tool config does not exist (looked at {', '.join(map(str, tried))}; verl opens it from "
            "the directory it runs in). Fix: run from that directory, or give the file's absolute path."
        )
        return
    try:
        if path.stat().st_size > MAX_BYTES:
            raise TooLarge(f"it is larger than {MAX_BYTES:,} bytes")
        doc = safe_load_bounded(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TooLarge) as exc:
        conv.refused.append(f"{where}: {path} cannot be read as verl's tool config ({str(exc).splitlines()[0][:200]}). Fix: pass the YAML verl reads.")
        return
    tools = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(tools, list):
        conv.refused.append(f"{where}: {path} holds no list `tools` of {{class_name, config, tool_schema}}, as verl's tool config does. Fix: pass that file.")
        return
    targets: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        tool = tool if isinstance(tool, dict) else {}
        name = str(tool.get("class_name", ""))
        config = tool.get("config") if isinstance(tool.get("config"), dict) else {}
        source = f"{path} tools[{i}] {name or '(no class_name)'}"
        if name == SANDBOX_FUSION:
            sandbox, why = _sandbox_fusion(config)
            if why:
                conv.unmapped.append(Unmapped(source, config, why))
                continue
            targets.setdefault("rollout.multi_turn.tools", []).append("builtin:python")
            targets.update(sandbox)
        elif str(config.get("type", "native")) != "native":
            conv.unmapped.append(Unmapped(source, name, f"a {config.get('type')} tool (verl's MCP client): postrl calls no MCP servers"))
        elif name.startswith("verl."):
            conv.unmapped.append(Unmapped(source, name, _VERL_TOOL.format(name=name.rsplit(".", 1)[-1])))
        else:
            conv.unmapped.append(Unmapped(source, name, _USER_TOOL))
    conv.unmapped = [u for u in conv.unmapped if u.source != KEY]
    note = f"read from {path}: SandboxFusion's code tool is builtin:python on the sandbox_fusion backend (the model calls it `python`)"
    conv.mapped.append(Mapped(KEY, value, targets, note if targets else f"read from {path}: no tool postrl carries (listed below)"))
    if not targets and str(given.get("actor_rollout_ref.rollout.multi_turn.enable", "")).lower() == "true":
        conv.refused.append(
            f"{where}: multi_turn.enable is true and {path} names no tool postrl carries ({', '.join(str(t.get('class_name')) for t in tools if isinstance(t, dict)) or 'none'}), "
            "so the model would have no tool to call. Fix: name postrl tools with rollout.multi_turn.tools=[builtin:python] "
            "or your package.module:function (docs/agents.md)."
        )


def _sandbox_fusion(config: dict) -> tuple[dict[str, Any], str | None]:
    """(postrl's sandbox settings, None) for SandboxFusionTool's config, or ({}, why it is not carried)."""
    url = str(config.get("sandbox_fusion_url") or "")
    if not url.startswith(("http://", "https://")):
        return {}, f"sandbox_fusion_url {url!r} is not an http(s) URL of a SandboxFusion service"
    language = str(config.get("default_language", "python"))
    if language != "python":
        return {}, f"default_language {language!r}: postrl's builtin:python runs Python only"
    base = url.rstrip("/").removesuffix("/run_code")  # verl names the endpoint; postrl the service (it POSTs <url>/run_code)
    out: dict[str, Any] = {"rollout.multi_turn.sandbox.backend": "sandbox_fusion", "rollout.multi_turn.sandbox.url": base}
    if isinstance(config.get("memory_limit_mb"), int):
        out["rollout.multi_turn.sandbox.memory_mb"] = config["memory_limit_mb"]
    if isinstance(config.get("default_timeout"), (int, float)):
        out["rollout.multi_turn.tool_timeout_s"] = float(config["default_timeout"])
    if config.get("enable_global_rate_limit") and isinstance(config.get("rate_limit"), int):
        out["rollout.multi_turn.sandbox.concurrency"] = config["rate_limit"]
    return out, None
