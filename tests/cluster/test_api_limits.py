"""The client APIs against what a hostile or careless client sends, on a real cluster (colocated, one
worker: the cheapest real setup) through the real clients: text too long for the context is refused
before it is tokenized, and tokenizing never holds up the event loop that serves every other request;
requests past the size limit are answered unread, and a call without the token before its message is
read; a body of many bad values gets a short answer; request ids and sampling parameters are bounded; the SDK refuses
text it cannot send as its own InvalidArgument, and warns when its token would cross the network in
clear text."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http.client
import json
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import openai
import pytest
from cluster_helpers import manifest

from pdserve.client import AsyncClient, Client, InsecureTokenWarning, InvalidArgument, PDServeError
from pdserve.cluster.launcher import Cluster
from pdserve.engine.models.presets import make_model
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc
from pdserve.router import http_api
from pdserve.router.frontend import Frontend

ARCH = "tiny-llama"
TOKEN = "limits-token"
IDS = [17, 291, 45, 8]
# 15 MiB of text, under both APIs' 16 MiB request limit: it once took the router 20 s to tokenize, on
# the event loop, before it could say the prompt was too long.
HUGE_TEXT = "The water was cold. " * (15 * 2**20 // 20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = make_model(ARCH, tmp_path_factory.mktemp("api-limits") / ARCH, seed=0)
    pools = {"prefill": {"replicas": 0}, "decode": {"num_cpus": 0.5}}
    c = Cluster(manifest(model, "colocated", server={"auth_token": TOKEN}, pools=pools), log=lambda _: None)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def grpc_client(cluster) -> Iterator[Client]:
    with Client(cluster.address, timeout=60, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def api(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def frontend(cluster) -> Frontend:
    return cluster.router_stack.server.service.frontend


# --- prompts too long for the context -----------------------------------------------------------------
def refusal(call: Callable[[], object]) -> str:
    """The message of the INVALID_ARGUMENT (gRPC) or the 400 in OpenAI's format (HTTP) that `call` gets."""
    with pytest.raises((InvalidArgument, openai.BadRequestError)) as e:
        call()
    if isinstance(e.value, openai.BadRequestError):
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "invalid_argument"
        return e.value.body["message"]
    return e.value.message


def test_text_too_long_for_the_context_is_refused_before_it_is_tokenized(grpc_client, api, frontend):
    info, chars = frontend.model.info, frontend.model.max_token_chars
    limit = (info.max_model_len - 1) * chars
    calls = {
        "grpc": lambda: grpc_client.generate(HUGE_TEXT, max_tokens=1),
        "completions": lambda: api.completions.create(model="", prompt=HUGE_TEXT, max_tokens=1),
        "chat": lambda: api.chat.completions.create(model="", messages=[{"role": "user", "content": HUGE_TEXT}],
                                                    max_tokens=1),
        "tokenize": lambda: grpc_client.tokenize(HUGE_TEXT),  # it once took 13 s of a tokenizer thread
    }
    for api_name, call in calls.items():
        # The count of characters, not of tokens: the text was never tokenized.
        message = refusal(call)
        assert f"characters, more than the {limit} that can fit the context limit of {info.max_model_len} tokens" \
            in message, (api_name, message)
        assert len(message) < 300, (api_name, message)


def test_the_bound_is_tight_and_refuses_no_text_that_fits(grpc_client, frontend):
    """No token of this model is longer than " import" (7 characters), and 511 of them, the most a
    512-token context takes with one token to generate, fit exactly; one character more cannot."""
    assert (frontend.model.max_token_chars, frontend.model.info.max_model_len) == (7, 512)
    fits = " import" * 511
    r = grpc_client.generate(fits, max_tokens=1)
    assert r.prompt_tokens == 511 and len(r.token_ids) == 1
    assert "characters" in refusal(lambda: grpc_client.generate(fits + " ", max_tokens=1))


class HeldTokenizer:
    """The router's own tokenizer, holding each call of `method` whose first argument mentions `marker`
    until `release` is set: a tokenization that takes as long as the test needs."""

    def __init__(self, tokenizer: Any, method: str, marker: str) -> None:
        self._tokenizer, self._method, self._marker = tokenizer, method, marker
        self.holding = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._tokenizer, name)
        if name != self._method:
            return attribute

        def held(first: object, *args: object, **kwargs: object) -> object:
            if self._marker in str(first):
                self.holding.set()
                self.release.wait(60)
            return attribute(first, *args, **kwargs)
        return held


@contextmanager
def held_tokenizer(frontend: Frontend, method: str, marker: str) -> Iterator[HeldTokenizer]:
    model = frontend.model
    held = HeldTokenizer(model.tokenizer, method, marker)
    frontend.model = dataclasses.replace(model, tokenizer=held)
    try:
        yield held
    finally:
        held.release.set()
        frontend.model = model


