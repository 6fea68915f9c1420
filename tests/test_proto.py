"""The public gRPC API: committed stubs match the .proto, field numbers match DESIGN §3."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2 as pb
from pagedserve.protos.generated.pagedserve.v1 import generate_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("_protos_generate", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    gen = _load_generator()
    gen.generate(tmp_path)
    committed = REPO / "protos" / "generated" / "pagedserve" / "v1"
    for name in gen.STUB_NAMES:
        fresh = (tmp_path / "pagedserve" / "v1" / name).read_text(encoding="utf-8")
        old = (committed / name).read_text(encoding="utf-8")
        assert fresh == old, f"{name} differs from protos/generate.py output: regenerate, never hand-edit"
        assert fresh.startswith(gen.HEADER)
    grpc_stub = (committed / "generate_pb2_grpc.py").read_text(encoding="utf-8")
    assert "from pagedserve.protos.generated.pagedserve.v1 import generate_pb2" in grpc_stub


def _numbers(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


@pytest.mark.parametrize(
    "message, expected",
    [
        (pb.GenerateRequest, {"request_id": 1, "prompt": 2, "prompt_token_ids": 3, "params": 4,
                              "priority": 5, "cache_salt": 6, "messages": 7,
                              "add_special_tokens": 8, "truncate_prompt_tokens": 9,
                              "lora_adapter": 10}),
        (pb.TokenIds, {"ids": 1}),
        (pb.ChatMessages, {"messages": 1, "tools_json": 2, "add_generation_prompt": 3,
                           "continue_final_message": 4, "chat_template_kwargs_json": 5}),
        (pb.ChatMessage, {"role": 1, "content": 2, "parts": 3, "tool_calls_json": 4,
                          "tool_call_id": 5, "name": 6}),
        (pb.ChatContentPart, {"type": 1, "text": 2}),
        (pb.SamplingParams, {"max_tokens": 1, "temperature": 2, "top_p": 3, "top_k": 4, "min_p": 5,
                             "seed": 6, "stop": 7, "stop_token_ids": 8, "ignore_eos": 9,
                             "min_tokens": 10, "n": 11, "logprobs": 12, "repetition_penalty": 13,
                             "presence_penalty": 14, "frequency_penalty": 15,
                             "include_stop_str_in_output": 16, "keep_special_tokens": 17,
                             "logit_bias": 18, "structured_output": 19,
                             "prompt_logprobs": 20, "allowed_token_ids": 21, "bad_words": 22,
                             "beam_search": 23, "prediction": 24}),
        (pb.BeamSearch, {"length_penalty": 1, "early_stopping": 2}),
        (pb.Prediction, {"text": 1, "token_ids": 2}),
        (pb.StructuredOutput, {"json_schema": 1, "json_object": 2, "regex": 3, "choice": 4,
                               "grammar": 5}),
        (pb.Choices, {"choices": 1}),
        (pb.GenerateResponse, {"request_id": 1, "completions": 2, "usage": 3,
                               "prompt_logprobs": 4}),
        (pb.Completion, {"index": 1, "text": 2, "token_ids": 3, "finish_reason": 4,
                         "stop_string": 5, "stop_token_id": 6, "logprobs": 7}),
        (pb.TokenLogprob, {"token_id": 1, "logprob": 2, "top": 3, "rank": 4}),
        (pb.TopLogprob, {"token_id": 1, "logprob": 2}),
        (pb.Usage, {"prompt_tokens": 1, "completion_tokens": 2, "cached_prompt_tokens": 3,
                    "accepted_prediction_tokens": 4, "rejected_prediction_tokens": 5}),
        (pb.GenerateStreamResponse, {"request_id": 1, "index": 2, "text": 3, "token_ids": 4,
                                     "finish_reason": 5, "stop_string": 6, "stop_token_id": 7,
                                     "logprobs": 8, "usage": 9, "prompt_logprobs": 10}),
        (pb.AbortRequest, {"request_id": 1}),
        (pb.AbortResponse, {}),
        (pb.ModelInfo, {"model": 1, "architecture": 2, "max_model_len": 3, "vocab_size": 4,
                        "block_size": 5, "dtype": 6, "eos_token_ids": 7,
                        "lora_adapters": 8}),
        (pb.ClusterStatus, {"executors": 1, "prefix_cache_queries": 2, "prefix_cache_hits": 3}),
        (pb.ExecutorStatus, {"id": 1, "device": 2, "healthy": 3, "num_gpu_blocks": 4,
                             "num_free_gpu_blocks": 5, "num_cpu_blocks": 6,
                             "num_free_cpu_blocks": 7, "running": 8, "waiting": 9, "swapped": 10}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_field_numbers(message, expected):
    assert _numbers(message) == expected


def test_optional_fields_track_presence():
    optional = {
        f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence
    }
    assert optional == {"max_tokens", "temperature", "top_p", "seed", "n", "logprobs",
                        "repetition_penalty", "structured_output",  # a message field
                        "prompt_logprobs", "beam_search",  # (a message field)
                        "prediction"}  # (a message field)
    assert pb.BeamSearch.DESCRIPTOR.fields_by_name["length_penalty"].has_presence
    oneof = pb.StructuredOutput.DESCRIPTOR.oneofs_by_name["format"]
    assert [f.name for f in oneof.fields] == ["json_schema", "json_object", "regex", "choice",
                                              "grammar"]
    assert pb.Completion.DESCRIPTOR.fields_by_name["stop_token_id"].has_presence
    assert pb.GenerateStreamResponse.DESCRIPTOR.fields_by_name["stop_token_id"].has_presence
    assert pb.ChatMessages.DESCRIPTOR.fields_by_name["add_generation_prompt"].has_presence
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["add_special_tokens"].has_presence


def test_prompt_oneof_and_types():
    oneof = pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert [f.name for f in oneof.fields] == ["prompt", "prompt_token_ids", "messages"]
    fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    assert fields["seed"].type == fields["seed"].TYPE_UINT64
    assert fields["top_k"].type == fields["top_k"].TYPE_INT32
    assert fields["temperature"].type == fields["temperature"].TYPE_FLOAT


def test_finish_reason_values():
    assert {v.name: v.number for v in pb.FinishReason.DESCRIPTOR.values} == {
        "FINISH_REASON_UNSPECIFIED": 0, "LENGTH": 1, "STOP": 2, "ABORT": 3,
    }


def test_service_methods():
    service = pb.DESCRIPTOR.services_by_name["Generator"]
    assert service.full_name == "pagedserve.v1.Generator"
    methods = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
               for m in service.methods}
    assert methods == {
        "Generate": ("GenerateRequest", "GenerateResponse", False),
        "Stream": ("GenerateRequest", "GenerateStreamResponse", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "GetModelInfo": ("ModelInfoRequest", "ModelInfo", False),
        "GetClusterStatus": ("ClusterStatusRequest", "ClusterStatus", False),
    }
    assert hasattr(generate_pb2_grpc, "GeneratorStub")
    assert hasattr(generate_pb2_grpc, "add_GeneratorServicer_to_server")
