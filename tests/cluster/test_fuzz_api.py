"""Property-based fuzzing (hypothesis) of the client APIs of a real running cluster (colocated, the
cheapest real setup): gRPC `Generate`, `Tokenize` and `GetModelInfo` with generated requests
(malformed fields, huge values, NaN and infinities, odd unicode, unknown models), the same methods fed
raw bytes that may not even be protobuf, and the OpenAI HTTP API's request bodies. Properties: every
refusal is INVALID_ARGUMENT (NOT_FOUND for an unknown model; HTTP: 400 / 404 in OpenAI's error
format) with a short message naming what is wrong, never INTERNAL, UNKNOWN or a 500; every valid
request is served; the server still serves afterwards. `test_zz_still_serving_and_totals` checks
the counts."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections import Counter

import grpc
import pytest
from cluster_helpers import manifest
from fuzz_strategies import F32, ODD_TEXT, U32, fuzz_settings, mutated, wire_fields
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cluster.launcher import Cluster
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import make_model
from pdserve.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc
from pdserve.router.frontend import MAX_REQUEST_ID_CHARS

SENT: Counter[str] = Counter()  # generated requests per API, checked by test_zz_totals
MAX_DETAILS = 600  # a refusal's message is short enough to read (and to travel in a gRPC header)
SERVICE = "/pdserve.v1.PDServe/"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_model("tiny-llama", tmp_path_factory.mktemp("fuzz-api") / "tiny-llama", seed=0)
    one_worker = {"prefill": {"replicas": 0}, "decode": {"num_cpus": 0.5}}  # the API's answers need no more
    cluster = Cluster(manifest(model, "colocated", pools=one_worker), log=lambda _: None)
    cluster.start()
    channel = grpc.insecure_channel(cluster.address)
    stub = pdserve_pb2_grpc.PDServeStub(channel)
    yield cluster, channel, stub, load_tokenizer(model), stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    channel.close()
    cluster.stop()


# --- what the server must say -------------------------------------------------------------------------
def problems(request: pb.GenerateRequest, info: pb.ModelInfo, tokenizer) -> list[str]:
    """What is wrong with a request, in the order the server checks it: the first must be named."""
    found = []
    if request.model and request.model != info.name:
        found.append("unknown model")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        found.append("request_id")
    kind = request.WhichOneof("prompt")
    if kind is None:
        found.append("prompt")
    p = request.params
    if p.HasField("temperature") and not (math.isfinite(p.temperature) and p.temperature >= 0):
        found.append("temperature")
    if p.HasField("top_p") and not 0 < p.top_p <= 1:
        found.append("top_p")
    if p.HasField("seed") and p.seed >= 2**63:
        found.append("seed")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        found.append("stop_token_ids")
    if len(p.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        found.append("stop")
    if kind is not None:
        ids = (tokenizer.encode(request.text, add_special_tokens=False) if kind == "text"
               else list(request.token_ids.ids))
        if not ids or any(t >= info.vocab_size for t in ids) or len(ids) >= info.max_model_len:
            found.append("prompt")
        elif p.max_tokens > info.max_model_len - len(ids):  # 0: the default, which fits what is left
            found.append("max_tokens")
    return found


def check_refusal(code: grpc.StatusCode, details: str, expected: list[str]) -> None:
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (code, details)
    assert (code == grpc.StatusCode.NOT_FOUND) == (expected[0] == "unknown model"), (code, details, expected)
    assert 0 < len(details) <= MAX_DETAILS and expected[0] in details, (details, expected)


# --- gRPC requests ----------------------------------------------------------------------------------
HUGE_TEXT = st.sampled_from(["\U0001F600 \u202e\u05e9\u05dc\u05d5\u05dd \0 " * 4000, "word " * 120_000])


@st.composite
def generate_requests(draw: st.DrawFn, info: pb.ModelInfo) -> pb.GenerateRequest:
    """A valid request with up to three of its fields replaced by anything their type can hold."""
    ids = st.integers(0, info.vocab_size - 1)
    fields = {  # (a valid value, anything)
        "model": (st.sampled_from(["", info.name]), ODD_TEXT | st.just("m" * 100_000)),
        "prompt": (st.lists(ids, min_size=1, max_size=8) | ODD_TEXT.filter(str.strip),
                   st.none() | st.just("") | HUGE_TEXT | st.lists(ids | U32, max_size=8)
                   | st.tuples(st.lists(ids, min_size=1, max_size=8), st.integers(60, 80)).map(lambda t: t[0] * t[1])),
        "temperature": (st.none() | st.floats(0, 2, width=32), F32),
        "top_p": (st.none() | st.floats(0, 1, exclude_min=True, width=32), F32),
        "top_k": (st.integers(0, 50), U32),
        "seed": (st.none() | st.integers(0, 2**63 - 1), st.integers(0, 2**64 - 1)),
        "max_tokens": (st.integers(0, 4), st.sampled_from([2**31 - 1, 2**32 - 1]) | U32),
        "stop_token_ids": (st.lists(U32, max_size=5), U32.map(lambda t: [t] * 10_000)),
        "stop": (st.lists(ODD_TEXT.filter(bool), max_size=3),
                 st.lists(ODD_TEXT, max_size=4) | st.just(["x" * 1000] * 200 + [""])
                 | st.just(["\U0001F600" * 300] * 50)),
        "request_id": (ODD_TEXT.filter(lambda t: len(t) <= MAX_REQUEST_ID_CHARS), st.just("r" * 100_000)),
    }
    broken = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
    value = {name: draw(bad if name in broken else good) for name, (good, bad) in fields.items()}
    request = pb.GenerateRequest(model=value["model"], request_id=value["request_id"], params=pb.SamplingParams(
        **{k: value[k] for k in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "stop")},
        ignore_eos=draw(st.booleans()), logprobs=draw(st.booleans())))  # None: an optional field left unset
    if isinstance(value["prompt"], str):
        request.text = value["prompt"]
    elif value["prompt"] is not None:
        request.token_ids.ids.extend(value["prompt"])
    return request


def run_generate(call) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    """A stream's outcome; one that may run long (large max_tokens) is cancelled after six answers."""
    responses = []
    try:
        for response in call:
            responses.append(response)
            if len(responses) >= 6:
                call.cancel()
                break
    except grpc.RpcError as e:
        return e.code(), e.details() or "", responses
    return grpc.StatusCode.OK, "", responses


