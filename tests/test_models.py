"""Tiny-model factory, log-probs and the HF rollout engine."""

from __future__ import annotations

import json
import re

import pytest
import torch

from postrl.builtin.arithmetic import generate_splits
from postrl.builtin.tiny import build_tiny_model
from postrl.models import build_sequences, load_model, load_tokenizer, response_logprobs
from postrl.rollout import SamplingParams
from postrl.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    model = load_model(tiny_model_path)
    return model, tok


def test_tiny_factory_is_deterministic_from_its_seed(tmp_path):
    a = build_tiny_model(out_dir=tmp_path / "a", hidden_size=32, num_layers=1, intermediate_size=64, seed=7)
    b = build_tiny_model(out_dir=tmp_path / "b", hidden_size=32, num_layers=1, intermediate_size=64, seed=7)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    ma, mb = load_model(str(a)), load_model(str(b))
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["hidden_size"] == 32
    # cached: a second call with the same spec returns the same directory without rebuilding
    assert build_tiny_model(out_dir=tmp_path / "a", hidden_size=32, num_layers=1, intermediate_size=64, seed=7) == a


def test_tokenizer_splits_digits_and_has_a_chat_template(tiny):
    _, tok = tiny
    ids = tok("1234")["input_ids"]
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_builtin_task_splits_are_disjoint_and_deterministic():
    a = generate_splits(300, 50, max_value=20, seed=3)
    b = generate_splits(300, 50, max_value=20, seed=3)
    assert a == b
    sig = lambda r: r["prompt"][0]["content"].split("How")[0]  # noqa: E731
    # no validation problem text in training (signatures are disjoint, so texts are too)
    assert not {sig(r) for r in a["val"]} & {sig(r) for r in a["train"]}
    row = a["train"][0]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["solution"].split("\\boxed{")[1].rstrip("}")


