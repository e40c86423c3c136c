"""Tinker's protobuf bodies, with the SDK's own message definitions (`tinker.proto.tinker_public_pb2`).

Request: `ForwardBackwardRequest` (optionally zstd) → our `Datum`s. Results: `ForwardBackwardOutput` (per-datum
`logprobs`, metrics named `<name>:<reduction>` as the SDK combines chunks) and `SampleResponse`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb

from metaclaw.training_server.errors import ApiError, bad_request
from metaclaw.training_server.schemas import Datum
from metaclaw.wire.sampling import SequenceOutput

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
KNOWN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages", "mask")
_REDUCTION = {"ratio_min": "min", "ratio_max": "max"}  # every other metric is a mean over the batch


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The request body, zstd-decoded when `Content-Encoding: zstd`; 413 beyond `limit` bytes decoded."""
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise bad_request(f"Content-Encoding {encoding!r} is not supported (zstd or none)", "Content-Encoding")
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            while chunk := reader.read(1 << 20):
                out += chunk
                if len(out) > limit:
                    raise ApiError(413, f"the decompressed body exceeds the {limit}-byte limit", "body")
    except zstandard.ZstdError as exc:
        raise bad_request(f"body is not valid zstd: {exc}", "body") from None
    return bytes(out)


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise bad_request(f"body is not a tinker ForwardBackwardRequest protobuf: {exc}", "body") from None
    return msg


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, Any] | None:
    """`loss_fn_config` (the v2 map when set: numbers and strings; else the legacy numbers-only map)."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    if msg.loss_fn_config:
        return dict(msg.loss_fn_config.items())
    return None


def _tensor(t: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(t.dtype)
    if dtype is None:
        raise bad_request(f"{where} has an unsupported dtype ({t.dtype})", where)
    shape = list(t.shape)
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            if len(shape) != 2:
                raise ValueError("sparse tensors must be 2-D")
            values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
            crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
            cols = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
            dense = np.zeros(shape, dtype=dtype)
            for r in range(shape[0]):
                dense[r, cols[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
            return dense
        arr = np.frombuffer(t.dense, dtype=dtype)
        return arr.reshape(shape) if shape else arr
    except (ValueError, IndexError) as exc:
        raise bad_request(f"{where} is malformed: {exc}", where) from None


def _tokens(datum: pb.Datum, i: int) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise bad_request(f"this server trains on text only; got a {kind} chunk", f"data.{i}.model_input.{j}")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def datums(msg: pb.ForwardBackwardRequest, loss_fn: str) -> list[Datum]:
    """Tinker datums → ours (same layout: `target_tokens[t]` follows `model_input[:t+1]`); 400 naming the field."""
    out = []
    for i, d in enumerate(msg.data):
        if d.model_input_spans or d.loss_fn_input_spans:
            raise bad_request("provenance spans (stable_reinforce) are not supported", f"data.{i}.model_input_spans")
        inputs: dict[str, list[float] | list[int]] = {}
        for name, tensor in d.loss_fn_inputs.items():
            where = f"data.{i}.loss_fn_inputs.{name}"
            if name not in KNOWN_INPUTS:
                raise bad_request(f"loss_fn_inputs {name!r} is not supported (known: {', '.join(KNOWN_INPUTS)})", where)
            arr = _tensor(tensor, where)
            if arr.ndim != 1:
                raise bad_request(f"{where} must be 1-D (one value per position), got shape {list(arr.shape)}", where)
            inputs[name] = arr.tolist()
        tokens = _tokens(d, i)
        n = len(tokens)
        if "target_tokens" not in inputs:
            raise bad_request("loss_fn_inputs needs target_tokens", f"data.{i}.loss_fn_inputs.target_tokens")
        if loss_fn != "cross_entropy":
            for name in ("logprobs", "advantages"):
                if name not in inputs:
                    raise bad_request(f"loss_fn {loss_fn!r} needs {name}", f"data.{i}.loss_fn_inputs.{name}")
        elif "weights" not in inputs:
            inputs["weights"] = [1.0] * n
        fields = {
            "model_input_tokens": tokens,
            "target_tokens": [int(x) for x in inputs["target_tokens"]],
            "logprobs": inputs.get("logprobs", [0.0] * n),
            "advantages": inputs.get("advantages", [0.0] * n),
            "weights": inputs.get("weights"),
            "mask": inputs.get("mask"),
        }
        try:
            out.append(Datum.model_validate(fields))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            raise bad_request(f"data.{i}: {message}", f"data.{i}.{where}".rstrip(".")) from None
    if not out:
        raise bad_request("forward_backward needs at least one datum", "data")
    return out


def forward_backward_output(token_logprobs: Sequence[Sequence[float]], loss: float, metrics: dict) -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord with each datum's `logprobs`, and the metrics."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(token_logprobs))
    arrays = [np.asarray(row, dtype=np.float32) for row in token_logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    out.metrics["loss:sum"] = float(loss)
    for name, value in metrics.items():
        out.metrics[f"{name}:{_REDUCTION.get(name, 'mean')}"] = float(value)
    return out.SerializeToString()


def sample_response(outputs: Sequence[SequenceOutput], prompt_logprobs: Sequence[float | None] | None) -> bytes:
    """`SampleResponse`: tokens (int32), logprobs (float32), stop reasons; prompt logprobs with NaN for none."""
    out = pb.SampleResponse()
    for o in outputs:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH if o.finish_reason == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(o.token_ids, dtype=np.int32).tobytes(),
            logprobs=np.asarray(o.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        values = [float("nan") if x is None else x for x in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return out.SerializeToString()
