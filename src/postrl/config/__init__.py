"""Run configuration, by job:

- schema.py: the sections (pydantic models, every field documented and checked alone), `Config`;
- rules.py: the cross-section rules and the derived values, run once by `Config`'s validator;
- loading.py: YAML files, dotted overrides, every problem at once as a UserError (`read_config`,
  `build_config`);
- knobs.py: the built-in tasks' sections (data.builtin, data.shapes, data.tool_arithmetic).

Import the names from here (`from postrl.config import read_config, Config`). The package reads and
validates a configuration and knows nothing of this machine: what the machine lacks for a run (paths,
models, sink packages, tools, sandbox) is checked above it, in postrl.checks, whose `load_config` is
`read_config` (with the guides' verl-style overrides translated) followed by those checks.
"""

from postrl.config.loading import (
    build_config,
    config_notes,
    dump_config,
    is_config_key,
    parse_overrides,
    read_config,
    read_yaml_mapping,
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
