"""Run configuration, by job:

- schema.py: the sections (pydantic models, every field documented and checked alone), `Config`;
- rules.py: the cross-section rules and the derived values, run once by `Config`'s validator;
- loading.py: YAML files, dotted and verl-style overrides, every problem at once as a UserError, the
  checks of this machine (`load_config`, `build_config`, `environment_problems`, ...);
- knobs.py: the built-in tasks' sections (data.builtin, data.shapes, data.tool_arithmetic).

Import the names from here (`from postrl.config import load_config, Config`).
"""

from postrl.config.loading import (
    _is_config_key,
    agent_problems,
    build_config,
    config_notes,
    dump_config,
    environment_problems,
    load_config,
    parse_overrides,
    path_problems,
    read_yaml_mapping,
    sandbox_problems,
)
from postrl.config.rules import derive_total_steps
from postrl.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    CriticConfig,
    DataConfig,
    EvalConfig,
    FilterGroupsConfig,
    GuardsConfig,
    JudgeConfig,
    KLConfig,
    KLControlConfig,
    LoggingConfig,
    ModelConfig,
    MultiTurnConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RMTrainConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SandboxConfig,
    Section,
    SFTConfig,
    TrainConfig,
    VerifierSpec,
)
