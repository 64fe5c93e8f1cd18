"""The terminal shows postrl's own lines; third-party chatter goes to the run's log file.

`quiet_console(cfg.logging)` runs once per process, in the command-line entry points, as soon as
the config is known (before torch, transformers or vLLM are imported). Unless `logging.verbose`:

- Python warnings (deprecations, `torch.set_num_threads` advice, ...) and every library logger
  (transformers, vLLM, torch, huggingface_hub) go to `<logging.dir>/postrl.log` (rank r > 0 of a
  multi-process job: `postrl.rank<r>.log`). The terminal keeps records of postrl's own loggers at
  WARNING and above, and anyone's at ERROR and above; exceptions and UserErrors print to the terminal.
- vLLM logs through Python's logging (`VLLM_CONFIGURE_LOGGING=0`) instead of its own stdout handler,
  and transformers' handler gives way to the same file.
- Progress bars of Hugging Face loading and saving ("Loading weights", "Writing model shards") are
  off: between step lines they are noise, and in a log file only carriage returns.
- torch's C++ warnings (e.g. vLLM's "NUMA binding" note) are printed by C++ to stderr, not through
  Python: `TORCH_CPP_LOG_LEVEL=ERROR` keeps them off the terminal (they are dropped, not logged).

A setting the user made in the environment wins over each of these.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

LOG_FILE = "postrl.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_path(log_dir: str | Path) -> Path:
    """This process's log file: postrl.log for rank 0 (or a single process), postrl.rank<r>.log for the others."""
    rank = int(os.environ.get("RANK", "0") or 0)
    return Path(log_dir) / (LOG_FILE if rank == 0 else f"postrl.rank{rank}.log")


def quiet_console(logging_cfg: Any) -> Path | None:
    """Send third-party warnings and logs to the run's log file (its path is returned); nothing when
    `logging.verbose` is on or the directory cannot be created (the run's own check reports that)."""
    if logging_cfg.verbose:
        return None
    path = log_path(logging_cfg.dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    for key, value in (
        ("VLLM_CONFIGURE_LOGGING", "0"),  # vLLM's records propagate to the root logger below
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TORCH_CPP_LOG_LEVEL", "ERROR"),  # read when torch loads: the CLI imports it later
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ):
        os.environ.setdefault(key, value)
    to_file.setFormatter(logging.Formatter(_FORMAT))
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.addFilter(_for_the_terminal)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "postrl_console", False)]:  # a second run in this process
        root.removeHandler(handler)
        handler.close()
    for handler in (to_file, to_terminal):
        handler.postrl_console = True
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # warnings.warn -> the "py.warnings" logger -> the file. Off first: captureWarnings(True) does nothing when
    # it ran before, even if something (pytest, warnings.catch_warnings) has since put showwarning back.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    _route_transformers()
    _route_vllm()
    return path


def _route_vllm() -> None:
    """A vLLM imported before this call configured its own stderr handler and stopped propagating
    (VLLM_CONFIGURE_LOGGING was not yet 0): hand its records to the root logger too."""
    if "vllm" not in logging.root.manager.loggerDict:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in list(vllm_logger.handlers):
        vllm_logger.removeHandler(handler)
    vllm_logger.propagate = True


def _for_the_terminal(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or record.name == "postrl" or record.name.startswith("postrl.")


def _route_transformers() -> None:
    """transformers keeps its own stderr handler and does not propagate: hand its records to the root
    logger, and turn its progress bars off."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
