"""The OpenAI-compatible HTTP API, spoken to by the real `openai` client against a running cluster:
completions and chat (whole and streamed), stop strings, seeds, usage, errors with their status codes,
exact greedy equality with the gRPC path; the Prometheus endpoint parsed with prometheus-client's own
parser; lifetime events in responses and log lines."""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import ray
from cluster_helpers import (assert_aborted, assert_idle, manifest, on_worker, record_engine_aborts, wait_clean_audit,
                             worker)
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client, Unauthenticated, Unavailable
from pdserve.cluster.launcher import Cluster
from pdserve.engine.model_loader import load_tokenizer
from pdserve.wire import LifetimeEvent

ARCH = "tiny-llama"
TOKEN = "s3cret-token"
PROMPT = [17, 291, 45, 8, 733, 102, 56, 9, 400, 12, 88, 300]
# A disaggregated request's whole lifetime: every event but a retry's, a move's and the handoff notice
# (which is not logged).
# The events of a text-only request that is neither retried nor moved.
LIFETIME = set(LifetimeEvent) - {LifetimeEvent.RETRY, LifetimeEvent.MIGRATED, LifetimeEvent.HANDOFF_COMMITTED,
                                 LifetimeEvent.ENCODED}


@pytest.fixture(scope="module")
def cluster(model_dirs):
    c = Cluster(manifest(model_dirs[ARCH], server={"auth_token": TOKEN}), log=lambda _: None)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def api(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.address, timeout=60, token=TOKEN) as client:
        yield client


@pytest.fixture(scope="module")
def model(cluster):
    return cluster.manifest.served_name