MARKER = "hold-this-text"
SLOW_CALLS = {  # (tokenizer method held, the call whose text it holds, a plain call over the same API)
    "grpc-generate": ("encode", lambda c, a: c.generate(f"{MARKER} and more", max_tokens=2).token_ids,
                      lambda c, a: c.generate(IDS, max_tokens=2, timeout=20).token_ids),
    "grpc-tokenize": ("encode", lambda c, a: c.tokenize(f"{MARKER} and more"),
                      lambda c, a: c.generate(IDS, max_tokens=2, timeout=20).token_ids),
    "http-completions": ("encode", lambda c, a: a.completions.create(model="", prompt=MARKER, max_tokens=2).usage,
                         lambda c, a: a.completions.create(model="", prompt=IDS, max_tokens=2, timeout=20).usage),
    "http-chat": ("apply_chat_template",
                  lambda c, a: a.chat.completions.create(model="", messages=[{"role": "user", "content": MARKER}],
                                                         max_tokens=2).usage,
                  lambda c, a: a.completions.create(model="", prompt=IDS, max_tokens=2, timeout=20).usage),
}


@pytest.mark.parametrize("case", sorted(SLOW_CALLS))
def test_tokenizing_never_holds_up_other_requests(case, grpc_client, api, frontend):
    """While the router tokenizes (or renders the chat template of) one request, for as long as that
    takes, a request that needs no tokenizing is served: the tokenizer runs off the event loop."""
    method, slow_call, plain_call = SLOW_CALLS[case]
    with held_tokenizer(frontend, method, MARKER) as held, concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(slow_call, grpc_client, api)
        assert held.holding.wait(30), "the slow request never reached the tokenizer"
        assert plain_call(grpc_client, api)  # served while the slow one is still being tokenized ...
        assert not slow.done()
        held.release.set()
        assert slow.result(timeout=30)  # ... which completes once its tokenizing does


# --- request size -------------------------------------------------------------------------------------
LIMIT = 16 * 2**20  # server.max_request_bytes, by default
TOO_LARGE = {"error": {"message": f"the request body is larger than {LIMIT} bytes, the most this server takes "
                                  "(server.max_request_bytes)", "type": "invalid_request_error", "param": None,
                       "code": "request_too_large"}}


def answer_to_a_body_never_finished(cluster: Cluster, framing: str) -> tuple[int, dict]:
    """POST /v1/completions with a body that is never sent whole: 64 KiB of the 64 MiB its Content-Length
    declares, or 17 MiB of chunks without the last one. The answer, which must come all the same."""
    host, port = cluster.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Authorization", f"Bearer {TOKEN}")
        connection.putheader("Content-Type", "application/json")
        if framing == "content-length":
            connection.putheader("Content-Length", str(64 * 2**20))
            connection.endheaders(b'{"prompt": "' + b"x" * 2**16)
        else:
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            chunk = b"x" * 2**20
            for _ in range(17):
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_requests_past_the_size_limit_are_refused_unread(cluster, grpc_client, api):
    """A 64 MiB /v1/completions body once got no answer within 60 s. Past the limit a body now gets 413
    in OpenAI's format before the rest of it is sent: at once when its Content-Length says it is too
    large, else once the limit's worth has come. gRPC messages are bounded alike."""
    for framing in ("content-length", "chunked"):
        assert answer_to_a_body_never_finished(cluster, framing) == (413, TOO_LARGE), framing
    with pytest.raises(openai.APIStatusError) as e:  # 30 MiB of text, from OpenAI's client
        api.completions.create(model="", prompt=HUGE_TEXT * 2, max_tokens=1)
    assert (e.value.status_code, e.value.response.json()) == (413, TOO_LARGE)

    channel = grpc.insecure_channel(cluster.address, options=[("grpc.max_send_message_length", 64 * 2**20)])
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(pdserve_pb2_grpc.PDServeStub(channel).Generate(pb.GenerateRequest(text="x" * (LIMIT + 1)), timeout=20,
                                                                 metadata=[("authorization", f"Bearer {TOKEN}")]))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()
    assert len(grpc_client.generate(IDS, max_tokens=2).token_ids) == 2  # and the server serves on


def test_a_call_without_the_token_is_refused_before_its_message_is_read(cluster):
    """gRPC reads a unary call's whole message before its handler runs, and a stranger's calls were
    refused by such a handler: each made the router buffer up to 16 MiB first. A call that never sends
    its message is now refused at once (it used to wait for the message until its deadline); with the
    token, the same call waits for its message as every call does."""
    release = threading.Event()

    def never_sent() -> Iterator[bytes]:  # a call whose message is still coming
        release.wait(30)
        yield b""

    with grpc.insecure_channel(cluster.address) as channel:
        for method in ("/pdserve.v1.PDServe/Generate", "/pdserve.v1.PDServe/Tokenize"):
            call = channel.stream_stream(method)
            with pytest.raises(grpc.RpcError) as e:
                list(call(never_sent(), timeout=20))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, e.value)
        with pytest.raises(grpc.RpcError) as e:
            list(channel.stream_stream("/pdserve.v1.PDServe/Tokenize")(
                never_sent(), timeout=2, metadata=[("authorization", f"Bearer {TOKEN}")]))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()


