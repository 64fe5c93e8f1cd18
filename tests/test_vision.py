"""Vision-language RL on the tiny Qwen2.5-VL: image prompts, mRoPE log-probs, rollout, training, bad rows."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from postrl.builtin.shapes import generate_splits, render
from postrl.builtin.tiny import build_tiny_model
from postrl.checks import load_config
from postrl.config import ModelConfig
from postrl.data.dataset import load_prompts
from postrl.errors import UserError
from postrl.modality import TEXT
from postrl.modality.qwen_vl import QwenVL, vision_tower
from postrl.models import build_sequences, load_policy, response_logprobs
from postrl.rollout.base import SamplingParams
from postrl.rollout.hf import HFEngine

DATA = SimpleNamespace(image_key="images", min_pixels=None, max_pixels=None)


@pytest.fixture(scope="module")
def vlm():
    policy = load_policy(ModelConfig(path="builtin:tiny-qwen2.5-vl"))
    mod = policy.modality
    rows = generate_splits(6, 2, seed=7)["train"]
    encoded = [mod.encode_prompt(policy.tokenizer, r["prompt"], r["images"], DATA) for r in rows]
    return SimpleNamespace(model=policy.model, tok=policy.tokenizer, mod=mod, path=policy.path, rows=rows, encoded=encoded)


def _png(size=(40, 30), color=(200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _vl_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "model.path=builtin:tiny-qwen2.5-vl",
        "data.train_files=[builtin:shapes:train]",
        "data.val_files=[builtin:shapes:val]",
        "data.shapes.train_size=64",
        "data.shapes.val_size=8",
        "rollout.engine=hf",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_tokens=8",
        "train.global_batch_size=4",
        "train.micro_batch_size=8",
        "train.total_steps=2",
        "train.lr=1e-2",
        "eval.before_train=false",
        "eval.after_train=false",
        "logging.progress=false",
        f"logging.dir={tmp_path / 'run'}",
        "checkpoint.save_final=true",
        *extra,
    ]


# ------------------------------------------------------------------------------------------ data
def test_shapes_task_is_deterministic_disjoint_and_answerable():
    a = generate_splits(40, 20, seed=3)
    b = generate_splits(40, 20, seed=3)
    assert a["train"][5]["images"][0]["bytes"] == b["train"][5]["images"][0]["bytes"]
    train = {(r["prompt"][0]["content"], r["images"][0]["bytes"]) for r in a["train"]}
    assert not train & {(r["prompt"][0]["content"], r["images"][0]["bytes"]) for r in a["val"]}
    from PIL import Image

    for r in a["train"][:10]:
        assert r["prompt"][0]["content"].startswith("<image>Count the shapes, ")
        assert Image.open(io.BytesIO(r["images"][0]["bytes"])).size == (56, 56)
        assert r["extra_info"]["solution"].endswith(f"\\boxed{{{r['reward_model']['ground_truth']}}}")
    import random

    # a picture of two red shapes is mostly red where they are drawn
    png = render([(0, "red", "square"), (5, "red", "circle")], 56, random.Random(0))
    im = Image.open(io.BytesIO(png))
    assert im.getpixel((7, 7))[0] > 150 and im.getpixel((7, 7))[2] < 100 and im.getpixel((50, 50)) == (255, 255, 255)


def test_terse_and_hasty_ratios_change_only_the_reference_solutions_of_training_rows():
    plain, mixed = generate_splits(300, 50, seed=3), generate_splits(300, 50, seed=3, terse_ratio=0.6, hasty_ratio=0.5)
    for split in ("train", "val"):
        for a, b in zip(plain[split], mixed[split]):
            assert (a["prompt"], a["images"], a["reward_model"]) == (b["prompt"], b["images"], b["reward_model"])
    assert plain["val"] == mixed["val"]
    assert not any(r["extra_info"]["solution"].startswith("\\") for r in plain["train"])
    styles = {"worked": 0, "terse": 0, "hasty": 0}
    for r in mixed["train"]:
        sol, answer = r["extra_info"]["solution"], int(r["reward_model"]["ground_truth"])
        if not sol.startswith("\\"):
            styles["worked"] += 1
            assert sol.endswith(f"\\boxed{{{answer}}}")
            continue
        boxed = int(sol[len("\\boxed{") : -1])
        styles["terse" if boxed == answer else "hasty"] += 1
        if boxed != answer:  # the total before the last step: the question's last number undone
            last = r["prompt"][0]["content"].rstrip(".").split()
            assert boxed == answer - int(last[-1]) * (-1 if last[-2] == "away" else 1)
    assert 0.3 < styles["worked"] / 300 < 0.5 and 0.2 < styles["hasty"] / 300 < 0.4, styles


def test_tiny_vlm_loads_with_its_image_processor_and_a_frozen_vision_tower(vlm):
    assert isinstance(vlm.mod, QwenVL) and vlm.mod.image_processor is not None
    assert (Path(vlm.path) / "preprocessor_config.json").is_file()
    tower = vision_tower(vlm.model)
    assert tower is not None and not any(p.requires_grad for p in tower.parameters())
    assert all(p.requires_grad for n, p in vlm.model.named_parameters() if ".visual." not in n)
    unfrozen = load_policy(ModelConfig(path=vlm.path, freeze_vision_tower=False)).model
    assert all(p.requires_grad for p in unfrozen.parameters())
    # a text model gets the text adapter, chosen once from its config
    assert load_policy(ModelConfig(path="builtin:tiny-qwen2")).modality is TEXT


def test_image_prompts_expand_placeholders_and_resize_within_pixel_bounds(vlm):
    tok, image_token_id = vlm.tok, vlm.mod.image_token_id
    ids, mm = vlm.encoded[0]
    # rows carry plain data (the adapter holds the processor): cheap to gather across ranks
    assert set(mm) == {"images", "image_grid_thw"} and len(pickle.dumps(mm)) < 20_000
    # 56x56 -> 4x4 patches of 14 -> 4 image tokens after the 2x2 merge, between vision start/end
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ids.count(image_token_id) == 4
    assert "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Count the shapes" in tok.decode(ids)
    # two images, one wide: each resized to multiples of 28 within [min_pixels, max_pixels]
    prompt = [{"role": "user", "content": "<image>Left. <image>Right. Same colour?"}]
    bounds = SimpleNamespace(image_key="images", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 8)
    ids, mm = vlm.mod.encode_prompt(tok, prompt, [_png((300, 60)), {"bytes": _png((20, 20)), "path": None}], bounds)
    grids = mm["image_grid_thw"].tolist()
    for im, (_, gh, gw) in zip(mm["images"], grids):
        w, h = im.size
        assert w % 28 == 0 and h % 28 == 0 and (gh, gw) == (h // 14, w // 14)
        assert 28 * 28 * 4 <= w * h <= 28 * 28 * 8
    assert grids[0][2] > grids[0][1]  # the wide image stays wide
    assert ids.count(image_token_id) == sum(g * h * w // 4 for g, h, w in grids)
    text = tok.decode(ids)
    assert text.index("Left.") < text.index("Right.") and text.count("<|vision_start|>") == 2


def test_log_probs_use_mrope_and_match_generation_under_left_padding(vlm):
    """Batched (left-padded, mixed with a text-only prompt) == one at a time == generate's own logits."""
    model, tok, mod = vlm.model, vlm.tok, vlm.mod
    text_ids = tok.apply_chat_template([{"role": "user", "content": "How many now?"}], add_generation_prompt=True, return_dict=False)
    prompts = [e[0] for e in vlm.encoded[:3]] + [list(text_ids)]
    mms = [e[1] for e in vlm.encoded[:3]] + [None]
    comps = HFEngine(model, tok, modality=mod).generate(prompts, SamplingParams(max_tokens=8, n=2, seed=3), multi_modal=mms)
    assert len(comps) == 8 and [c.prompt_index for c in comps] == [0, 0, 1, 1, 2, 2, 3, 3]
    P = [prompts[c.prompt_index] for c in comps]
    R = [c.token_ids for c in comps]
    M = [mms[c.prompt_index] for c in comps]
    t = build_sequences(P, R, tok.pad_token_id)
    T = t["response_mask"].shape[1]
    with torch.no_grad():
        batched, _ = response_logprobs(model, t["input_ids"], t["attention_mask"], t["position_ids"], T, multi_modal=M,
                                       modality=mod)  # fmt: skip
        for i in range(len(P)):
            s = build_sequences([P[i]], [R[i]], tok.pad_token_id)
            alone, _ = response_logprobs(model, s["input_ids"], s["attention_mask"], s["position_ids"], len(R[i]),
                                         multi_modal=[M[i]], modality=mod)  # fmt: skip
            assert torch.allclose(alone[0], batched[i, : len(R[i])], atol=1e-5)
        # generate's own logits (greedy) for the first prompt
        from transformers import GenerationConfig

        ids = torch.tensor([prompts[0]])
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=6, output_logits=True, return_dict_in_generate=True,
                                   eos_token_id=None, pad_token_id=tok.pad_token_id)  # fmt: skip
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg,
                             **mod.forward_kwargs(model, ids, [mms[0]]))  # fmt: skip
        resp = out.sequences[0, ids.shape[1] :].tolist()
        from_gen = torch.stack([torch.log_softmax(lg[0].float(), -1)[k] for lg, k in zip(out.logits, resp)])
        s = build_sequences([prompts[0]], [resp], tok.pad_token_id)
        ours, _ = response_logprobs(model, s["input_ids"], s["attention_mask"], s["position_ids"], len(resp), multi_modal=[mms[0]],
                                    modality=mod)  # fmt: skip
        assert torch.allclose(ours[0], from_gen, atol=1e-5)
        # mRoPE is live: the text path's 1-D positions would give other numbers
        flat = model(input_ids=s["input_ids"], attention_mask=s["attention_mask"], position_ids=s["position_ids"],
                     **mod.forward_kwargs(model, s["input_ids"], [mms[0]])).logits  # fmt: skip
        flat_lp = torch.log_softmax(flat[0, -len(resp) - 1 : -1].float(), -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        assert (flat_lp - ours[0]).abs().max() > 1e-4


def test_rollout_never_samples_image_placeholders(vlm):
    engine = HFEngine(vlm.model, vlm.tok, modality=vlm.mod)
    media = {vlm.tok.convert_tokens_to_ids("<|image_pad|>"), vlm.tok.convert_tokens_to_ids("<|video_pad|>")}
    assert set(engine.suppress_ids) == media
    prompts, mms = [e[0] for e in vlm.encoded], [e[1] for e in vlm.encoded]
    comps = engine.generate(prompts, SamplingParams(temperature=2.0, max_tokens=16, n=4, seed=0), multi_modal=mms)
    assert not any(media & set(c.token_ids) for c in comps)


def test_malformed_image_rows_are_named_or_skipped_and_counted(tmp_path, vlm):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "ok.png").write_bytes(_png())
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    row = lambda prompt, images: {"prompt": user(prompt), "images": images, "reward_model": {"ground_truth": "1"}}  # noqa: E731
    rows = [
        row("<image>How many?", [{"bytes": None, "path": "img/ok.png"}]),  # relative to the parquet file: fine
        row("<image>How many?", [{"bytes": None, "path": "img/missing.png"}]),
        row("<image>How many?", [{"bytes": b"\x89PNG\r\n\x1a\n not really", "path": None}]),
        row("<image><image>Compare.", [{"bytes": _png(), "path": None}]),
        row("<image>Where is the picture?", []),
        row("Text only, fine.", []),
    ]
    path = tmp_path / "vl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = load_config(None, ["model.path=m", f"data.train_files=[{path}]"], check_paths=False)
    problems = {1: "cannot read 'img/missing.png'", 2: "cannot be decoded", 3: "2 '<image>' placeholder(s) but the row has 1 image(s)",
                4: "1 '<image>' placeholder(s) but the row has 0 image(s)"}  # fmt: skip
    for bad, msg in problems.items():
        keep = [r for i, r in enumerate(rows) if i not in problems or i == bad]
        pq.write_table(pa.Table.from_pylist(keep), path)
        with pytest.raises(UserError) as info:
            load_prompts([str(path)], vlm.tok, cfg.data, modality=vlm.mod)
        text = str(info.value)
        assert f"{path}, row 1: " in text and msg in text and "skip_bad_rows" in text, text
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = load_config(None, ["model.path=m", f"data.train_files=[{path}]", "data.skip_bad_rows=true"], check_paths=False)
    examples, summary = load_prompts([str(path)], vlm.tok, cfg.data, modality=vlm.mod)
    assert summary == {"rows": 6, "dropped_overlong": 0, "dropped_bad": 4, "kept": 2}
    assert examples[0].multi_modal is not None and examples[1].multi_modal is None
    assert "images" not in examples[0].row  # verifiers are not sent image bytes