def test_mixed_teacher_styles_change_only_training_solutions():
    """terse_ratio / hasty_ratio rewrite reference solutions of training rows, never prompts or answers."""
    plain = generate_splits(2000, 50, max_value=9, min_operands=3, max_operands=4, seed=3)
    mixed = generate_splits(2000, 50, max_value=9, min_operands=3, max_operands=4, terse_ratio=0.6, hasty_ratio=0.5, seed=3)
    assert mixed["val"] == plain["val"]
    styles = {"worked": 0, "terse": 0, "hasty": 0}
    for row in mixed["train"]:
        solution, answer = row["extra_info"]["solution"], row["reward_model"]["ground_truth"]
        boxed = solution.split("\\boxed{")[1].rstrip("}")
        if not solution.startswith("\\boxed"):
            styles["worked"] += 1
            assert boxed == answer
        elif boxed == answer:
            styles["terse"] += 1
        else:  # the hasty answer is the running total before the last step
            styles["hasty"] += 1
            numbers = [int(x) for x in re.findall(r"\d+", row["prompt"][0]["content"])]
            assert int(boxed) != int(answer) and abs(int(answer) - int(boxed)) == numbers[-1]
    n = len(mixed["train"])
    assert abs(styles["worked"] / n - 0.4) < 0.04
    assert abs(styles["hasty"] / n - 0.3) < 0.04 and abs(styles["terse"] / n - 0.3) < 0.04


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_match_a_full_forward(tiny, temperature):
    model, tok = tiny
    prompts = [[1, 20, 21, 22], [1, 30, 31]]
    responses = [[40, 41, 42, 2], [50]]
    t = build_sequences(prompts, responses, tok.pad_token_id)
    T = t["response_mask"].shape[1]
    logp, ent = response_logprobs(model, t["input_ids"], t["attention_mask"], t["position_ids"], T, temperature, with_entropy=True)
    # reference: each sequence alone, no padding, full logits
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(r) - 1] / temperature
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(logp[i, : len(r)], ref, atol=1e-5), (logp[i], ref)
    assert logp.shape == (2, 4) and ent.shape == (2, 4)
    assert t["response_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]


def _groups(vocab: int, seed: int = 0):
    """Prompts repeated per group (GRPO), of various lengths, with responses of 0 to 7 tokens."""
    import random

    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(4):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        for _ in range(rng.randint(1, 4)):
            prompts.append(p)
            responses.append([rng.randrange(3, vocab) for _ in range(rng.randint(0, 7))])
    responses[0] = responses[0] or [5]
    return prompts, responses


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("row_tokens", [4096, 1])  # 1: rows as long as the longest sequence, groups split
def test_packed_logprobs_equal_padded(tiny_model_path, attn, shared, row_tokens, monkeypatch):
    """train.use_remove_padding: log-probs, entropies and gradients equal the padded pass within 1e-5 (fp32)."""
    import postrl.models

    monkeypatch.setattr(postrl.models, "PACK_ROW_TOKENS", row_tokens)
    model = load_model(tiny_model_path)
    model.config._attn_implementation = attn
    prompts, responses = _groups(model.config.vocab_size)
    if not shared:  # every prompt different: one sequence per unit
        prompts = [p + [3 + i] for i, p in enumerate(prompts)]
    t = build_sequences(prompts, responses, 0)
    T, mask = t["response_mask"].shape[1], t["response_mask"].bool()
    slots = []
    model.register_forward_pre_hook(lambda m, a, kw: slots.append(kw["input_ids"].numel()), with_kwargs=True)
    results = []
    for remove_padding in (False, True):
        model.zero_grad()
        logp, ent = response_logprobs(
            model, t["input_ids"], t["attention_mask"], t["position_ids"], T, 0.7,
            with_entropy=True, remove_padding=remove_padding, chunk_tokens=5,
        )  # fmt: skip
        ((logp * mask).sum() + (ent * mask).sum()).backward()
        results.append((logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = results
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    unique_prompts = sum(len(p) for i, p in enumerate(prompts) if i == 0 or p != prompts[i - 1])
    expected = unique_prompts + sum(len(r) for r in responses) if shared else tokens
    assert slots[0] == t["input_ids"].numel() and expected <= slots[1] < slots[0]  # each prompt computed once
    assert (logp_a - logp_b)[mask].abs().max() < 1e-5
    assert (ent_a - ent_b)[mask].abs().max() < 1e-5
    assert logp_b[~mask].abs().max() == 0 and ent_b[~mask].abs().max() == 0
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)


def test_flash_attention_layout_gives_the_padded_logprobs(tiny_model_path, monkeypatch):
    """The flash-attention packing (one row, no padding, no mask, position ids restarting per sequence),
    checked on CPU: with no mask, transformers' sdpa path finds the sequences from the same position ids
    (`masking_utils.find_packed_sequence_indices`) that the flash kernels turn into varlen boundaries, so
    the row layout and the log-prob gather are those a GPU run with flash_attention_2 uses."""
    import postrl.models

    monkeypatch.setattr(postrl.models, "_varlen_attention", lambda attn: True)
    model = load_model(tiny_model_path)
    model.config._attn_implementation = "sdpa"
    prompts, responses = _groups(model.config.vocab_size, seed=1)
    t = build_sequences(prompts, responses, 0)
    T, mask = t["response_mask"].shape[1], t["response_mask"].bool()
    shapes = []
    model.register_forward_pre_hook(lambda m, a, kw: shapes.append((tuple(kw["input_ids"].shape), kw["attention_mask"])), with_kwargs=True)
    logp, ent = {}, {}
    for remove_padding in (False, True):
        logp[remove_padding], ent[remove_padding] = response_logprobs(
            model, t["input_ids"], t["attention_mask"], t["position_ids"], T, 0.7,
            with_entropy=True, remove_padding=remove_padding,
        )  # fmt: skip
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    assert shapes[1] == ((1, tokens), None)  # every sequence whole, in one row: no shared prompt, no mask
    assert (logp[False] - logp[True])[mask].abs().max() < 1e-5
    assert (ent[False] - ent[True])[mask].abs().max() < 1e-5


def test_varlen_attention_names():
    """Every flash flavour transformers accepts packs by position ids; sdpa, eager and flex do not."""
    from postrl.models import _varlen_attention

    assert [_varlen_attention(a) for a in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3")] == [True] * 3
    assert [_varlen_attention(a) for a in ("sdpa", "eager", "flex_attention")] == [False] * 3


def test_attention_implementation_auto_picks_flash_only_on_cuda_with_flash_attn(monkeypatch):
    """model.attn_implementation: auto is flash_attention_2 for bf16 compute on CUDA where flash-attn
    imports, else sdpa; a named implementation is taken as written."""
    import importlib.util

    from postrl.models import attention_implementation

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert [attention_implementation("auto", d, "bfloat16") for d in (cpu, cuda)] == ["sdpa", "sdpa"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    assert [attention_implementation("auto", d, "bfloat16") for d in (cpu, cuda)] == ["sdpa", "flash_attention_2"]
    assert attention_implementation("auto", cuda, "float32") == "sdpa"
    assert attention_implementation("eager", cuda, "bfloat16") == "eager"


def test_the_configured_attention_loads_and_a_missing_kernel_is_a_user_error():
    import importlib.util

    from postrl.config import ModelConfig
    from postrl.errors import UserError
    from postrl.models import load_policy

    assert load_policy(ModelConfig(path="builtin:tiny-qwen2")).model.config._attn_implementation == "sdpa"
    assert load_policy(ModelConfig(path="builtin:tiny-qwen2", attn_implementation="eager")).model.config._attn_implementation == "eager"
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here: nothing is missing")
    with pytest.raises(UserError, match=r"model.attn_implementation 'flash_attention_2' cannot be used.*pip install flash-attn.*auto"):
        load_policy(ModelConfig(path="builtin:tiny-qwen2", attn_implementation="flash_attention_2"))


def test_pack_sequences_first_fit_decreasing():
    """Packing plan: whole units, longest first, each into the first row with room."""
    from postrl.partition import pack_sequences

    # units of 9, 5, 4, 3 tokens into rows of 10: [9], [5, 4], [3] -> widths 9, 9, 3
    row_of, offset_of, shape = pack_sequences([5, 9, 3, 4], 10)
    assert (row_of, offset_of, shape) == ([1, 0, 2, 1], [0, 0, 0, 5], (3, 9))
    assert pack_sequences([5, 9, 3], None) == ([0, 0, 0], [9, 0, 14], (1, 17))


def test_share_prompts_units_and_capacity():
    """Samples of one prompt share it while the unit fits: prompt 4 + responses 3, 2, 5 with capacity 10."""
    from postrl.partition import share_prompts

    same, plens, rlens = [False, True, True, False], [4, 4, 4, 6], [3, 2, 5, 1]
    # no limit: units (4+3+2+5) and (6+1)
    assert share_prompts(same, plens, rlens) == ([True, False, False, True], [14, 7])
    # capacity 10: 4+3+2 = 9 fits, +5 would be 14 -> the third sample starts a unit with its own prompt copy
    assert share_prompts(same, plens, rlens, 10) == ([True, False, True, True], [9, 9, 7])


def test_hf_engine_groups_seeds_and_eos(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok)
    prompts = [[1, 20, 21], [1, 30, 31, 32, 33]]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11)
    out = engine.generate(prompts, params)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    again = engine.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in again]
    other = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=12))
    assert [c.token_ids for c in out] != [c.token_ids for c in other]
    for c in out:
        assert c.finished == (c.token_ids[-1] == tok.eos_token_id)
        assert len(c.token_ids) <= 6 and (c.finished or len(c.token_ids) == 6)
        assert tok.eos_token_id not in c.token_ids[:-1]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    assert len(greedy) == 2
    # greedy = argmax of the model at every step
    ids = torch.tensor([prompts[0] + greedy[0].token_ids])
    logits = model(input_ids=ids).logits[0, len(prompts[0]) - 1 : -1]
    assert logits.argmax(-1).tolist()[: len(greedy[0].token_ids)] == greedy[0].token_ids
