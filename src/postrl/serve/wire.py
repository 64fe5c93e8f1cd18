"""The Tinker wire formats the SDK speaks for the two heavy payloads: forward_backward requests arrive as
protobuf, and forward_backward / sample results go back as protobuf (the SDK sends `Accept:
application/x-protobuf` for both and accepts nothing else for them). The message classes are the SDK's own
(`tinker.proto.tinker_public_pb2`); this module only turns them into tensors and back, checking every count
and size against the server's limits before any array is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from postrl.errors import UserError

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # the public proto's DType values that carry dense data


@dataclass
class Datum:
    """One training example: the model's input tokens and the loss inputs, each a tensor of that length."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass
class FwdBwd:
    model_id: str
    loss_fn: str
    config: dict[str, float]
    data: list[Datum]
    forward_only: bool


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _tensor(msg, name: str, max_tokens: int) -> torch.Tensor:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None or msg.HasField("sparse_csr"):
        raise UserError(f"loss_fn_inputs['{name}']: only dense float32 / int64 tensors are served")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if arr.size > max_tokens:
        raise UserError(f"loss_fn_inputs['{name}'] has {arr.size} values, over the server's {max_tokens} per datum")
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise UserError(f"loss_fn_inputs['{name}']: shape {shape} does not hold its {arr.size} values")
    return torch.from_numpy(arr.copy().reshape(shape))


def parse_forward_backward(body: bytes, max_datums: int, max_tokens: int) -> FwdBwd:
    """The SDK's protobuf ForwardBackwardRequest, bounded: at most `max_datums` datums of `max_tokens` tokens."""
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise UserError(f"the forward_backward body is not a ForwardBackwardRequest protobuf ({exc})") from None
    if len(msg.data) > max_datums:
        raise UserError(f"forward_backward carries {len(msg.data)} datums, over the server's {max_datums} (--max-datums)")
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"datum {i}: only token (encoded_text) chunks are served; images and audio are not")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
            if len(tokens) > max_tokens:
                raise UserError(f"datum {i} has over {max_tokens} tokens (--max-tokens)")
        inputs = {name: _tensor(t, name, max_tokens) for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"} or dict(msg.loss_fn_config)
    return FwdBwd(msg.model_id, msg.loss_fn, config, data, msg.forward_only)


def _batched(arrays: list[np.ndarray], dtype: int):
    bt = _pb().BatchedTensor()
    bt.dtype = dtype
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    bt.data = b"".join(a.tobytes() for a in arrays)
    bt.offsets = offsets.tobytes()
    return bt


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput protobuf: one ArrayRecord of float32 fields, one row per datum."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.type_tag, record.num_datums = "ArrayRecord", len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [o[name].detach().to(torch.float32).cpu().numpy().reshape(-1) for o in outputs]
        record.fields[name].CopyFrom(_batched(arrays, pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], bool]], prompt_logprobs: list[float] | None) -> bytes:
    """A SampleResponse protobuf from (tokens, log-probs, stopped by itself) per sequence."""
    pb = _pb()
    msg = pb.SampleResponse()
    for tokens, logprobs, stopped in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
