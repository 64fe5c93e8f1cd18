"""What a rollout process sends the trainer (placement/wire.py, DESIGN.md section 13): bytes parsed into declared
shapes, never unpickled. A Batch with every kind of field round-trips exactly; garbage, a pickle, an oversize
frame, wrong types and deep nesting are refused with a clear error, and a pickle's payload never runs."""

from __future__ import annotations

import math
import os
import pickle
import struct

import pytest
import torch

from postrl.batch import Batch
from postrl.data.dataset import PromptExample
from postrl.placement import wire
from postrl.rollout.base import Completion

VOCAB = 7  # the ids of _batch() all lie below it
EXAMPLES = [PromptExample([1, 2], "3", {}, "x"), PromptExample([1], "4", {}, "x", {"image_grid_thw": torch.tensor([[1, 2, 2]])})]


def _batch() -> Batch:
    seg = Completion(0, [5, 6], True, logprobs=[-0.1, 0.2], loss_mask=[1, 0], turn_spans=[(0, 1)], tool_calls=1, env_reward=0.5,
                     version=2, token_versions=[2, 2], prompt_ids=[1, 2], top_logprobs=[([1, 2], [-0.5, -1.5]), ([3], [0.1])])  # fmt: skip
    return Batch(
        prompt_ids=[[1, 2], [1]], response_ids=[[3, 4], [5]], loss_masks=[[1, 1], [1]], turns=[1, 2], finished=[True, False],
        scores=[1.0, 0.1 + 0.2], rewards=[5e-324, -0.0], verifier_metrics=[{"acc": 1}, {"acc": 5e-324}],
        engine_logprobs=[[-1e-300, 1 / 3], None], multi_modal=[None, EXAMPLES[1].multi_modal], versions=[0, None],
        token_versions=[None, [1]], segments=[[seg], None], owners=[None, 0],
    )  # fmt: skip


def _bits(xs) -> list[bytes]:
    return [struct.pack("d", x) for x in xs]


def test_a_batch_with_every_field_kind_round_trips_exactly():
    b = _batch()
    data = wire.encode_batch(3, b, EXAMPLES, {"a": 0.1 + 0.7, "n": 2, "nan": float("nan")}, {"rollout": 1e-9},
                             {"epoch": 1, "position": 4, "seed": None}, {0: 0.125, 1: 2 / 3})  # fmt: skip
    got = wire.decode(data, len(EXAMPLES), vocab=VOCAB)
    assert isinstance(got, wire.Produced) and got.index == 3
    back = got.batch.to_batch(EXAMPLES)
    assert back.multi_modal[1] is EXAMPLES[1].multi_modal and back.multi_modal[0] is None  # the trainer's own images
    assert _bits(back.scores + back.rewards + back.engine_logprobs[0]) == _bits(b.scores + b.rewards + b.engine_logprobs[0])
    assert back.segments == b.segments and back.verifier_metrics == b.verifier_metrics
    assert type(back.verifier_metrics[0]["acc"]) is int  # ints stay ints
    for name in ("prompt_ids", "response_ids", "loss_masks", "turns", "finished", "versions", "token_versions", "owners"):
        assert getattr(back, name) == getattr(b, name), name
    assert math.isnan(got.stats.pop("nan"))  # NaN kept where a field allows it (a metric)
    assert got.stats == {"a": 0.1 + 0.7, "n": 2} and got.checksums == {0: 0.125, 1: 2 / 3} and got.sampler["seed"] is None
    chunk = wire.decode(wire.encode_chunk({"batch": b, "failures": {"reward/calls": 4}, "seconds": {}, "busy": 1.5, "idle": 0.0,
                                           "load_s": 0.0, "checksums": {}, "tokens": 7, "agent": None}, EXAMPLES), 2)  # fmt: skip
    assert isinstance(chunk, wire.Chunk) and chunk.tokens == 7 and chunk.batch.to_batch(EXAMPLES).size == 2


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_garbage_pickles_oversize_wrong_types_and_deep_nesting_are_refused(tmp_path):
    good = wire.encode_batch(0, _batch(), EXAMPLES, {}, {}, {}, {})
    marker = tmp_path / "pwned"
    bad = {
        "garbage": b"\x00\xffnot json",
        "a pickle": pickle.dumps(_Payload(str(marker))),
        "a pickle inside json": b'{"kind": "failure", "message": ' + repr(pickle.dumps(_Payload(str(marker)))).encode() + b"}",
        "a string for ints": good.replace(b'"turns":[1,2]', b'"turns":["1",2]'),
        "a bool for an int": good.replace(b'"turns":[1,2]', b'"turns":[true,2]'),
        "rows that disagree": good.replace(b'"turns":[1,2]', b'"turns":[1]'),
        "an unknown field": good.replace(b'"index":0', b'"index":0,"__class__":"os.system"'),
        "an unknown kind": b'{"kind": "pickle", "data": "x"}',
        "an example out of range": good.replace(b'"multi_modal":[null,1]', b'"multi_modal":[null,9]'),
        "deep nesting": b'{"kind": "failure", "message": "x", "problems": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested segments": good.replace(b'"segments":null,"top', b'"segments":[],"top'),
    }
    for what, data in bad.items():
        assert data != good, what
        with pytest.raises(wire.WireError, match="declared shape"):
            wire.decode(data, len(EXAMPLES))
    with pytest.raises(wire.WireError, match=f"over the cap of {len(good) - 1} bytes"):
        wire.decode(good, len(EXAMPLES), cap=len(good) - 1)
    with pytest.raises(wire.WireError, match="over the cap"):
        wire.encode_batch(0, _batch(), EXAMPLES, {}, {}, {}, {}, cap=100)
    with pytest.raises(wire.WireError, match="must be bytes"):
        wire.decode(_batch(), 2)
    with pytest.raises(wire.WireError, match="not one of the run's prompt examples"):
        wire.encode_batch(0, _batch(), [EXAMPLES[0]], {}, {}, {}, {})
    assert not marker.exists()  # the payload never ran
    assert isinstance(wire.decode(good, len(EXAMPLES)), wire.Produced)