def test_a_text_model_refuses_image_rows_with_a_fix(tmp_path):
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "data.train_files=[builtin:shapes:val]", "data.shapes.val_size=4"])
    policy = load_policy(cfg.model)
    with pytest.raises(UserError, match="the model is text-only"):
        load_prompts(cfg.data.train_files, policy.tokenizer, cfg.data, modality=policy.modality)


def test_vllm_engine_refuses_vlms_here_with_the_reason_and_auto_falls_back(vlm):
    from postrl.config import RolloutConfig
    from postrl.rollout import make_engine

    reason = vlm.mod.vllm_blocker()
    if reason is None:
        pytest.skip("torchvision is installed: vLLM's Qwen-VL code can import")
    assert "torchvision" in reason and "rollout.engine: hf" in reason
    said: list[str] = []
    engine = make_engine(RolloutConfig(engine="auto"), vlm.model, vlm.tok, log=said.append, modality=vlm.mod)
    assert isinstance(engine, HFEngine) and "torchvision" in said[0]
    with pytest.raises(UserError, match="torchvision"):
        make_engine(RolloutConfig(engine="vllm"), vlm.model, vlm.tok, modality=vlm.mod)


# ---------------------------------------------------------------------------------------- training
def test_dapo_on_images_trains_the_language_model_and_not_the_frozen_vision_tower(tmp_path):
    from postrl.trainer import Trainer

    cfg = load_config(
        None,
        _vl_overrides(
            tmp_path, "algorithm.name=dapo", "algorithm.overlong_buffer.len=4", "train.gen_batch_size=6",
            "reward.verifiers=[verifiers_for_tests:length_parity]", "model.gradient_checkpointing=true",
        ),
    )  # fmt: skip
    tr = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    metrics = tr.fit()
    assert metrics["actor/grad_norm"] > 0
    after = dict(tr.model.named_parameters())
    lm = [n for n in before if ".visual." not in n]
    vision = [n for n in before if ".visual." in n]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    changed = [n for n in lm if not torch.equal(before[n], after[n])]
    assert len(changed) == len(lm), set(lm) - set(changed)
    # the checkpoint reloads as a VLM with its image processor
    ckpt = next((tmp_path / "run" / "checkpoints").glob("iter_*")) / "model"
    assert (ckpt / "preprocessor_config.json").is_file()
    policy = load_policy(ModelConfig(path=str(ckpt)))
    assert isinstance(policy.modality, QwenVL) and vision_tower(policy.model) is not None


