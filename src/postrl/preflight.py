"""Preflight: every model directory a run will load, checked from its small files before anything loads.

A model path is checked for what a run needs of it, reading only config.json and the tokenizer files
(never the weights, so well under a second per path):

- it exists (a local-looking path that does not is refused here, instead of being tried as a hub id
  with retries, then blamed on the network);
- its kind, from config.json `architectures`: a causal LM (a vision-language model counts as one) where
  the run generates or scores tokens (policy, reference, judge, teacher), a one-label sequence classifier
  for the reward model; a critic takes any text backbone;
- tokenizer files are present where the role reads its own tokenizer (policy, reward model, judge);
- the tokenizer fits the embeddings: a tokenizer whose ids reach past config.json `vocab_size` would
  index past the embedding table at the first step.

`check_model(path, role, tokenizer_dir)` is the one check; `run_model_problems(cfg)` lists the paths of a
run config and their roles. A new role (e.g. a distillation teacher) is one `Role` and one call.
Hub ids that are not in the local cache are left to the loader (checking them would need the network).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
TRACKER = "latest_checkpointed_iteration.txt"  # postrl.checkpoint.files.TRACKER (that module imports torch)


@dataclass(frozen=True)
class Role:
    """What a run does with a model: its name in messages, its config key, the kind it must be."""

    name: str  # "reward model"
    key: str  # "reward.reward_model.path"
    kind: str  # "causal_lm" | "seq_cls" | "any"
    own_tokenizer: bool  # reads the tokenizer of its own directory (else the policy's)


POLICY = Role("policy", "model.path", "causal_lm", own_tokenizer=True)
REFERENCE = Role("reference model", "checkpoint.ref_model_path", "causal_lm", own_tokenizer=False)
CRITIC = Role("critic", "critic.model_path", "any", own_tokenizer=False)
REWARD_MODEL = Role("reward model", "reward.reward_model.path", "seq_cls", own_tokenizer=True)
JUDGE = Role("judge", "reward.judge.path", "causal_lm", own_tokenizer=True)
TEACHER = Role("teacher", "distill.teacher_path", "causal_lm", own_tokenizer=False)

_FIX = {
    "causal_lm": "a causal LM directory (config.json with a *ForCausalLM or *ForConditionalGeneration architecture)",
    "seq_cls": "a reward model: a sequence classifier with one label (e.g. the output of `postrl rm`)",
    "any": "a text model directory (config.json, weights)",
}


def looks_like_hub_id(path: str) -> bool:
    """'org/name' and nothing else: what the loaders would try on the model hub. 'runs/critic' where a local
    directory runs/ exists is a local path (a missing run output), never tried on the hub."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~")) and not Path(parts[0]).is_dir()


def model_kind(config: dict) -> tuple[str | None, str]:
    """('causal_lm' | 'seq_cls' | 'token_cls' | None, the architecture's name) from config.json."""
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    if arch.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")):
        return "causal_lm", arch
    if arch.endswith("ForSequenceClassification"):
        return "seq_cls", arch
    if arch.endswith("ForTokenClassification"):
        return "token_cls", arch
    return None, arch