@fuzz_settings(1000)
@given(data=st.data())
def test_generate_refuses_bad_requests_clearly_and_serves_good_ones(served, data):
    cluster, channel, stub, tokenizer, info = served
    request = data.draw(generate_requests(info))
    expected = problems(request, info, tokenizer)
    code, details, responses = run_generate(stub.Generate(request, timeout=30))
    if expected:
        check_refusal(code, details, expected)
    else:
        assert code == grpc.StatusCode.OK, (code, details)
        assert responses and responses[0].request_id == (request.request_id or responses[0].server_request_id)
        assert all(t < info.vocab_size for r in responses for t in r.token_ids)
        if len(responses) < 6:
            assert responses[-1].finish_reason in ("stop", "length")
    SENT["grpc_generate"] += 1
    SENT["grpc_generate_refused"] += bool(expected)


@fuzz_settings(300)
@given(model=st.sampled_from(["", "m" * 100_000]) | ODD_TEXT, text=ODD_TEXT | HUGE_TEXT)
def test_tokenize_refuses_unknown_models_and_text_too_long_for_the_context_and_takes_the_rest(served, model, text):
    cluster, channel, stub, tokenizer, info = served
    model_info = cluster.router_stack.server.service.frontend.model
    too_long = len(text) > (info.max_model_len - 1) * model_info.max_token_chars  # refused untokenized
    try:
        ids = stub.Tokenize(pb.TokenizeRequest(model=model, text=text), timeout=30).token_ids
    except grpc.RpcError as e:
        wrong_model = bool(model) and model != info.name
        assert wrong_model or too_long, (e.code(), e.details())
        check_refusal(e.code(), e.details(), ["unknown model" if wrong_model else "characters, more than the"])
    else:
        assert (not model or model == info.name) and not too_long
        assert list(ids) == tokenizer.encode(text, add_special_tokens=False)
    SENT["grpc_tokenize"] += 1


# --- raw bytes to every method ----------------------------------------------------------------------
def valid_bytes(info: pb.ModelInfo) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.builds(lambda ids: pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=pb.SamplingParams(
            max_tokens=2)).SerializeToString(), st.lists(st.integers(0, info.vocab_size - 1), min_size=1, max_size=8)),
        st.builds(lambda t: pb.TokenizeRequest(text=t).SerializeToString(), ODD_TEXT),
    )