def test_grpo_with_kl_and_ppo_epochs_on_images_runs_old_and_ref_passes(tmp_path):
    from postrl.trainer import train

    cfg = load_config(
        None,
        _vl_overrides(
            tmp_path, "algorithm.kl.coef=0.1", "train.epochs_per_batch=2", "train.mini_batch_size=2",
            "train.total_steps=1", "reward.verifiers=[verifiers_for_tests:length_parity]", "checkpoint.save_final=false",
        ),
    )  # fmt: skip
    metrics = train(cfg)
    assert metrics["timing/old_log_p"] > 0 and metrics["timing/reference_model"] > 0
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/ppo_kl"] != 0


def test_sft_on_images_trains_the_unfrozen_vision_tower_and_saves_the_processor(tmp_path):
    from postrl.sft import run_sft

    cfg = load_config(
        None,
        [
            "model.path=builtin:tiny-qwen2.5-vl", "model.freeze_vision_tower=false", "data.train_files=[builtin:shapes:train]",
            "data.val_files=[builtin:shapes:val]", "data.shapes.train_size=32", "data.shapes.val_size=4", "sft.steps=2",
            "sft.batch_size=8", "sft.warmup_steps=0", "sft.lr=1e-2", f"sft.output_dir={tmp_path / 'sft'}", "sft.eval_prompts=4",
            "rollout.max_tokens=4", "logging.progress=false",
        ],
    )  # fmt: skip
    start = load_policy(cfg.model).model
    result = run_sft(cfg)
    assert "val/shapes/acc_mean@1" in result
    out = tmp_path / "sft" / "model"
    policy = load_policy(ModelConfig(path=str(out), freeze_vision_tower=False))
    assert isinstance(policy.modality, QwenVL)
    trained, initial = vision_tower(policy.model).state_dict(), vision_tower(start).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)


