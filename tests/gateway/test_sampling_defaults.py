"""The model's sampling defaults (``--generation-config``, vLLM's): the ``generation_config.json``
values a request leaves unset reach the nodes on both APIs, a value the request sets wins, and a
file no request could follow stops the gateway at start-up naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from gateway.config import parse_gateway_config
from gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, gateway_pb2
from support.fake_gateway import FakeGateway
from support.openai_app import MODEL, start

QWEN_LIKE = {
    "do_sample": True,  # ignored, as vLLM ignores it
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_new_tokens": 12,
    "eos_token_id": 1,
}


def model_with(tiny_llama_dir: Path, tmp_path: Path, generation: dict[str, object]) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


def test_the_file_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(QWEN_LIKE))
    defaults = SamplingDefaults.from_generation_config(path)
    assert defaults == SamplingDefaults(0.7, 0.8, 20, 0.05, 1.05, 12)
    path.write_text(json.dumps({"top_k": 0, "temperature": 0}))  # top_k 0 is "off"
    assert SamplingDefaults.from_generation_config(path) == SamplingDefaults(temperature=0)
    bad = [("temperature", -1), ("top_p", 0), ("top_k", "20"), ("top_k", 2**31), ("min_p", 2),
           ("repetition_penalty", 0), ("max_new_tokens", 0), ("top_p", True)]  # fmt: skip
    for key, value in bad:
        path.write_text(json.dumps({key: value}))
        with pytest.raises(ValueError, match=f"{key} = "):
            SamplingDefaults.from_generation_config(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        SamplingDefaults.from_generation_config(path)


def test_auto_none_and_a_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = model_with(tiny_llama_dir, tmp_path, QWEN_LIKE)
    assert load_sampling_defaults("auto", model).temperature == 0.7
    assert load_sampling_defaults("none", model) == SamplingDefaults()
    assert load_sampling_defaults("auto", tiny_llama_dir) == SamplingDefaults()  # no fields
    assert load_sampling_defaults(str(model), tiny_llama_dir).top_k == 20
    with pytest.raises(ValueError, match="does not exist"):
        load_sampling_defaults(str(tmp_path), tiny_llama_dir)
    (model / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(SystemExit):  # the gateway refuses to start, naming the field
        parse_gateway_config(["--model", str(model), "--colocated", "127.0.0.1:1"], {})


def test_http_requests_take_the_models_defaults(tokenizer: Tokenizer) -> None:
    defaults = SamplingDefaults(0.7, 0.8, 20, 0.05, 1.05, 12)
    served, server = start(tokenizer, sampling_defaults=defaults)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        assert served.post("/v1/chat/completions", body).status_code == 200
        sampling = served.generator.requests[-1].sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 0.8, 20)
        assert (sampling.min_p, sampling.repetition_penalty, sampling.max_tokens) == (
            0.05,
            1.05,
            12,
        )
        given = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 3}
        served.post("/v1/chat/completions", {**body, **given, "repetition_penalty": 1.0})
        sampling = served.generator.requests[-1].sampling
        assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
            0.0,
            1.0,
            -1,
            0.0,
        )
        assert (sampling.repetition_penalty, sampling.max_tokens) == (1.0, 3)
        # The default max_tokens still fits what the prompt leaves (max_model_len 256).
        long = {"model": MODEL, "prompt": list(range(10, 260))}
        assert served.post("/v1/completions", long).status_code == 200
        assert served.generator.requests[-1].sampling.max_tokens == 6
    finally:
        server.stop()


def test_grpc_requests_take_the_models_defaults(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = model_with(tiny_llama_dir, tmp_path, QWEN_LIKE)
    for flags, expected in [((), (0.7, 0.8, 20, 0.05, 1.05, 12)),
                            (("--generation-config", "none"), None)]:  # fmt: skip
        served = FakeGateway.start(model, extra=flags)
        try:
            code, details, _ = served.call(gateway_pb2.GatewayGenerateRequest(text="hi"))
            assert code is grpc.StatusCode.OK, details
            sent = served.node.samplings[-1]
            found = (sent.temperature, sent.top_p, sent.top_k, sent.min_p,
                     sent.repetition_penalty, sent.max_tokens)  # fmt: skip
            if expected is None:  # the engine's defaults
                assert found == (1.0, 1.0, -1, 0.0, 1.0, 16)
            else:
                assert found == pytest.approx(expected)
            explicit = common_pb2.SamplingParams(temperature=0.0, min_p=0.0, max_tokens=2)
            served.call(gateway_pb2.GatewayGenerateRequest(text="hi", sampling=explicit))
            sent = served.node.samplings[-1]
            assert (sent.temperature, sent.min_p, sent.max_tokens) == (0.0, 0.0, 2)
            # An unset max_tokens fits what the prompt leaves (--max-model-len 256).
            ids = gateway_pb2.TokenIds(ids=list(range(10, 260)))
            code, details, _ = served.call(gateway_pb2.GatewayGenerateRequest(token_ids=ids))
            assert code is grpc.StatusCode.OK, details
            assert served.node.samplings[-1].max_tokens == 6
        finally:
            served.close()
