"""The guides' configurations in postrl's names: verl override lists and MindSpeed-RL YAMLs.

Users of the MindSpeed-RL / verl guides carry settings such as `actor_rollout_ref.rollout.n=16` or
`rl_config.clip_higher_enable: true`. One table per dialect says, for every key the guides use,
which postrl key it becomes (and how its value is translated) or why it has no postrl counterpart
and what postrl offers instead. `postrl convert-config` writes the translated YAML, and `postrl
train` accepts verl-style dotted overrides through the same table (`checks.load_config`).

The engine is convert.py; this package exports its public names. A conversion returns a `Conversion`:
the postrl tree, one `Mapped` record per source key that was translated, and one `Unmapped` record per
key that was not, so that no key is silently lost. The table is documented in docs/guides.md.
"""

from postrl.guides.convert import (
    build_tree,
    code_keys,
    convert_file,
    convert_mindspeed,
    convert_verl,
    flatten,
    inert,
    read_verl_overrides,
    render_yaml,
    same_tree,
    sends_keys,
    split_overrides,
)
from postrl.guides.mindspeed import MINDSPEED, MINDSPEED_PREFIXES
from postrl.guides.rules import Conversion, Mapped, Unmapped
from postrl.guides.verl import VERL, VERL_PREFIXES

__all__ = [
    "MINDSPEED", "MINDSPEED_PREFIXES", "VERL", "VERL_PREFIXES", "Conversion", "Mapped", "Unmapped", "build_tree",
    "code_keys", "convert_file", "convert_mindspeed", "convert_verl", "flatten", "inert", "read_verl_overrides",
    "render_yaml", "same_tree", "sends_keys", "split_overrides",
]  # fmt: skip