# ---------------------------------------------------------------------------------------- families
def _family_dir(family: str, out: Path) -> Path:
    """A random tiny Qwen2-VL / Qwen3-VL / Qwen3-VL-MoE directory with the built-in tokenizer."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2.5-vl"))
    ids = {k: tok.convert_tokens_to_ids(f"<|{v}|>") for k, v in
           dict(image_token_id="image_pad", video_token_id="video_pad", vision_start_token_id="vision_start",
                vision_end_token_id="vision_end").items()}  # fmt: skip
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}
    qwen3_vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, out_hidden_size=64,
                        num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
    if family == "qwen2_vl":
        patch, cls = 14, transformers.Qwen2VLForConditionalGeneration
        cfg = transformers.Qwen2VLConfig(text_config={**text, "rope_parameters": rope}, tie_word_embeddings=True, **ids,
                                         vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2))  # fmt: skip
    elif family == "qwen3_vl":
        patch, cls = 16, transformers.Qwen3VLForConditionalGeneration
        text3 = {**text, "head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}}
        cfg = transformers.Qwen3VLConfig(text_config=text3, vision_config=qwen3_vision, tie_word_embeddings=True, **ids)
    else:
        patch, cls = 16, transformers.Qwen3VLMoeForConditionalGeneration
        text3 = {**text, "head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}, "num_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}  # fmt: skip
        cfg = transformers.Qwen3VLMoeConfig(text_config=text3, vision_config=qwen3_vision, tie_word_embeddings=True, **ids)
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    cls(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=(2 * patch) ** 2 * 4, max_pixels=(2 * patch) ** 2 * 16).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_other_qwen_vl_families_load_roll_out_and_score(family, tmp_path, vlm):
    path = _family_dir(family, tmp_path / family)
    policy = load_policy(ModelConfig(path=str(path)))
    model, tok, mod = policy.model, policy.tokenizer, policy.modality
    assert isinstance(mod, QwenVL) and not any(p.requires_grad for p in vision_tower(model).parameters())
    rows = vlm.rows[:3]
    enc = [mod.encode_prompt(tok, r["prompt"], r["images"], DATA) for r in rows]
    prompts, mms = [e[0] for e in enc], [e[1] for e in enc]
    comps = HFEngine(model, tok, modality=mod).generate(prompts, SamplingParams(max_tokens=5, n=2, seed=0), multi_modal=mms)
    P, R, M = [prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps], [mms[c.prompt_index] for c in comps]
    t = build_sequences(P, R, tok.pad_token_id)
    with torch.no_grad():
        batched, _ = response_logprobs(model, t["input_ids"], t["attention_mask"], t["position_ids"], t["response_mask"].shape[1],
                                       multi_modal=M, modality=mod)  # fmt: skip
        for i in range(len(P)):
            s = build_sequences([P[i]], [R[i]], tok.pad_token_id)
            alone, _ = response_logprobs(model, s["input_ids"], s["attention_mask"], s["position_ids"], len(R[i]),
                                         multi_modal=[M[i]], modality=mod)  # fmt: skip
            assert torch.allclose(alone[0], batched[i, : len(R[i])], atol=1e-5)


def _within(fn, seconds: float = 30.0):
    """fn() on a thread, joined with a deadline: a read that hangs (a FIFO with no writer) fails the test, not CI."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still reading after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_image_paths_that_are_not_regular_files_under_the_cap_are_named_errors_and_return_at_once(tmp_path, vlm):
    import os

    from postrl.modality.images import MAX_IMAGE_BYTES, BadImageRow, read_image

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "sparse.png", "wb") as f:  # a hole: MAX_IMAGE_BYTES + 1 bytes on disk in a few KiB
        f.truncate(MAX_IMAGE_BYTES + 1)
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "ok.png").write_bytes(_png())
    hostile = {"/dev/zero": "is a device", str(tmp_path / "fifo"): "is a FIFO", str(tmp_path / "dir"): "is a directory",
               str(tmp_path / "sparse.png"): f"more than {MAX_IMAGE_BYTES} bytes", str(tmp_path / "zero"): "is a device",
               "a\0b": "is not a file name"}  # fmt: skip
    for item, why in hostile.items():
        with pytest.raises(BadImageRow) as err:
            _within(lambda: read_image({"bytes": None, "path": item}, "image 0"))
        assert str(err.value).startswith("image 0") and why in str(err.value) and "Fix:" in str(err.value), str(err.value)
    assert _within(lambda: read_image(str(tmp_path / "ok.png"), "image 0"))[0] == _png()
    from PIL import Image

    from postrl.modality.images import MAX_IMAGE_PIXELS, decode_image

    bomb = io.BytesIO()
    Image.new("1", (9000, 9000)).save(bomb, "PNG")  # ~10 KiB of file, 81M pixels: 243 MB as RGB
    with pytest.raises(BadImageRow) as err:
        decode_image(bomb.getvalue(), "image 0")
    assert len(bomb.getvalue()) < 2**20 and f"9000x9000 pixels, over {MAX_IMAGE_PIXELS}" in str(err.value)
    # through the data loader: an error that names the file and the row
    path = tmp_path / "vl.parquet"
    ok = {"prompt": [{"role": "user", "content": "<image>How many?"}], "images": [{"bytes": None, "path": "ok.png"}], "reward_model": {"ground_truth": "1"}}
    cfg = load_config(None, ["model.path=m", f"data.train_files=[{path}]"], check_paths=False)
    for item, why in hostile.items():
        if "\0" in item:
            continue  # parquet keeps it, but one such row is enough above
        pq.write_table(pa.Table.from_pylist([ok, {**ok, "images": [{"bytes": None, "path": item}]}]), path)
        with pytest.raises(UserError) as info:
            _within(lambda: load_prompts([str(path)], vlm.tok, cfg.data, modality=vlm.mod))
        assert f"{path}, row 1: image 0: '{item}' " in str(info.value) and why in str(info.value), str(info.value)
