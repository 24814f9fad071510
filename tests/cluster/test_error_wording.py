"""One error, one wording: a refusal reads the same through the SDK (gRPC) and the OpenAI client
(HTTP), and the HTTP error names the request field at fault in OpenAI's `param`. Output past the
context is refused (as vLLM refuses it), not cut short; a request that sets no length gets what the
context leaves. The model is served under its served-model name, and a request naming another model
is refused in OpenAI's model_not_found shape. One real colocated cluster (the cheapest real setup)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from cluster_helpers import manifest

from pdserve.client import Client, InvalidArgument, NotFound, PDServeError
from pdserve.cluster.launcher import Cluster

ARCH = "tiny-llama"
SERVED = "team-model"
CONTEXT = 512  # the test manifest's max_model_len


@pytest.fixture(scope="module")
def cluster(model_dirs) -> Iterator[Cluster]:
    pools = {"prefill": {"replicas": 0}, "decode": {"num_cpus": 0.5}}
    c = Cluster(manifest(model_dirs[ARCH], "colocated", pools=pools, served_model_name=SERVED), log=lambda _: None)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def sdk(cluster) -> Iterator[Client]:
    with Client(cluster.address, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def api(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0, timeout=60)


def grpc_refusal(sdk: Client, prompt, **params) -> PDServeError:
    with pytest.raises(PDServeError) as e:
        sdk.generate(prompt, **params)
    return e.value


def http_refusal(api: openai.OpenAI, prompt, model: str = SERVED, **params) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        api.completions.create(model=model, prompt=prompt, **params)
    return e.value


def test_max_tokens_past_the_context_is_refused_in_the_same_words(sdk, api):
    prompt = [5] * 500
    grpc_error = grpc_refusal(sdk, prompt, max_tokens=20)
    http_error = http_refusal(api, prompt, max_tokens=20)
    assert isinstance(grpc_error, InvalidArgument)
    assert grpc_error.message == ("max_tokens is 20 but the prompt has 500 tokens and the context limit is 512 "
                                  "(max_model_len): at most 12 tokens can be generated; ask for 12 or fewer, or "
                                  "shorten the prompt")
    assert http_error.status_code == 400
    assert http_error.body == {"message": grpc_error.message, "type": "invalid_request_error", "param": "max_tokens",
                               "code": "invalid_argument"}
    # Exactly what the context leaves is served in full.
    whole = api.completions.create(model=SERVED, prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"


def test_chat_names_the_field_that_asked_for_too_much(api):
    messages = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model=SERVED, messages=messages, **{field: CONTEXT})
        assert e.value.body["param"] == field
        assert e.value.body["message"].startswith(f"{field} is {CONTEXT} but the prompt has ")


def test_a_request_that_sets_no_length_gets_what_the_context_leaves(sdk, api):
    prompt = [5] * (CONTEXT - 4)  # room for 4 tokens: less than the default 16
    assert len(sdk.generate(prompt, temperature=0, ignore_eos=True).token_ids) == 4
    assert api.completions.create(model=SERVED, prompt=prompt, temperature=0,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 4


@pytest.mark.parametrize(("prompt", "params", "param"), [
    ("hello", {"temperature": -1.0}, "temperature"),
    ("hello", {"top_p": 1.5}, "top_p"),
    ("hello", {"stop": [""]}, "stop"),
    ([5] * 600, {}, "prompt"),
    ([5, 99999], {}, "prompt"),
])
def test_a_bad_value_reads_the_same_through_both_apis(sdk, api, prompt, params, param):
    grpc_error = grpc_refusal(sdk, prompt, max_tokens=2, **params)
    http_error = http_refusal(api, prompt, max_tokens=2, **params)
    assert isinstance(grpc_error, InvalidArgument), grpc_error
    assert http_error.status_code == 400
    assert (http_error.body["message"], http_error.body["param"]) == (grpc_error.message, param)


def test_the_model_is_served_under_its_served_name(cluster, sdk, api):
    assert [m.id for m in api.models.list().data] == [SERVED]
    assert sdk.model_info().name == SERVED
    reply = api.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    assert reply.model == SERVED
    assert api.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2).model == SERVED


def test_a_request_naming_another_model_is_refused_as_openai_refuses_it(cluster, sdk, api):
    path = cluster.manifest.model  # the directory's path is not the model's name
    http_error = http_refusal(api, "hi", model=path, max_tokens=2)
    assert isinstance(http_error, openai.NotFoundError)
    assert http_error.body == {"message": f"unknown model {path!r}; this server serves {SERVED!r}",
                               "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    grpc_error = grpc_refusal(sdk, "hi", model=path, max_tokens=2)
    assert isinstance(grpc_error, NotFound) and grpc_error.message == http_error.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve(path)
    assert api.models.retrieve(SERVED).id == SERVED