@fuzz_settings(750)
@given(data=st.data(), method=st.sampled_from(["Generate", "Tokenize", "GetModelInfo"]))
def test_undecodable_bytes_are_invalid_argument(served, data, method):
    cluster, channel, stub, tokenizer, info = served
    raw = data.draw(st.one_of(st.binary(max_size=200), valid_bytes(info), mutated(valid_bytes(info)),
                              wire_fields(list(range(1, 10))), st.just(b"\x12\x03\xff\xfe\xfd")))
    if method == "Generate":
        call = channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)
        code, details, _ = run_generate(call(raw, timeout=30))
    else:
        call = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            call(raw, timeout=30)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
    # Whatever parses is judged as a request (tested above); what does not is INVALID_ARGUMENT.
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (code, details)
    if code != grpc.StatusCode.OK:
        assert 0 < len(details) <= MAX_DETAILS, details
    SENT["grpc_raw"] += 1
    SENT["grpc_raw_undecodable"] += "malformed request" in details


# --- the OpenAI HTTP API ----------------------------------------------------------------------------
JSON_SCALAR = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | ODD_TEXT
ANY_JSON = st.recursive(JSON_SCALAR, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(ODD_TEXT, inner, max_size=3), max_leaves=8)
TEXT = ODD_TEXT.filter(str.strip)


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body (completions or chat) with up to three fields replaced by any JSON, or cut short,
    or not JSON at all."""
    chat = draw(st.booleans())
    fields = {
        "model": st.just(""), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**63 - 1),
        "stop": TEXT | st.lists(TEXT, max_size=3), "stop_token_ids": st.lists(st.integers(0, 2**32), max_size=3),
        "ignore_eos": st.booleans(), "n": st.just(1), "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        **({"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                          "content": TEXT}), min_size=1, max_size=2),
            "logprobs": st.booleans()} if chat else
           {"prompt": TEXT | st.lists(st.integers(3, 1000), min_size=1, max_size=5), "logprobs": st.just(0)}),
    }
    body = {name: draw(value) for name, value in fields.items() if name in ("max_tokens", "messages", "prompt")
            or draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted(fields) + ["logit_bias", "best_of"]), max_size=3, unique=True)):
        body[name] = draw(ANY_JSON | st.integers(-1, 2**70) if name != "max_tokens" else st.integers(-2, 0) | ODD_TEXT)
    raw = json.dumps(body, allow_nan=True).encode()
    spoil = draw(st.integers(0, 11))  # mostly left as it is
    if spoil >= 8:
        raw = [raw[: len(raw) // 2], b"[" * 10_000, raw + b"\xff\xfe", draw(st.binary(max_size=50))][spoil - 8]
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


def post(address: str, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{address}{path}", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@fuzz_settings(300)
@given(request=http_bodies())
def test_http_refusals_are_400_in_openai_format_never_500(served, request):
    cluster = served[0]
    path, body = request
    status, answer = post(cluster.http_address, path, body)
    assert status in (200, 400, 404), (status, answer[:500])
    if status == 200:
        assert answer.startswith(b"data: ") or "choices" in json.loads(answer)
    else:
        error = json.loads(answer)["error"]
        assert error["type"] in ("invalid_request_error", "not_found_error") and error["message"], error
    SENT["http"] += 1
    SENT["http_refused"] += status != 200


# --- afterwards -------------------------------------------------------------------------------------
def test_zz_still_serving_and_totals(served):
    """Runs last in this file: the server serves a plain request after everything above, and every
    API got its share of generated requests."""
    cluster, channel, stub, tokenizer, info = served
    plain = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                               params=pb.SamplingParams(max_tokens=3, temperature=0))
    responses = list(stub.Generate(plain, timeout=30))
    assert sum(len(r.token_ids) for r in responses) == 3 and responses[-1].finish_reason == "length"
    print(f"fuzzed API requests: {dict(SENT)}")
    assert SENT["grpc_generate"] + SENT["grpc_tokenize"] + SENT["grpc_raw"] + SENT["http"] >= 2300, SENT
    assert min(SENT["grpc_generate_refused"], SENT["grpc_generate"] - SENT["grpc_generate_refused"],
               SENT["grpc_raw_undecodable"], SENT["http_refused"], SENT["http"] - SENT["http_refused"]) >= 20, SENT