def test_a_body_that_stops_coming_is_answered_408(cluster, monkeypatch):
    """Headers, then a body that never came all: the connection was held for good, and the HTTP API caps
    its connections. The body now has `BODY_TIMEOUT_S` to come (60 s; here 1 s)."""
    monkeypatch.setattr(http_api, "BODY_TIMEOUT_S", 1.0)
    host, port = cluster.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in (("Authorization", f"Bearer {TOKEN}"), ("Content-Type", "application/json"),
                            ("Content-Length", "100")):
            connection.putheader(name, value)
        connection.endheaders(b'{"prompt": ')
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())["error"]["code"]) == (408, "request_timeout")
    finally:
        connection.close()


def post(cluster: Cluster, body: bytes, headers: dict[str, str] | None = None,
         path: str = "/v1/completions") -> tuple[int, dict]:
    host, port = cluster.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body, {"Authorization": f"Bearer {TOKEN}",
                                                "Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_body_of_many_bad_values_gets_a_short_answer(cluster, grpc_client):
    """Validation made an error of every bad element of a list, once per type a field may take, and the
    answer (and the log) joined them all: 300 KB of `{}` in a prompt took 2.4 s of the event loop and a
    17 MB message. It now stops at a list's first bad element and names the first three problems."""
    cases = {"prompt": ("/v1/completions", {"prompt": [{}] * 500_000}),
             "stop_token_ids": ("/v1/completions", {"prompt": IDS, "stop_token_ids": ["x"] * 500_000}),
             "logit_bias": ("/v1/completions", {"prompt": IDS, "logit_bias": {f"{i}": "x" for i in range(100_000)}}),
             "messages": ("/v1/chat/completions", {"messages": [{"role": "robot"}] * 100_000})}
    for name, (path, body) in cases.items():
        status, reply = post(cluster, json.dumps({"max_tokens": 1, **body}).encode(), path=path)
        assert status == 400 and len(reply["error"]["message"]) < 500, (name, status, str(reply)[:500])
        assert reply["error"]["param"].startswith(name), (name, reply)
    status, reply = post(cluster, json.dumps({"prompt": [[1, "x"] * 100_000], "max_tokens": 1}).encode())
    assert status == 400 and reply["error"]["message"].endswith("(and 1 more)"), reply
    assert len(grpc_client.generate(IDS, max_tokens=2).token_ids) == 2


def test_a_request_id_is_bounded(grpc_client, cluster):
    """A client's request id is echoed in every response and logged: an 8 MiB one went into each."""
    message = refusal(lambda: grpc_client.generate(IDS, max_tokens=1, request_id="r" * 300))
    assert message == "request_id may have at most 256 characters, got 300", message
    status, reply = post(cluster, json.dumps({"prompt": IDS, "max_tokens": 1}).encode(), {"x-request-id": "r" * 300})
    assert status == 400 and reply["error"]["param"] == "request_id", reply
    assert grpc_client.generate(IDS, max_tokens=1, request_id="r" * 256).request_id == "r" * 256


# --- sampling parameters ----------------------------------------------------------------------------
def test_sampling_parameters_past_their_bounds_are_refused(grpc_client, api):
    """A million stop strings and two million stop token ids once went through, and slowed every engine
    step of every request batched with them. The refusals name the parameter and its bound, never the
    client's values."""
    too_many = {
        "stop holds 1000000 strings; at most 64 are allowed": {"stop": ["x"] * 1_000_000},
        "stop_token_ids holds 2000000 ids; at most 1024 are allowed": {"stop_token_ids": [7] * 2_000_000},
        "stop strings may have at most 1024 characters; the one at index 0 has 100000": {"stop": ["x" * 100_000]},
    }
    for expected, params in too_many.items():
        grpc_message = refusal(lambda: grpc_client.generate(IDS, max_tokens=2, **params))
        http_message = refusal(lambda: api.completions.create(
            model="", prompt=IDS, max_tokens=2, stop=params.get("stop"),
            extra_body={"stop_token_ids": params.get("stop_token_ids")}))
        for message in (grpc_message, http_message):
            assert expected in message and len(message) < 200, message
    at_bounds = {"stop": ["\U0001F600" * 1024] * 64, "stop_token_ids": list(range(10**6, 10**6 + 1024))}
    assert len(grpc_client.generate(IDS, max_tokens=2, ignore_eos=True, **at_bounds).token_ids) == 2
    assert api.completions.create(model="", prompt=IDS, max_tokens=2, stop=at_bounds["stop"],
                                  extra_body={"stop_token_ids": at_bounds["stop_token_ids"],
                                              "ignore_eos": True}).usage.completion_tokens == 2


# --- the SDK --------------------------------------------------------------------------------------------
LONE_SURROGATE = "ab\ud800c"  # a str Python holds, but no UTF-8 (which protobuf sends) can


def test_text_the_sdk_cannot_send_is_its_invalid_argument(cluster):
    """A lone surrogate in any text a client method takes is InvalidArgument naming the argument (it
    was a raw UnicodeEncodeError), and the client goes on serving."""
    calls = [  # (the argument named, a call passing the text in it)
        ("prompt", lambda c: c.generate(LONE_SURROGATE)),
        ("stop", lambda c: c.generate(IDS, stop=["ok", LONE_SURROGATE])),
        ("model", lambda c: c.generate(IDS, model=LONE_SURROGATE)),
        ("request_id", lambda c: c.generate(IDS, request_id=LONE_SURROGATE)),
        ("text", lambda c: c.tokenize(LONE_SURROGATE)), ("model", lambda c: c.tokenize("ok", model=LONE_SURROGATE)),
    ]
    expected = r"is not valid text: the character at index 2 \('\\ud800'\) has no UTF-8 form"
    with Client(cluster.address, timeout=30, token=TOKEN) as client:
        for name, call in calls:
            with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {name} {expected}"):
                call(client)
        with pytest.raises(InvalidArgument, match=expected):
            next(client.generate(LONE_SURROGATE, stream=True))
        assert len(client.generate(IDS, max_tokens=2).token_ids) == 2

    async def over_asyncio() -> None:
        async with AsyncClient(cluster.address, timeout=30, token=TOKEN) as client:
            for name, call in calls:
                with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {name} {expected}"):
                    await call(client)
            with pytest.raises(InvalidArgument, match=expected):
                await anext(client.generate_stream(LONE_SURROGATE))
            assert len((await client.generate(IDS, max_tokens=2)).token_ids) == 2

    asyncio.run(over_asyncio())


def token_warnings(work: Callable[[], object]) -> list[warnings.WarningMessage]:
    """The InsecureTokenWarnings `work` gives, every one of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        work()
    return [w for w in caught if issubclass(w.category, InsecureTokenWarning)]


def make_clients(client_type: type, targets: list[str], **kwargs: object) -> None:
    """Make a client with the token for each target, and close it."""
    if client_type is Client:
        for target in targets:
            Client(target, token=TOKEN, **kwargs).close()
        return

    async def make() -> None:
        for target in targets:
            await AsyncClient(target, token=TOKEN, **kwargs).close()
    asyncio.run(make())


def test_a_token_in_clear_text_off_this_machine_is_warned_of_once_per_client(cluster):
    """Without TLS the token crosses the network readable by anyone on the path: a client whose target
    is not this machine warns once, where it is made. Loopback, Unix sockets and TLS channels do not."""
    ca = pytest.importorskip("trustme").CA().cert_pem.bytes()
    remote = ["203.0.113.7:50051", "router.example.org:50051", "dns:///10.1.2.3:50051", "ipv4:127.0.0.1:1,10.0.0.1:2"]
    port = cluster.address.rsplit(":", 1)[1]
    local = [cluster.address, f"localhost:{port}", f"[::1]:{port}", f"dns:///127.0.0.1:{port}", "unix:/tmp/pdserve.sock"]

    for client_type in (Client, AsyncClient):
        warned = token_warnings(lambda: make_clients(client_type, remote))
        assert len(warned) == len(remote)
        assert all(target in str(w.message) and "clear text" in str(w.message) for target, w in zip(remote, warned))
        assert {w.filename for w in warned} == {__file__}  # pointing at the line that made the client
        assert token_warnings(lambda: make_clients(client_type, local)) == []
        assert token_warnings(lambda: make_clients(client_type, remote, root_certificates=ca)) == []
    assert token_warnings(lambda: Client(remote[0]).close()) == []  # no token, nothing to warn of

    def one_client_many_calls() -> None:
        with Client(remote[0], token=TOKEN, timeout=0.5) as client:
            for _ in range(3):
                with pytest.raises(PDServeError):  # nothing listens there
                    client.model_info()
    assert len(token_warnings(one_client_many_calls)) == 1

    def real_calls_over_loopback() -> None:
        with Client(cluster.address, token=TOKEN, timeout=30) as client:
            assert len(client.generate(IDS, max_tokens=2).token_ids) == 2
    assert token_warnings(real_calls_over_loopback) == []