def num_labels(config: dict) -> int:
    """Labels of a classifier's config.json (transformers' default: 2)."""
    if "id2label" in config and isinstance(config["id2label"], dict):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def config_vocab_size(config: dict) -> int | None:
    """The embedding rows config.json declares (a VL model's may sit in text_config)."""
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def tokenizer_vocab_size(directory: Path) -> int | None:
    """1 + the largest token id of the tokenizer files in `directory` (None: not readable from them)."""
    ids: list[int] = []
    tj = directory / "tokenizer.json"
    if tj.is_file():
        t = json.loads(tj.read_text())
        vocab = (t.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and vocab:
            ids.append(max(int(v) for v in vocab.values()))
        elif isinstance(vocab, list) and vocab:
            ids.append(len(vocab) - 1)  # unigram: [piece, score] by id
        ids += [int(a["id"]) for a in t.get("added_tokens") or [] if "id" in a]
    elif (directory / "vocab.json").is_file():
        vocab = json.loads((directory / "vocab.json").read_text())
        ids += [int(v) for v in vocab.values()] if isinstance(vocab, dict) else []
    tc = directory / "tokenizer_config.json"
    if ids and tc.is_file():
        ids += [int(k) for k in (json.loads(tc.read_text()).get("added_tokens_decoder") or {}) if str(k).isdigit()]
    return max(ids) + 1 if ids else None


def model_dir(path: str) -> Path | None:
    """The HF model directory of `path` (a postrl checkpoint root or iter_* resolves to its model/), or None
    for a hub id that is not cached here."""
    p = Path(path).expanduser()
    if not p.exists():
        if looks_like_hub_id(path):
            return _cached_hub_dir(path)
        return p  # refused by check_model: does not exist
    if (p / TRACKER).is_file():
        step = (p / TRACKER).read_text().strip()
        if step.isdigit():
            p = p / f"iter_{int(step):07d}"
    if not (p / "config.json").exists() and (p / "model" / "config.json").exists():
        p = p / "model"
    return p


def _cached_hub_dir(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id, an unreadable cache: leave it to the loader
        return None
    return Path(found).parent if isinstance(found, str) else None


def check_model(path: str, role: Role, tokenizer_dir: str | None = None, policy_vocab: int | None = None) -> list[str]:
    """Problems of model `path` for `role`, one paragraph each (what, why, fix); [] when it will load.

    `tokenizer_dir`: where the role's tokenizer lives (default: the model's own directory, for roles that
    read their own; None for the others). `policy_vocab`: the policy tokenizer's size, which a role that
    reads token ids of the policy (reference, critic, teacher) must fit.
    """
    if path.startswith("builtin:") or path.endswith(".gguf"):
        return builtin_or_gguf_problems(path, role.key)
    d = model_dir(path)
    if d is None:
        return []  # a hub id not cached here: the loader downloads it (and says so when it cannot)
    where = f"{role.key}: '{path}'"
    if not d.exists():
        hub = " It is not tried as a model hub id either (a local path: it starts with '/', '.' or '~', has more than two parts, or its first part is a local directory)." if not looks_like_hub_id(path) else ""
        return [f"{where} does not exist; the run loads the {role.name} from it.{hub} Fix: point {role.key} at {_FIX[role.kind]}."]
    if not d.is_dir() or not (d / "config.json").is_file():
        return [
            f"{where} is not a model directory (no config.json); the run loads the {role.name} from it. "
            f"Fix: point {role.key} at {_FIX[role.kind]}."
        ]
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"{where}: its config.json cannot be read ({exc}). Fix: restore the model directory from its source."]
    problems = _kind_problems(where, role, config)
    if problems:
        return problems
    tok = model_dir(tokenizer_dir) if tokenizer_dir else (d if role.own_tokenizer else None)
    vocab = None
    if tokenizer_dir and tok is None:
        return problems  # a tokenizer on the model hub, not cached here: the loader downloads it
    if tok is not None:
        tok_key = "model.tokenizer_path" if role is POLICY and tokenizer_dir else role.key
        if not tok.exists():
            return [f"{tok_key}: '{tok}' does not exist; the {role.name}'s tokenizer is read from it. Fix: correct the path."]
        if not any((tok / f).is_file() for f in TOKENIZER_FILES):
            problems.append(
                f"{tok_key}: '{tok}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); the {role.name}'s "
                "text could not be turned into token ids. Fix: copy the tokenizer files of the model it came from into "
                f"it (tokenizer.json, tokenizer_config.json){', or set model.tokenizer_path to a directory that has them' if role is POLICY else ''}."
            )
            return problems
        vocab = tokenizer_vocab_size(tok)
    elif policy_vocab is not None:
        vocab, tok = policy_vocab, None
    rows = config_vocab_size(config)
    if vocab is not None and rows is not None and vocab > rows:
        whose = f"its tokenizer ('{tok}')" if tok is not None else "the policy's tokenizer"
        problems.append(
            f"{where}: {whose} has {vocab} token ids but the model's embeddings have {rows} rows (config.json vocab_size), "
            f"so a token id from {rows} up would index past the table at the first step. Fix: use the tokenizer the "
            f"{role.name} was trained with, or a model whose vocab_size is at least {vocab}."
        )
    return problems


def builtin_or_gguf_problems(path: str, key: str) -> list[str]:
    """A 'builtin:<name>' that names no built-in model or whose package is not installed; a GGUF file that
    transformers cannot read (postrl.builtin.pretrained), from its header."""
    from postrl.builtin import pretrained, tiny
    from postrl.errors import UserError

    if path.endswith(".gguf"):
        return pretrained.gguf_problems(path, key)
    name = path.split(":", 1)[1]
    if name not in tiny.builtin_names():
        return [tiny.unknown_builtin(name).replace("model.path:", f"{key}:", 1)]
    if name in pretrained.PRETRAINED:
        try:
            pretrained.packaged_file(name)
        except UserError as exc:
            return list(exc.problems)
    return []


def _kind_problems(where: str, role: Role, config: dict) -> list[str]:
    kind, arch = model_kind(config)
    if kind is None or role.kind == "any":
        return []
    if role.kind == "seq_cls" and kind == "causal_lm":
        return [
            f"{where} is a causal LM ({arch}, config.json architectures), not a reward model: loaded as a sequence "
            "classifier it would get a freshly initialised score head, so its scores would be random. Fix: point "
            f"{role.key} at {_FIX['seq_cls']}; a causal LM that grades answers in text goes in reward.judge.path."
        ]
    if role.kind == "seq_cls" and kind == "seq_cls" and num_labels(config) != 1:
        return [
            f"{where} has {num_labels(config)} output labels ({arch}); a reward model has one (its score). Fix: use a "
            "reward model (AutoModelForSequenceClassification with num_labels=1), e.g. one trained by `postrl rm`."
        ]
    if role.kind == "causal_lm" and kind in ("seq_cls", "token_cls"):
        other = " (a reward model scores directly: put it in reward.reward_model.path)" if kind == "seq_cls" else ""
        return [
            f"{where} is a classifier ({arch}, config.json architectures), not a causal LM: the {role.name} writes "
            f"text, and loaded as a causal LM its head would be dropped and a random one used. Fix: point {role.key} "
            f"at {_FIX['causal_lm']}{other}."
        ]
    return []


def run_model_problems(cfg: Any) -> list[str]:
    """Problems of every model path run config `cfg` will load (policy, reference, critic, reward model,
    judge, teacher), each checked for its role."""
    from postrl import algorithms

    m = cfg.model
    tok_dir = m.tokenizer_path or None
    problems = check_model(m.path, POLICY, tok_dir)
    policy_vocab = None
    if not problems and not m.path.startswith("builtin:") and not m.path.endswith(".gguf"):
        d = model_dir(tok_dir or m.path)
        policy_vocab = tokenizer_vocab_size(d) if d is not None and d.is_dir() else None
        problems += sequence_parallel_problems(m.path, cfg.train.sequence_parallel_size)
    a = cfg.algorithm
    if cfg.checkpoint.ref_model_path and (a.kl.coef > 0 or a.use_kl_in_reward):
        problems += check_model(cfg.checkpoint.ref_model_path, REFERENCE, policy_vocab=policy_vocab)
    if cfg.critic.model_path and algorithms.needs_critic(a.adv_estimator):
        problems += check_model(cfg.critic.model_path, CRITIC, policy_vocab=policy_vocab)
    if cfg.reward.reward_model is not None:
        problems += check_model(cfg.reward.reward_model.path, REWARD_MODEL)
    if cfg.reward.judge is not None:
        problems += check_model(cfg.reward.judge.path, JUDGE)
    teacher = cfg.distill.teacher_path
    if isinstance(teacher, str):
        problems += check_model(teacher, TEACHER, policy_vocab=policy_vocab)
    return problems


def sequence_parallel_problems(path: str, size: int) -> list[str]:
    """train.sequence_parallel_size must divide the policy's attention heads (postrl.actor refuses it at start)."""
    d = model_dir(path)
    if size <= 1 or d is None or not (d / "config.json").is_file():
        return []
    config = json.loads((d / "config.json").read_text())
    heads = (config.get("text_config") or config).get("num_attention_heads")
    if isinstance(heads, int) and heads % size:
        return [
            f"train.sequence_parallel_size ({size}) must divide the model's attention heads ({heads}): Ulysses gives each "
            f"rank heads / {size} of them. Fix: choose a divisor of {heads}."
        ]
    return []
