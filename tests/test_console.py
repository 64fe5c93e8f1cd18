"""The quiet console (postrl.console): third-party chatter to <logging.dir>/postrl.log, postrl's own
warnings and anyone's errors still on the terminal."""

from __future__ import annotations

import logging
import os
import warnings
from types import SimpleNamespace

import pytest

from postrl.console import quiet_console


@pytest.fixture
def restore_logging():
    """The logging, warnings and environment state quiet_console changes, put back afterwards."""
    from transformers.utils import logging as hf_logging  # imported first: HF reads the environment at import

    env = dict(os.environ)
    for key in ("VLLM_CONFIGURE_LOGGING", "HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        os.environ.pop(key, None)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    os.environ.clear()
    os.environ.update(env)

    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
    logging.captureWarnings(False)
    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()
    hf_logging.enable_progress_bar()


def test_third_party_warnings_go_to_the_log_file_and_postrl_warnings_stay(tmp_path, capsys, restore_logging):
    path = quiet_console(SimpleNamespace(verbose=False, dir=str(tmp_path / "run")))
    assert path == tmp_path / "run" / "postrl.log"
    warnings.warn("a deprecation somebody else should fix", FutureWarning, stacklevel=1)
    logging.getLogger("transformers.modeling_utils").warning("advice from transformers")
    logging.getLogger("vllm.worker").warning("libtcmalloc is not found in LD_PRELOAD")
    logging.getLogger("postrl.rewards").warning("verifier x failed on 3 of 8 completions")
    logging.getLogger("vllm.engine").error("the engine died")
    err = capsys.readouterr().err
    assert err.splitlines() == ["verifier x failed on 3 of 8 completions", "the engine died"]
    logged = path.read_text()
    for line in ("a deprecation somebody else should fix", "advice from transformers", "libtcmalloc", "the engine died"):
        assert line in logged
    assert quiet_console(SimpleNamespace(verbose=False, dir=str(tmp_path / "run"))) == path
    logging.getLogger("vllm.worker").warning("once")
    assert path.read_text().count("once") == 1  # a second call replaces its handlers, it does not add more


def test_verbose_leaves_the_console_alone(tmp_path, restore_logging):
    assert quiet_console(SimpleNamespace(verbose=True, dir=str(tmp_path / "run"))) is None
    assert not (tmp_path / "run").exists()