def test_a_user_error_travels_as_its_parts():
    from postrl.errors import UserError

    got = wire.decode(wire.encode_failure(UserError("row 3 has no answer", "fix it", title="bad data")), 0)
    assert isinstance(got, wire.Failure) and got.user_error and got.problems == ["row 3 has no answer", "fix it"] and got.title == "bad data"
    other = wire.decode(wire.encode_failure(KeyError("x")), 0)
    assert not other.user_error and other.message == "KeyError: 'x'"


def test_the_declared_shapes_hold_every_field_of_what_they_carry():
    """A field added to Batch or Completion must be added to the wire's models too (else it would be lost on the way back)."""
    from dataclasses import fields

    from postrl.batch import Batch
    from postrl.rollout.base import Completion

    assert set(wire.BatchMsg.model_fields) == {f.name for f in fields(Batch)}
    assert set(wire._Segment.model_fields) == {f.name for f in fields(Completion)}


def _bad(change) -> bytes:
    b = _batch()
    change(b)
    return wire.encode_batch(0, b, EXAMPLES, {}, {}, {}, {})


def _seg(b):
    return b.segments[0][0]


BAD_VALUES = {  # what a broken or compromised rollout process could send, and the words of its refusal
    "an id of 10**30": (lambda b: b.response_ids[0].__setitem__(0, 10**30), "response token id outside the vocabulary"),
    "an id of -7": (lambda b: b.response_ids[0].__setitem__(1, -7), "response token id outside the vocabulary"),
    "an id equal to the vocabulary": (lambda b: b.prompt_ids[1].__setitem__(0, VOCAB), "prompt token id outside"),
    "a mask shorter than its tokens": (lambda b: b.loss_masks[0].pop(), "one 0 or 1 per token (2), got 1"),
    "a mask value of 2": (lambda b: b.loss_masks[1].__setitem__(0, 2), "loss mask must hold one 0 or 1"),
    "a NaN log-prob": (lambda b: b.engine_logprobs[0].__setitem__(0, float("nan")), "engine log-probs must be finite"),
    "log-probs shorter than their tokens": (lambda b: b.engine_logprobs[0].pop(), "one value per token (2), got 1"),
    "an infinite score": (lambda b: b.scores.__setitem__(1, float("inf")), "score and reward must be finite"),
    "a NaN reward": (lambda b: b.rewards.__setitem__(0, float("nan")), "score and reward must be finite"),
    "token versions shorter than their tokens": (lambda b: b.token_versions.__setitem__(1, []), "token versions must hold one"),
    "a segment id past the vocabulary": (lambda b: _seg(b).token_ids.__setitem__(0, 2**40), "segment token id outside"),
    "a segment mask value of -1": (lambda b: _seg(b).loss_mask.__setitem__(0, -1), "segment's loss mask"),
    "a segment's -inf log-prob": (lambda b: _seg(b).logprobs.__setitem__(1, float("-inf")), "segment's log-probs must be finite"),
    "a turn span past its tokens": (lambda b: setattr(_seg(b), "turn_spans", [(0, 3)]), "turn span lies outside"),
    "a top-k id below zero": (lambda b: _seg(b).top_logprobs[0][0].__setitem__(0, -1), "segment top-k token id outside"),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(BAD_VALUES))
def test_a_reply_with_a_value_the_trainer_cannot_use_is_refused_before_any_tensor(what):
    """Shapes are not enough: an id past the vocabulary would be a device assert on a GPU, a NaN log-prob poisons the
    loss. Each bad value fails the decode (the sender's failure: it is restarted), naming the row and the field."""
    change, words = BAD_VALUES[what]
    data = _bad(change)
    with pytest.raises(wire.WireError, match="declared shape") as err:
        wire.decode(data, len(EXAMPLES), vocab=VOCAB)
    assert words in str(err.value) and "row " in str(err.value), str(err.value)
    assert len(str(err.value)) < 1000  # the value itself is never printed (10**30 of digits would be)


def test_the_vocabulary_is_the_policys_embedding_rows(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert wire.vocab_size(model) == model.get_input_embeddings().weight.shape[0] > 0
    good = _bad(lambda b: None)
    assert isinstance(wire.decode(good, len(EXAMPLES), vocab=wire.vocab_size(model)), wire.Produced)
    with pytest.raises(wire.WireError, match="response token id outside the vocabulary"):
        wire.decode(_bad(lambda b: b.response_ids[0].__setitem__(0, wire.vocab_size(model))), 2, vocab=wire.vocab_size(model))
