"""Run by the vLLM venv's Python: vLLM's own classes as the oracle for our codec.

`encode`: build messages with vLLM's classes, encode them with vLLM's
MsgpackEncoder, print their frames (hex) and the values they hold.
`decode`: read frames (hex, JSON on stdin) made by our sim peers, decode them
with vLLM's MsgpackDecoder into its classes, print the values it got.
`tolerate`: read cases (JSON on stdin: name -> [class, frame hex]), decode each
as vLLM's readers do (MsgpackDecoder for requests and outputs, a typed
msgspec decode for the registration), print "accepted" or the error.
`multimodal`: build an ADD with image features (tensors inline and in aux frames, nested, a shared
field, a cached item with no data) with vLLM's classes, encode it with MsgpackEncoder, print its frames
(hex) and what MsgpackDecoder reads back from them.
`arrays` (0.34.0's classes): ADDs whose prompt is an int ndarray (short and long, int32 and uint32), an
output that says it is watermarked, a registration with a PrefixHashConfig, encoded as vLLM sends them; with
the values each holds.
`recorded`: read recorded messages (JSON on stdin: a list of [kind, frames hex],
an input's request type byte left out), decode each as this release's engine or
frontend does (an ADD as EngineCoreRequest, a UTILITY call generically with its
arguments converted to the method's msgspec types by EngineCore's own code,
outputs as EngineCoreOutputs), print each as plain values, structs by field name.
"""

import collections
import dataclasses
import enum
import json
import sys

sys.stdout, out = sys.stderr, sys.stdout  # vLLM logs to stdout at import

import numpy as np  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
import msgspec  # noqa: E402
from vllm.v1.engine import (EngineCoreOutput, EngineCoreOutputs, EngineCoreReadyResponse,  # noqa: E402
                            EngineCoreRequest, UtilityOutput)
from vllm.v1.outputs import LogprobsLists  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402


def encode() -> dict:
    request = EngineCoreRequest(
        request_id="oracle-1", prompt_token_ids=[5, 6, 7], mm_features=None,
        sampling_params=SamplingParams(temperature=0.5, top_k=3, max_tokens=9, seed=11, stop_token_ids=[4]),
        pooling_params=None, arrival_time=12.5, lora_request=None, cache_salt="salt", data_parallel_rank=None,
        client_index=1, priority=2)
    logprobs = LogprobsLists(np.arange(80, dtype=np.int64).reshape(1, 80), np.full((1, 80), -0.5, dtype=np.float32),
                             np.array([3], dtype=np.int64), None)
    outputs = EngineCoreOutputs(engine_index=1, outputs=[EngineCoreOutput(
        request_id="oracle-1", new_token_ids=[42], new_logprobs=logprobs, finish_reason=1, num_nans_in_logits=0)],
        utility_output=UtilityOutput(call_id=77, failure_message="boom"))
    encoder = MsgpackEncoder()
    return {
        "request": {"frames": [bytes(f).hex() for f in encoder.encode(request)],
                    "values": {"request_id": "oracle-1", "prompt_token_ids": [5, 6, 7], "arrival_time": 12.5,
                               "cache_salt": "salt", "client_index": 1, "priority": 2,
                               "sampling_params": {"temperature": 0.5, "top_k": 3, "max_tokens": 9, "seed": 11}}},
        "outputs": {"frames": [bytes(f).hex() for f in encoder.encode(outputs)],
                    "values": {"engine_index": 1, "request_id": "oracle-1", "new_token_ids": [42], "finish_reason": 1,
                               "logprob_token_ids": list(range(80)), "logprobs": [-0.5] * 80, "ranks": [3],
                               "call_id": 77, "failure_message": "boom"}},
    }


def decode(frames: dict) -> dict:
    request = MsgpackDecoder(EngineCoreRequest).decode([bytes.fromhex(f) for f in frames["request"]])
    outputs = MsgpackDecoder(EngineCoreOutputs).decode([bytes.fromhex(f) for f in frames["outputs"]])
    output = outputs.outputs[0]
    return {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
            "client_index": request.client_index, "max_tokens": request.sampling_params.max_tokens,
            "temperature": request.sampling_params.temperature, "seed": request.sampling_params.seed,
            "output_request_id": output.request_id, "new_token_ids": output.new_token_ids,
            "finish_reason": int(output.finish_reason), "engine_index": outputs.engine_index}


def multimodal() -> dict:
    import torch
    from vllm.multimodal.inputs import (MultiModalFeatureSpec, MultiModalFieldConfig, MultiModalKwargsItem,
                                        PlaceholderRange)

    batched, shared = MultiModalFieldConfig.batched("image").field, MultiModalFieldConfig.shared("image", 2).field
    pixels = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(3, 8, 8) / 7  # 768 bytes: an aux frame
    item = MultiModalKwargsItem({
        "pixel_values": batched.build_elems("image", "pixel_values", [pixels])[0],
        "image_sizes": batched.build_elems("image", "image_sizes", [torch.tensor([8, 8])])[0],  # inline
        "patches": shared.build_elems("image", "patches", [torch.ones(2, dtype=torch.bfloat16),
                                                            torch.zeros(1, 1, dtype=torch.int32)])[0],
    })
    features = [MultiModalFeatureSpec(data=item, modality="image", identifier="img-0", mm_hash="h-0",
                                      mm_position=PlaceholderRange(offset=1, length=4)),
                MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",  # cached in the engine
                                      mm_position=PlaceholderRange(offset=6, length=4))]
    request = EngineCoreRequest(
        request_id="oracle-mm", prompt_token_ids=[5, 9, 9, 9, 9, 6, 9, 9, 9, 9, 7], mm_features=features,
        sampling_params=SamplingParams(max_tokens=3), pooling_params=None, arrival_time=1.5, lora_request=None,
        cache_salt=None, data_parallel_rank=None)
    frames = [bytes(f) for f in MsgpackEncoder().encode(request)]
    return {"frames": [f.hex() for f in frames], "values": plain(MsgpackDecoder(EngineCoreRequest).decode(frames))}


