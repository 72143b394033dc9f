"""The SDK's protobuf messages, read and written: forward_backward's request (zstd or not) and output, samples.
The messages are the SDK's own (tinker.proto, from the pinned `tinker` package): one schema on both sides."""
import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from .trainer import Refused

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _array(tensor) -> np.ndarray:
    if tensor.HasField("sparse_csr"):
        raise Refused("sparse loss_fn_inputs are not supported here: send dense tensors")
    if tensor.dtype not in _NUMPY:
        raise Refused(f"unsupported tensor dtype {tensor.dtype} in loss_fn_inputs")
    # a copy: torch warns on (and must not write through) the read-only view of the message's bytes
    return np.frombuffer(tensor.dense, dtype=_NUMPY[tensor.dtype]).reshape(list(tensor.shape) or [-1]).copy()


def forward_backward_message(body: bytes, encoding: str | None) -> "pb.ForwardBackwardRequest":
    if encoding == "zstd":
        body = zstandard.ZstdDecompressor().decompressobj().decompress(body)  # the frame may not state its size
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise Refused(f"the body is not a ForwardBackwardRequest of the SDK's protobuf schema: {e}") from e
    return msg


def forward_backward_inputs(msg: "pb.ForwardBackwardRequest") -> tuple[list, dict[str, float]]:
    """A request's data [(tokens, {name: array})] and loss_fn_config. Refused here, in the request's turn, a request
    still takes its seq_id: the model's later requests do not wait for it forever."""
    data = []
    for datum in msg.data:
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":  # images and audio are not served
                raise Refused(f"model input chunks of kind {chunk.WhichOneof('chunk')!r} are not supported here: "
                              "text (encoded_text) only")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        data.append((tokens, {name: _array(t) for name, t in datum.loss_fn_inputs.items()}))
    if not data:
        raise Refused("forward_backward with no data")
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"} \
        or dict(msg.loss_fn_config)
    return data, config


def _batched(arrays: list[np.ndarray]) -> "pb.BatchedTensor":
    """Per-datum float32 vectors as one BatchedTensor: the bytes end to end, and each datum's byte offset."""
    sizes = [a.nbytes for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(np.ascontiguousarray(a, np.float32).tobytes() for a in arrays),
                            offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    names = outputs[0].keys()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs),
                            fields={name: _batched([o[name] for o in outputs]) for name in names})
    return pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
                                    metrics=metrics).SerializeToString()


def sample_response(sequences: list[dict], prompt_logprobs: np.ndarray | None = None) -> bytes:
    """Sequences as {"tokens", "logprobs", "stop"} (stop: True when a stop condition ended it, else it ran out of
    max_tokens)."""
    msg = pb.SampleResponse(sequences=[pb.SampledSequence(
        tokens=np.asarray(s["tokens"], np.int32).tobytes(), logprobs=np.asarray(s["logprobs"], np.float32).tobytes(),
        stop_reason=pb.STOP_REASON_STOP if s["stop"] else pb.STOP_REASON_LENGTH) for s in sequences])
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