def call(url: str, body: bytes | None = None, headers: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """One plain HTTP request (the standard library's client): status and body, errors included."""
    request = urllib.request.Request(url, body, headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(cluster) -> dict[str, list]:
    """Every metric family on /metrics, by name, parsed by prometheus-client's parser."""
    status, text = call(f"http://{cluster.http_address}/metrics")
    assert status == 200
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def value(families: dict[str, list], sample: str, **labels: str) -> float:
    """The sum of `sample` over the series whose labels include `labels`."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
    return sum(s.value for s in families.get(family, []) if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_greedy_completion_equals_the_grpc_path_whole_and_streamed(api, grpc_client, model, hf_reference):
    expected = hf_reference[ARCH].greedy(PROMPT, 12)
    ref = grpc_client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert ref.token_ids == expected
    whole = api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(PROMPT), 12)
    chunks = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_text_prompts_and_logprobs_match_the_grpc_path(api, grpc_client, model):
    text = "Tuvo pase lorem the of and"
    ref = grpc_client.generate(text, max_tokens=8, temperature=0, logprobs=True)
    got = api.completions.create(model=model, prompt=text, max_tokens=8, temperature=0, logprobs=0)
    assert got.choices[0].text == ref.text
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs)
    assert len(got.choices[0].logprobs.tokens) == len(ref.token_ids)


def test_chat_renders_the_template_and_equals_the_grpc_path(api, grpc_client, model, model_dirs):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]
    rendered = load_tokenizer(model_dirs[ARCH]).apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)
    ref = grpc_client.generate(rendered, max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    whole = api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                        logprobs=True, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(ref.logprobs)
    assert whole.usage.prompt_tokens == ref.prompt_tokens
    chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_say_stop(api, grpc_client, model):
    full = grpc_client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the greedy text has no usable middle"
    for stream in (False, True):
        if stream:
            chunks = list(api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                                 stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = api.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == full[: full.index(stop)] and reason == "stop"


def test_seeded_sampling_is_reproducible_and_equals_the_grpc_path(api, grpc_client, model):
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    ref = grpc_client.generate(PROMPT, ignore_eos=True, **params)
    runs = [api.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True}, **params)
            for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text == ref.text
    other = api.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True},
                                   **(params | {"seed": 99}))
    assert other.choices[0].text != ref.text


def test_usage_counts_cached_prompt_tokens(api, model):
    prompt = [(7 * i) % 900 + 3 for i in range(80)]
    first = api.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = api.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # full blocks of the prompt, cached by the first
    details = again.usage.completion_tokens_details  # speculative decoding's drafts: off in this cluster
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_errors_carry_openai_status_codes(api, cluster, model):
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        api.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    for bad in ({"temperature": -1}, {"n": 2}, {"top_p": 0}, {"logprobs": 5}, {"max_tokens": 0}):
        with pytest.raises(openai.BadRequestError) as e:
            api.completions.create(model=model, prompt="hi", **bad)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error", bad
    with pytest.raises(openai.BadRequestError, match="context limit"):
        api.completions.create(model=model, prompt=[5] * 600, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="proposer must be one of suffix, draft_model") as e:
        api.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"proposer": "medusa"})
    assert e.value.body["param"] == "proposer"
    wrong_key = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.completions.create(model=model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    status, body = call(f"http://{cluster.http_address}/v1/nothing-here", b"{}")
    assert status == 404 and "error" in json.loads(body)
    status, body = call(f"http://{cluster.http_address}/v1/completions", b"{not json",
                        {"authorization": f"Bearer {TOKEN}"})
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert [m.id for m in api.models.list().data] == [model]
    assert api.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as e:  # a huge name is not echoed whole
        api.models.retrieve("m" * 5000)
    assert "(5000 characters)" in str(e.value) and len(str(e.value)) < 1000
    with pytest.raises(openai.BadRequestError, match="response_format"):
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    response_format={"type": "json_object"})


def test_vllm_extensions_that_change_the_output_are_refused_unless_neutral(api, model):
    chat = [{"role": "user", "content": "hi"}]
    for extra in ({"repetition_penalty": 1.3}, {"min_tokens": 20}, {"guided_json": {"type": "object"}},
                  {"chat_template": "{{ messages }}"}):
        with pytest.raises(openai.BadRequestError, match=f"{next(iter(extra))} is not supported"):
            api.chat.completions.create(model=model, messages=chat, max_tokens=2, extra_body=extra)
    neutral = {"repetition_penalty": 1.0, "min_tokens": 3, "skip_special_tokens": True, "top_k": -1,
               "chat_template_kwargs": None}
    reply = api.chat.completions.create(model=model, messages=chat, max_tokens=2, max_completion_tokens=3,
                                        extra_body={**neutral, "ignore_eos": True})
    assert reply.usage.completion_tokens == 3  # max_completion_tokens wins, as OpenAI's and vLLM's
    # (min_tokens too is neutral here: with ignore_eos and no stop, nothing ends the output early)
    image = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError, match="model 'tiny-llama' takes no images"):
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": image}], max_tokens=2)


def test_a_bug_in_the_router_still_answers_in_openai_s_format(api, model, monkeypatch):
    from pdserve.router import http_api

    def broken(*args, **kwargs):
        raise RuntimeError("an unexpected fault")

    monkeypatch.setattr(http_api._CompletionFormat, "whole", broken)
    monkeypatch.setattr(http_api._CompletionFormat, "chunk", broken)
    with pytest.raises(openai.InternalServerError, match="a bug in the router.*an unexpected fault") as e:
        api.with_options(max_retries=0).completions.create(model=model, prompt="hi", max_tokens=2)
    assert e.value.status_code == 500
    with pytest.raises(openai.APIError, match="an unexpected fault"):  # an error event, then [DONE]
        list(api.completions.create(model=model, prompt="hi", max_tokens=2, stream=True))


def test_null_means_the_default_and_the_auth_scheme_is_case_insensitive(cluster, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None,
            "presence_penalty": None, "logprobs": None, "ignore_eos": None, "stop": None}
    status, raw = call(f"http://{cluster.http_address}/v1/completions", json.dumps(body).encode(),
                       {"authorization": f"bearer {TOKEN}", "content-type": "application/json"})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] >= 1


def test_the_http_listener_sends_small_events_at_once_and_a_taken_port_is_a_clear_error():
    import socket

    from pdserve.router.server import _listen

    taken = _listen("127.0.0.1", 0, "127.0.0.1:0")
    port = taken.getsockname()[1]
    try:
        # No Nagle: each SSE event leaves at once (with it, a reused connection waited ~40 ms per event).
        assert taken.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        with pytest.raises(OSError, match=f"cannot listen on http_address 127.0.0.1:{port}"):
            _listen("127.0.0.1", port, f"127.0.0.1:{port}")
    finally:
        taken.close()


def test_a_client_that_goes_away_mid_stream_stops_the_request_and_frees_its_kv(cluster, model, caplog):
    for w in cluster.workers:
        on_worker(w, record_engine_aborts)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    host, port = cluster.http_address.rsplit(":", 1)
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            for _ in range(100):  # bounded: the first event comes within a few lines
                if response.readline().startswith(b"data:"):
                    break  # the first token arrived: hang up
            else:
                pytest.fail("no event in the stream")
        finally:
            conn.close()
        assert_aborted(cluster, caplog, "CANCELLED", 400)


def test_a_client_that_hangs_up_before_a_whole_answer_cancels_it(cluster, model, caplog):
    for w in cluster.workers:
        on_worker(w, record_engine_aborts)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    host, port = cluster.http_address.rsplit(":", 1)
    decode = [w for w in cluster.workers if w.pool == "decode"]
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
        deadline = time.monotonic() + 30
        while not any(on_worker(w, lambda self: len(self.engine.requests)) for w in decode):  # it is decoding now
            assert time.monotonic() < deadline, "the request never reached a decode worker"
            time.sleep(0.02)
        conn.close()
        assert_aborted(cluster, caplog, "CANCELLED", 480)


def test_lifetime_events_in_the_response_and_the_log(api, grpc_client, model, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"):
        r = api.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
        ref = grpc_client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    events = r.timings["events"]
    assert set(events) == LIFETIME == set(ref.events)
    for before, after in [("accepted", "routed"), ("routed", "prefill_queued"), ("prefill_queued", "prefill_start"),
                          ("prefill_start", "prefill_end"), ("prefill_end", "first_token"),
                          ("prefill_start", "kv_reserved"), ("kv_reserved", "transfer_end"),
                          ("transfer_start", "transfer_end"), ("prefill_end", "transfer_end"),
                          ("transfer_end", "decode_start"), ("decode_start", "decode_end"),
                          ("decode_end", "finished"), ("first_token", "finished")]:
        assert events[before] <= events[after], (before, after, events)
    assert r.timings["ttft_s"] == pytest.approx(events["first_token"] - events["accepted"])
    records = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "pdserve.lifetime"]
    mine = [x for x in records if x["request_id"] == r.id.removeprefix("cmpl-")]
    assert len(mine) == 1 and mine[0]["code"] == "OK" and mine[0]["api"] == "http"
    assert mine[0]["output_tokens"] == 6 and set(mine[0]["events_ms"]) == LIFETIME
    assert any(x["api"] == "grpc" and x["request_id"] == ref.server_request_id for x in records)


def test_metrics_families_and_counts_agree_with_what_was_served(cluster, api, grpc_client, model):
    # Workers' figures arrive with their health reports: an idle audit vouches for reports made at idle.
    wait_clean_audit(cluster)
    before = scrape(cluster)
    completed = [api.completions.create(model=model, prompt=PROMPT[:n], max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True}) for n in (5, 9, 12)]
    grpc_client.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x", max_tokens=1)
    wait_clean_audit(cluster)
    after = scrape(cluster)

    for family in ("pdserve_time_to_first_token_seconds", "pdserve_time_per_output_token_seconds",
                   "pdserve_e2e_request_latency_seconds", "pdserve_requests", "pdserve_queue_depth",
                   "pdserve_running_requests", "pdserve_kv_blocks", "pdserve_prefix_cache_hit_rate",
                   "pdserve_prefix_cache_queried_blocks", "pdserve_prompt_cached_tokens", "pdserve_kv_transfer_bytes",
                   "pdserve_kv_transfer_duration_seconds", "pdserve_kv_transfers", "pdserve_router_decisions",
                   "pdserve_generation_tokens", "pdserve_worker_healthy"):
        assert after.get(family), f"{family} missing from /metrics"

    def delta(sample, **labels):
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert delta("pdserve_requests_total", api="http", code="OK") == 3
    assert delta("pdserve_requests_total", api="grpc", code="OK") == 1
    assert delta("pdserve_requests_total", api="http", code="NOT_FOUND") == 1
    assert delta("pdserve_time_to_first_token_seconds_count", api="http") == 3
    assert delta("pdserve_generation_tokens_total", api="http") == sum(c.usage.completion_tokens for c in completed)
    assert delta("pdserve_prompt_tokens_total") == 5 + 9 + 12 + len(PROMPT)
    assert delta("pdserve_router_decisions_total", pool="decode") == 4
    assert delta("pdserve_kv_transfers_total", transport="shm", codec="raw", outcome="success") == 4
    assert delta("pdserve_kv_transfer_duration_seconds_count", transport="shm") == 4
    assert delta("pdserve_kv_transfer_bytes_total", transport="shm") > 0
    blocks = {s.labels["state"]: s.value for s in after["pdserve_kv_blocks"] if s.labels["worker"].startswith("decode")}
    assert blocks["used"] + blocks["free"] > 0 and blocks["cached"] >= 0


# --- a second cluster: overload, an unhealthy pool, TLS on both APIs, no worker left ---------------------
@pytest.fixture(scope="module")
def tls_cluster(model_dirs, tmp_path_factory):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    d = tmp_path_factory.mktemp("http-tls")
    cert.private_key_pem.write_to_path(d / "key.pem")
    cert.cert_chain_pems[0].write_to_path(d / "cert.pem")
    ca.cert_pem.write_to_path(d / "ca.pem")
    m = manifest(model_dirs[ARCH], server={"tls_cert": str(d / "cert.pem"), "tls_key": str(d / "key.pem"),
                                           "auth_token": TOKEN}, router={"max_active_decodes": 1})
    c = Cluster(m, log=lambda _: None)
    c.start()
    yield c, str(d / "ca.pem")
    c.stop()


def test_https_overload_is_429_with_retry_after_and_a_dead_pool_is_503(tls_cluster, model_dirs):
    cluster, ca = tls_cluster
    base = f"https://{cluster.http_address}"
    api = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0,
                        http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)))
    model = cluster.manifest.served_name
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0).usage.completion_tokens

    long_stream = api.completions.create(model=model, prompt=PROMPT, max_tokens=480, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    next(iter(long_stream))  # it holds the decode pool's one admission slot now
    with pytest.raises(openai.RateLimitError) as e:
        api.completions.create(model=model, prompt=PROMPT, max_tokens=3)
    headers = e.value.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
    long_stream.close()

    decode = worker(cluster, "decode")  # the pool's only worker dies; Ray restarts it
    ray.kill(decode.handle, no_restart=False)
    assert wait_until(lambda: not decode.healthy, 10), "the supervisor never noticed the kill"
    with pytest.raises(openai.InternalServerError) as e:  # the restart waits out a back-off of 1 s at least
        api.completions.create(model=model, prompt=PROMPT, max_tokens=3)
    assert e.value.status_code == 503 and "no healthy worker" in e.value.message
    assert call(f"{base}/health", context=ssl.create_default_context(cafile=ca))[0] == 503
    assert wait_until(lambda: decode.healthy, 90), "the restarted worker never rejoined"
    assert call(f"{base}/health", context=ssl.create_default_context(cafile=ca))[0] == 200
    assert_idle(cluster)


def test_grpc_over_tls_asks_for_the_token_and_a_cluster_without_workers_refuses_at_once(tls_cluster):
    """The gRPC API behind TLS and a token; then both workers stopped for good (the last test on this
    cluster): with the prefill pool gone the decode worker prefills, with both gone every request is
    refused at once."""
    cluster, ca = tls_cluster
    roots = Path(ca).read_bytes()
    with Client(cluster.address, timeout=30, root_certificates=roots) as anonymous, pytest.raises(Unauthenticated):
        anonymous.generate("hello", max_tokens=2)
    with Client(cluster.address, timeout=5) as plaintext, pytest.raises(Unavailable):
        plaintext.generate("hello", max_tokens=2)  # the server speaks TLS only
    with Client(cluster.address, timeout=30, token=TOKEN, root_certificates=roots) as client:
        assert len(client.generate("hello", max_tokens=2, ignore_eos=True).token_ids) == 2
        by_pool = {w.pool: w for w in cluster.workers}
        for pool in ("prefill", "decode"):
            ray.kill(by_pool[pool].handle)
            deadline = time.time() + 5
            while by_pool[pool].healthy and time.time() < deadline:  # the cluster supervisor notices
                time.sleep(0.05)
            if pool == "prefill":  # with no prefill worker left, the decode worker prefills
                reply = client.generate("hello " * 60, max_tokens=2, ignore_eos=True)
                assert len(reply.token_ids) == 2 and "transfer_start" not in reply.events
                assert cluster.router_stack.server.serving()  # health checks do not drain a cluster that serves
        assert not cluster.router_stack.server.serving()
        # Refused at once: a request waiting for a worker would end in DEADLINE_EXCEEDED instead.
        with pytest.raises(Unavailable, match="no healthy worker in the decode pool"):
            client.generate("hello", max_tokens=2)