def arrays() -> dict:
    from vllm.v1.engine import PrefixHashConfig

    encoder, requests = MsgpackEncoder(), {}
    for length in (5, 200):
        for dtype in ("<i4", "<u4"):  # the Python frontend's, and vllm-rs's unsigned kind (numpy writes '<' for '=')
            tokens = [(7 * i + 3) % 900 for i in range(length)]
            name = f"{length}-{dtype}"
            request = EngineCoreRequest(
                request_id=name, prompt_token_ids=np.array(tokens, dtype=dtype), mm_features=None,
                sampling_params=SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9), pooling_params=None,
                arrival_time=1.5, lora_request=None, cache_salt=None, data_parallel_rank=None,
                block_hashes=[bytes([length % 256]) * 32])
            requests[name] = {"frames": [bytes(f).hex() for f in encoder.encode(request)], "tokens": tokens,
                              "block_hashes": [h.hex() for h in request.block_hashes]}
    outputs = EngineCoreOutputs(engine_index=0, outputs=[EngineCoreOutput(
        request_id="5-<i4", new_token_ids=[42], finish_reason=1, watermarking=True)])
    fields = {f.name: None for f in dataclasses.fields(EngineCoreReadyResponse) if f.default is dataclasses.MISSING}
    fields.update(max_model_len=256, num_gpu_blocks=10, block_size=16, dtype="float32", vllm_version="0.34.0",
                  world_size=1, data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1,
                  decode_context_parallel_size=1, data_parallel_rank=0, max_num_seqs=4, max_num_batched_tokens=256,
                  instance_id="oracle", supports_lora=False, max_loras=0)
    registration = EngineCoreReadyResponse(**fields, prefix_hash_config=PrefixHashConfig("sha256", 16, b"\x02" * 32),
                                           cache_config_info={"block_size": "16"}, config_hash="c0ffee")
    return {"requests": requests, "outputs": [bytes(f).hex() for f in encoder.encode(outputs)],
            "registration": msgspec.msgpack.encode(registration).hex()}


def plain(value):
    """A decoded value as JSON: structs, dataclasses and named tuples by field name, arrays and tensors as
    lists; a utility call's result, which vLLM reads from its [type info, value] envelope, as
    {"utility_result": value}."""
    if type(value).__name__ == "UtilityResult":
        return {"utility_result": plain(value.result)}
    if isinstance(value, msgspec.Struct):
        return {name: plain(getattr(value, name)) for name in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple (LogprobsLists)
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(value, "tolist"):  # numpy arrays and torch tensors
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, (dict, collections.UserDict)):  # (a multimodal item is a UserDict)
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


def recorded(messages: list) -> list:
    from vllm.v1.engine.core import EngineCoreProc as EngineCore  # (which handles the input socket)

    engine = EngineCore.__new__(EngineCore)  # (never started: only its methods' signatures are read)
    decoders = {"ADD": MsgpackDecoder(EngineCoreRequest), "OUTPUTS": MsgpackDecoder(EngineCoreOutputs)}
    values = []
    for kind, frames in messages:
        frames = [bytes.fromhex(f) for f in frames]
        if kind == "UTILITY":
            client, call_id, method, args = MsgpackDecoder().decode(frames)
            args = EngineCore._convert_msgspec_args(getattr(engine, method), args)
            values.append({"client_index": client, "call_id": call_id, "method": method, "args": plain(args)})
        else:
            values.append(plain(decoders[kind].decode(frames)))
    return values


def tolerate(cases: dict) -> dict:
    classes = {"EngineCoreRequest": EngineCoreRequest, "EngineCoreOutputs": EngineCoreOutputs}
    verdicts = {}
    for name, (cls, frame) in cases.items():
        try:
            if cls == "EngineCoreReadyResponse":
                msgspec.msgpack.decode(bytes.fromhex(frame), type=EngineCoreReadyResponse)
            else:
                MsgpackDecoder(classes[cls]).decode([bytes.fromhex(frame)])
            verdicts[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the verdict is the point
            verdicts[name] = f"rejected: {type(exc).__name__}: {exc}"
    return verdicts


if __name__ == "__main__":
    modes = {"encode": lambda: encode(), "decode": lambda: decode(json.load(sys.stdin)),
             "tolerate": lambda: tolerate(json.load(sys.stdin)), "recorded": lambda: recorded(json.load(sys.stdin)),
             "multimodal": multimodal, "arrays": arrays}
    json.dump(modes[sys.argv[1]](), out)
