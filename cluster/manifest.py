"""Deployment manifests: YAML, validated in full before anything starts.

Errors name the field (`pools.decode.replicas`) and the problem. `deploy/local.yaml` is the
embedded default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from pdserve.client import MAX_MESSAGE_BYTES
from pdserve.deadlines import Deadlines, HealthDeadlines, KVDeadlines
from pdserve.engine.multimodal.images import ImageLimits
from pdserve.router.http_connections import MAX_CONNECTIONS
from pdserve.router.image_urls import ImageFetch
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.diagnostics import LogLevel
from pdserve.cluster.overrides import ManifestOverrides
from pdserve.faults import FaultSettings

DEFAULT_MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "local.yaml"


class _Strict(BaseModel):
    # A misspelt field is an error, not silently ignored; NaN and infinity are no numbers here.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PoolSpec(_Strict):
    """One pool of workers: how many, and the Ray resources each one takes."""

    replicas: int = Field(1, ge=0, le=64, description="Workers in this pool (in colocated mode, colocated workers).")
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each worker.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each worker; above 0 the worker's engine "
                                                   "runs on CUDA.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each worker asks for, e.g. `{prefill: 1}`, so Ray "
                                          "places the pool on nodes that offer them.")
    threads: int = Field(1, ge=1, le=256, description="Torch intra-op threads per worker.")
    max_restarts: int = Field(3, ge=0, description="How often Ray restarts a worker that died or reported a fault.")

    @field_validator("resources")
    @classmethod
    def _ray_can_place(cls, v: dict[str, float]) -> dict[str, float]:
        # What Ray would refuse only once the cluster runs, without naming the field.
        for name, amount in v.items():
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"{name!r} is Ray's own resource: set num_cpus / num_gpus instead")
            if amount < 0 or (amount > 1 and amount != int(amount)) or round(amount, 4) != amount:
                raise ValueError(f"{name}: {amount} is not an amount Ray places (>= 0; a fraction of at most "
                                 f"4 decimals up to 1, a whole number above)")
        return v


class Pools(_Strict):
    """The pools of workers: prefill and decode, and for a vision-language model, encode."""

    prefill: PoolSpec = Field(PoolSpec(), description="The workers that run prompt passes and send their KV.")
    decode: PoolSpec = Field(PoolSpec(), description="The workers that receive the KV and generate the output.")
    encode: PoolSpec = Field(
        PoolSpec(replicas=0), description="A vision-language model's encode workers (EPD): they run only its vision "
                                          "tower and projector, and hand the embeddings to the prompt pass; 0 "
                                          "replicas: the worker that runs the prompt pass encodes its images.")


PolicyName = Literal["round_robin", "least_loaded", "cache_aware", "kv_cost", "estimated_ttft"]
# Policy names that were renamed: a manifest that still says one is refused with the new name.
RENAMED_POLICIES = {"pdserve": "estimated_ttft"}
CODECS = ("raw", "int8", "fp8", "cachegen")  # kv_transfer.codecs.CODEC_NAMES (a test holds them alike)


class CacheAwareSpec(_Strict):
    """SGLang router's thresholds, with the defaults its README documents (later sgl-router releases
    changed them; set them here to match the one you compare with)."""

    balance_abs: int = Field(32, ge=0, description="The load is out of balance when the busiest worker holds this "
                                                   "many more requests than the idlest ...")
    balance_rel: float = Field(1.0001, ge=1.0, description="... and more than this many times the idlest's.")
    match_threshold: float = Field(0.5, ge=0.0, le=1.0, description="The share of the prompt a worker's cached "
                                                                    "prefix must cover for the prompt to go there.")


class RouterSpec(_Strict):
    """Where each request goes (router/policies), what is refused at once, and how often a request is
    tried again."""

    policy: PolicyName = Field("estimated_ttft", description="The placement policy of both pools, unless a pool's "
                                                             "own is set.")
    prefill_policy: PolicyName | None = Field(None, description="The prefill pool's policy; null: `policy`.")
    decode_policy: PolicyName | None = Field(None, description="The decode pool's policy; null: `policy`.")
    cache_aware: CacheAwareSpec = Field(CacheAwareSpec(), description="The `cache_aware` policy's thresholds.")
    kv_overlap_weight: float = Field(1.0, ge=0.0, description="The `kv_cost` policy's weight of the blocks a worker "
                                                              "must prefill.")
    prefix_index: Literal["exact", "approximate"] = Field(
        "exact", description="exact: the workers' KV events feed the global prefix index; approximate: the "
                             "router's own placements do.")
    ttft_slo_s: float | None = Field(
        None, gt=0, description="Early rejection: a request whose best TTFT estimate exceeds `reject_factor` x this "
                                "(seconds) gets RESOURCE_EXHAUSTED at once (needs the estimated_ttft policy); null: "
                                "never.")
    reject_factor: float = Field(2.0, gt=0, description="See `ttft_slo_s`.")
    length_aware: bool | None = Field(
        None, description="Length-aware prefill (LAPS): short prompts in their own queue, batched within a short "
                          "window, long ones chunked; null: on with the estimated_ttft prefill policy.")
    short_prompt_tokens: int | None = Field(
        None, ge=1, description="LAPS: a prompt this long or shorter is short; null: measured on each worker at "
                                "start-up (a prompt whose compute costs no more than a step's fixed cost).")
    short_batch_window_ms: float | None = Field(
        None, ge=0, description="LAPS: how long short prompts wait to share a step; null: one step's fixed cost, "
                                "measured.")
    long_prompt_chunk_tokens: int | None = Field(
        None, ge=1, description="LAPS: the chunk a long prompt is prefilled in; null: half the step budget.")
    local_prefill_tokens: int | None = Field(
        None, ge=0, description="Conditional disaggregation: a prompt whose uncached part is at most this many tokens "
                                "prefills on its decode worker; null: measured with the estimated_ttft prefill policy "
                                "(prefill compute against transfer), else off; 0: off.")
    max_queued_prefills: int = Field(
        64, ge=1, description="Admission control: requests waiting for or in their prompt pass, per prefill worker; "
                              "past it, RESOURCE_EXHAUSTED with a retry-after hint at once.")
    max_active_decodes: int = Field(
        128, ge=1, description="Admission control: requests placed and not finished, per decode or colocated "
                               "worker; past it, RESOURCE_EXHAUSTED with a retry-after hint at once.")
    max_retries: int = Field(
        3, ge=0, description="How often a request that loses a worker (it died, hung, or reported a fault or a "
                             "failed transfer) is tried again (resumed from its streamed tokens after its first); "
                             "past that it fails with UNAVAILABLE naming the cause.")
    retry_wait_s: float = Field(30.0, ge=0, description="How long each retry waits for a healthy worker (seconds).")

    @field_validator("policy", "prefill_policy", "decode_policy", mode="before")
    @classmethod
    def _renamed(cls, v: object) -> object:
        if isinstance(v, str) and v in RENAMED_POLICIES:
            raise ValueError(f"{v!r} is this policy's old name: it is now called {RENAMED_POLICIES[v]!r}")
        return v

    @property
    def pool_policies(self) -> tuple[str, str]:
        return self.prefill_policy or self.policy, self.decode_policy or self.policy

    @property
    def laps(self) -> bool:
        return self.length_aware if self.length_aware is not None else self.pool_policies[0] == "estimated_ttft"


class KVTLSSpec(_Strict):
    """Mutual TLS on the tcp and gRPC KV transports: every worker presents `cert` (PEM, signed by
    `ca`) and accepts only peers whose certificate `ca` signed."""

    cert: Path = Field(description="This worker's certificate (PEM), signed by `ca`.")
    key: Path = Field(description="The private key of `cert` (PEM).")
    ca: Path = Field(description="The CA (PEM) whose certificates peers must present.")

    @field_validator("cert", "key", "ca")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        # Workers read them from their own working directories, on every node at this path. Symlinks
        # are kept: a Kubernetes secret's links lead to a folder named differently on every pod.
        return Path(os.path.abspath(v))

    def missing(self) -> list[Path]:
        return [f for f in (self.cert, self.key, self.ca) if not f.is_file()]


class KVTransferSpec(_Strict):
    """How a prompt's KV moves from its prefill worker to its decode worker."""

    transport: Literal["auto", "shm", "tcp", "grpc", "gloo", "nccl"] = Field(
        "auto", description="auto: shared memory between workers on one node, tcp across nodes; or one of shm, tcp, "
                            "grpc (for networks that pass only HTTP/2), gloo, nccl (GPU pools) for every pair.")
    codec: str | list[str] = Field(
        "raw", description="raw, int8, fp8 or cachegen, or a list offered in this order: each decode worker takes the "
                           "first it can decode (cachegen needs the model's profiled tables: `pdserve kv-profile`), "
                           "else raw.")

    @field_validator("codec")
    @classmethod
    def _known_codecs(cls, v: str | list[str]) -> str | list[str]:
        names = [v] if isinstance(v, str) else v
        if not names:
            raise ValueError("offer at least one codec (raw: uncompressed)")
        unknown = [name for name in names if name not in CODECS]
        if unknown:  # else a decode worker would refuse it and quietly use raw
            raise ValueError(f"unknown codec {', '.join(map(repr, unknown))}: codecs are {', '.join(CODECS)}")
        return v
    host: str | None = Field(None, description="Where KV receivers listen; null: loopback on a local cluster, else "
                                               "each node's own address.")
    tls: KVTLSSpec | None = Field(None, description="Mutual TLS on the tcp and grpc transports; null: off.")
    frame_tokens: int = Field(1536, ge=16, description="Tokens of one layer per frame (CacheGen's context chunk).")
    layerwise_min_tokens: int = Field(
        1024, ge=0, description="Prompt passes of at least this many tokens (computed: the prefill worker's prefix "
                                "cache aside) stream their KV layer by layer beside the pass; a shorter one's is sent "
                                "once it ends (streaming would slow the pass more than it saves); 0: every prompt.")
    lease_s: float = Field(30.0, gt=0, description="A reservation's lease (seconds), extended by every frame that "
                                                   "arrives.")
    reserve_wait_s: float = Field(10.0, ge=0, description="How long a reservation waits for free decode KV blocks "
                                                          "(seconds).")
    reserve_answer_margin_s: float = Field(
        10.0, gt=0, description="How much longer than reserve_wait_s the prefill side waits for a reservation's "
                                "answer before it takes the decode worker for hung (seconds): room for the Ray call "
                                "and a busy decode worker.")
    commit_timeout_s: float | None = Field(
        None, gt=0, description="How long the prefill side waits for a transfer's frames to be delivered before its "
                                "commit (seconds); at most lease_s + 2 (the prefill side's lease, which nothing renews "
                                "meanwhile); null: lease_s.")
    recompute: bool = Field(
        True, description="The decode worker may recompute a prompt's KV from its tokens when that is expected to be "
                          "faster than receiving it (a slow link, a short prompt); false: the KV is always sent.")

    @property
    def codecs(self) -> tuple[str, ...]:
        return (self.codec,) if isinstance(self.codec, str) else tuple(self.codec)

    @property
    def deadlines(self) -> KVDeadlines:
        commit = self.commit_timeout_s if self.commit_timeout_s is not None else self.lease_s
        return KVDeadlines(lease_s=self.lease_s, reserve_wait_s=self.reserve_wait_s, commit_timeout_s=commit,
                           reserve_answer_margin_s=self.reserve_answer_margin_s)

    @model_validator(mode="after")
    def _deadlines_in_order(self) -> "KVTransferSpec":
        self.deadlines  # noqa: B018  raises, naming the timings out of order
        return self

    @model_validator(mode="after")
    def _tls_on_sockets(self) -> "KVTransferSpec":
        if self.tls is not None and self.transport not in ("auto", "tcp", "grpc"):
            raise ValueError(f"tls secures the tcp and grpc transports only (auto uses tcp across nodes); transport "
                             f"{self.transport!r} cannot: remove tls, or choose tcp, grpc or auto")
        return self


class SpeculativeSpec(_Strict):
    """Speculative decoding on the workers that decode: drafts proposed per sequence, verified in one pass."""

    method: Literal["suffix", "draft_model", "both"] = Field(
        "suffix", description="What proposes the draft tokens. suffix: model-free, from earlier occurrences of the "
                              "request's last tokens in its own prompt and output and in recent outputs "
                              "(SuffixDecoding). draft_model: a small model with the target's tokenizer, run on the "
                              "decode worker beside it (`draft_model`). both: the suffix draft where the text repeats "
                              "itself, the draft model's elsewhere.")
    draft_model: str | None = Field(
        None, description="draft_model and both: the draft model, as `model` names one (pystd-llama-draft is the "
                          "shipped model's; `pdserve train-draft` makes one for another Llama trained the same way). "
                          "It must have the target's tokenizer, and be on every decode worker's node (and every "
                          "prefill worker's, with draft_kv: send; a shipped model or preset is; a directory must be "
                          "at the same path on each). Its KV pool holds as many tokens as the target's: memory on "
                          "top of kv_memory_mb, in the ratio of its layers to the target's.")
    draft_kv: Literal["send", "recompute"] = Field(
        "send", description="Disaggregated, with a draft model: where its prompt KV is computed. send: by the prefill "
                            "worker beside the target's, and sent in the same transfer (the prompt pass takes the "
                            "draft's share longer); recompute: by the decode worker, on the request's first drafting "
                            "step (every request decoding beside it waits that long). `pdserve bench draft-kv` "
                            "measures both.")
    max_draft_tokens: int = Field(8, ge=1, le=64, description="Draft tokens per sequence per step at most.")
    max_match: int = Field(16, ge=1, le=256, description="suffix: the longest suffix of a request's tokens matched.")
    max_spec_factor: float = Field(1.0, gt=0, le=64, description="suffix: a draft is at most this many times as "
                                                                 "long as the suffix it matched.")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="A draft ends where its estimated chance of being "
                                                               "accepted whole falls under this.")
    recent_output_tokens: int = Field(65536, ge=0, le=2**24, description="suffix: tokens of recent outputs "
                                                                         "indexed for every request (0: none).")
    goodput_sizing: bool = Field(
        True, description="Each step verifies the draft tokens that raise its goodput (tokens per second), from the "
                          "worker's measured decode-step cost, the proposer's estimates and how each request's drafts "
                          "fared lately: long drafts in small batches, short or none in large ones or where drafts "
                          "keep failing; the draft model runs only while its passes are worth their cost. false: "
                          "every draft whole, the draft model drafting as far as min_token_prob lets it.")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSpec:
        self.engine_config()  # its ValueError (a draft model named or missing) says what is wrong
        return self

    def engine_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(**self.model_dump())


class ImagesSpec(_Strict):
    """Bounds on a request's images (a vision-language model's): the router checks count, bytes and the
    size each image's header declares before placing the request; workers check again as they decode."""

    max_images: int = Field(8, ge=0, le=256, description="Images one request may carry (0: none taken).")
    max_image_bytes: int = Field(8 * 2**20, ge=1, le=2**30, description="Bytes of one encoded image.")
    max_image_pixels: int = Field(4096 * 4096, ge=1, le=2**28, description="Width x height of one image.")
    embedding_cache_mb: int = Field(256, ge=0, description="Each encode worker's cache of recent images' "
                                                           "embeddings, by their pixels (0: none).")
    url_hosts: list[str] = Field(
        default_factory=list, description="Hosts whose http(s) image URLs the chat API fetches: exact host names, "
                                          "`host:port` for a port not the scheme's own; no redirects followed. "
                                          "Empty: only inline data: URLs.")
    url_timeout_s: float = Field(10.0, gt=0, le=120, description="The whole fetch of one image URL.")
    encode_timeout_s: float = Field(
        60.0, gt=0, description="How long the router waits for an encode worker's answer before trying another "
                                "(or leaving the images to the prefill worker).")

    def fetch(self) -> ImageFetch:
        return ImageFetch(frozenset(host.lower() for host in self.url_hosts), self.max_image_bytes, self.url_timeout_s)

    def limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_image_pixels)


class ServerSpec(_Strict):
    """The router's client-facing servers: gRPC, and the OpenAI-compatible HTTP API with /metrics."""

    address: str = Field("127.0.0.1:50051", description="HOST:PORT of the gRPC API (port 0: any free port).")
    http_address: str | None = Field(
        "127.0.0.1:8000", description="HOST:PORT of the OpenAI-compatible HTTP API and Prometheus /metrics; null: "
                                      "off. TLS and the auth token apply to both APIs.")
    tls_cert: Path | None = Field(None, description="The server's certificate (PEM): TLS on both APIs (with "
                                                    "`tls_key`).")
    tls_key: Path | None = Field(None, description="The private key of `tls_cert` (PEM).")
    tls_client_ca: Path | None = Field(
        None, description="Mutual TLS: clients must present a certificate that this CA (PEM) signed, on gRPC and "
                          "HTTPS alike.")
    # A SecretStr: what prints or dumps a manifest (logs, results files) shows ********** (get_secret_value()
    # gives the token).
    auth_token: SecretStr | None = Field(
        None, description="Clients must send `authorization: Bearer TOKEN` (compared in constant time); null: no "
                          "token. Never printed.")
    admin_token: SecretStr | None = Field(
        None, description="Operators' token for the HTTP API's admin routes (`pdserve workers`: drain, remove, add, "
                          "switch roles), apart from the clients' auth_token; null: the admin routes refuse every "
                          "call. Never printed.")
    # The SDK's own message limit, so that both APIs take the same requests; far above a real one: a prompt
    # filling a 128K-token context is about 1 MiB as token ids and a few MiB as JSON text.
    max_request_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=2**10, lt=2**31,
        description="The largest request either API takes: an HTTP body (past it: 413, and no more of it is read) "
                    "and a gRPC message (RESOURCE_EXHAUSTED).")
    max_http_connections: int = Field(
        MAX_CONNECTIONS, ge=1, le=2**16,
        description="HTTP connections open at once (one more is closed as it is accepted; under TLS, once its "
                    "handshake is done); each must send a request's headers within 10 s of opening or of its last "
                    "answer, and its body within 60 s.")
    images: ImagesSpec = Field(ImagesSpec(), description="Bounds on the images of a vision-language model's "
                                                         "requests, and the encode workers' embedding cache.")

    @property
    def token(self) -> str | None:
        """The auth token itself, for what sends or checks it; never to print or store."""
        return self.auth_token.get_secret_value() if self.auth_token is not None else None

    @property
    def admin(self) -> str | None:
        """The admin token itself, for what checks it; never to print or store."""
        return self.admin_token.get_secret_value() if self.admin_token is not None else None

    @field_validator("auth_token", "admin_token")
    @classmethod
    def _a_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value():  # the servers would take every client
            raise ValueError("is empty, which would let every client in: leave it out to run without a token")
        return v

    @field_validator("address", "http_address")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"must be HOST:PORT with a port in [0, 65535] (0 = any free port), got {v!r}")
        return v

    @model_validator(mode="after")
    def _two_listeners(self) -> "ServerSpec":
        if self.http_address is not None and self.http_address == self.address and not self.address.endswith(":0"):
            raise ValueError(f"address and http_address must differ (both {self.address}): gRPC and HTTP listen apart")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> "ServerSpec":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key: client certificates are checked over TLS")
        for f in (self.tls_cert, self.tls_key, self.tls_client_ca):
            if f is not None and not f.is_file():
                raise ValueError(f"TLS file {str(f)!r} does not exist")
        return self


class FaultsSpec(_Strict):
    """Faults injected on purpose, for tests, soak runs and drills (`pdserve.faults`); all off by default."""

    kill_after_requests: dict[str, int] = Field(
        default_factory=dict, description="Worker name (prefill-0, decode-2, ...: `pdserve up` lists them) -> it kills "
                                          "its own process on taking its N-th request. Once: the worker Ray restarts "
                                          "serves normally.")
    stall_every_steps: int = Field(0, ge=0, description="Every N-th engine step of a worker stalls `stall_ms`; 0: "
                                                        "never.")
    stall_ms: float = Field(0.0, ge=0, description="How long a stalled step stalls (milliseconds).")
    kv_drop_percent: float = Field(0.0, ge=0, le=100, description="Percent of KV frames never sent.")
    kv_corrupt_percent: float = Field(0.0, ge=0, le=100, description="Percent of KV frames sent with a byte flipped.")
    kv_delay_ms: float = Field(0.0, ge=0, description="A delay before every KV frame (a slow link; milliseconds).")
    workers: list[str] | None = Field(None, description="The workers the stalls and KV faults apply to; null: all.")
    seed: int = Field(0, description="Seed of the faults' random decisions (which frames are dropped or corrupted).")

    @field_validator("kill_after_requests")
    @classmethod
    def _positive(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {name: n for name, n in v.items() if n < 1}
        if bad:
            raise ValueError(f"a worker can be killed after 1 or more requests, got {bad}")
        return v

    def for_worker(self, name: str) -> FaultSettings | None:
        """The faults `name` injects; None when none."""
        applies = self.workers is None or name in self.workers
        settings = FaultSettings(
            kill_after_requests=self.kill_after_requests.get(name),
            stall_every_steps=self.stall_every_steps if applies else 0, stall_ms=self.stall_ms,
            kv_drop_percent=self.kv_drop_percent if applies else 0.0,
            kv_corrupt_percent=self.kv_corrupt_percent if applies else 0.0,
            kv_delay_ms=self.kv_delay_ms if applies else 0.0, seed=self.seed)
        return None if settings == FaultSettings(seed=self.seed) else settings


class SecuritySpec(_Strict):
    """The cluster's internal channels (docs/security.md)."""

    cluster_secret: bool = Field(
        True, description="A secret made per cluster at launch and handed to the workers through Ray: CURVE "
                          "encryption and authentication on the internal pyzmq channels (token stream, KV events, KV "
                          "control), and proof of membership on the tcp and grpc KV transports. Off only for "
                          "debugging with raw sockets.")


class SupervisionSpec(_Strict):
    """How the cluster watches its workers. A round pings every worker and waits up to ping_timeout_s for
    the answers, then ping_interval_s; two rounds unanswered in a row and a worker is taken for hung (out
    of placement, its requests retried). Checked against the KV lease: a hung worker must be found
    before the transfers to it lapse."""

    ping_interval_s: float = Field(0.5, gt=0, description="Between two health rounds (seconds).")
    ping_timeout_s: float = Field(1.0, gt=0, description="How long a health round waits for the workers' answers "
                                                         "(seconds).")
    restart_backoff_s: float = Field(
        1.0, gt=0, description="A restarted worker rejoins after this (seconds), doubling with each restart of it "
                               "within five minutes, up to restart_backoff_max_s.")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="The longest back-off of a restarted worker "
                                                                 "(seconds).")

    @property
    def deadlines(self) -> HealthDeadlines:
        return HealthDeadlines(ping_interval_s=self.ping_interval_s, ping_timeout_s=self.ping_timeout_s,
                               restart_backoff_s=self.restart_backoff_s,
                               restart_backoff_max_s=self.restart_backoff_max_s)

    @model_validator(mode="after")
    def _deadlines_in_order(self) -> "SupervisionSpec":
        self.deadlines  # noqa: B018  raises, naming the timings out of order
        return self


class PlannerSpec(_Strict):
    """The online planner: it re-plans the split of the workers between the prefill and decode pools
    from the traffic of the last minutes (simulated with the model's stored profile, as `pdserve plan`
    does) and switches one worker's role at a time when another split would carry clearly more traffic
    within the objectives; given a budget (`min_workers` to `max_workers`), it also adds a worker when
    the workers it has cannot carry the traffic with `headroom`, and drains and removes one when one
    fewer would (new workers ask for their pool's resources: on a Ray cluster with an autoscaler, a node
    of a type that has them is started, and an idle one stopped). Off by default; it needs a
    disaggregated deployment and a `pdserve profile` of this model on this hardware (`profile:`)."""

    online: bool = Field(False, description="Re-plan while serving, and switch worker roles by it.")
    ttft_slo_s: float = Field(2.0, gt=0, description="The TTFT objective it plans for (seconds).")
    tpot_slo_s: float = Field(0.1, gt=0, description="The TPOT objective it plans for (seconds).")
    interval_s: float = Field(30.0, gt=0, description="Between two decisions (seconds).")
    window_s: float = Field(120.0, gt=0, description="The requests a decision plans from: those that arrived this "
                                                     "long before it (seconds).")
    min_requests: int = Field(20, ge=2, description="Fewer requests in the window (finished or running): no decision.")
    margin: float = Field(0.15, ge=0, description="Another split must carry this share more (predicted goodput) "
                                                  "than the current one...")
    confirmations: int = Field(2, ge=1, description="... in this many decisions in a row (in one, when the current "
                                                    "split is predicted to carry less than the measured rate)...")
    cooldown_s: float = Field(60.0, ge=0, description="... and no role change for this long (seconds), before "
                                                      "one worker changes role.")
    min_workers: int | None = Field(None, ge=2, description="The fewest workers (prefill and decode together) it "
                                                            "scales down to; null: the manifest's replicas.")
    max_workers: int | None = Field(None, ge=2, le=128, description="The most workers it scales up to; null: the "
                                                            "manifest's replicas (it only switches roles).")
    headroom: float = Field(1.25, ge=1, description="It keeps enough workers to carry this multiple of the measured "
                                                    "request rate within the objectives (predicted), and removes one "
                                                    "only when one fewer would carry it by twice `margin` more.")
    start_timeout_s: float = Field(600.0, gt=0, description="How long a worker it adds or switches may take to start "
                                                            "(a new node's start included) before it is given up "
                                                            "(seconds).")


class RaySpec(_Strict):
    """Which Ray cluster to run on."""

    address: str = Field("local", description="local: start a Ray instance of its own on this machine; auto: join "
                                              "the cluster started by `ray up` or `ray start`; or a Ray address.")


class Manifest(_Strict):
    """A pdserve cluster: the model, the pools of workers, the router, KV transfer and the servers."""

    model: str = Field("pystd-llama", description="The shipped model (pystd-llama), a preset name (`pdserve "
                                                  "make-model --list`), a Hugging Face model directory, or a Hugging "
                                                  "Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`: from the Hub cache "
                                                  "under HF_HOME, downloaded there where the network allows).")
    served_model_name: str | None = Field(
        None, min_length=1, description="The name clients call the model by (`/v1/models`, each request's and "
                                        "response's `model`); null: the model's own name, the last part of a "
                                        "directory's path (never a whole absolute path).")
    model_path_shared: bool = Field(
        False, description="The model directory is read at the same (absolute) path on every node (a shared file "
                           "system); false: nodes that lack it get its files through Ray's object store. Either way "
                           "every worker checks that it holds the launcher's bytes (a digest) before it serves.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The model's and the KV cache's dtype; float16 on GPU pools only.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV cache block (the unit of paging, prefix "
                                                           "caching and transfer).")
    kv_memory_mb: int = Field(256, ge=1, description="KV cache memory per worker (MiB).")
    max_model_len: int | None = Field(None, ge=2, description="The context: prompt plus output tokens at most; null: "
                                                              "the model's own.")
    max_num_seqs: int = Field(64, ge=1, description="Requests in one worker's running batch at most.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Tokens one engine step computes at most (the step "
                                                                "budget).")
    profile: str = Field(
        "auto", min_length=1,
        description="Where the workers' prompt-pass costs (the router's cost model starts from them) come from. "
                    "auto: the stored `pdserve profile` of this model on this machine, where a local cluster finds "
                    "one (workers with the profile's thread counts then start without measuring), else measured at "
                    "start-up; measure: always measured at start-up; or the path of a profile file, for every "
                    "worker whose thread count it measured.")
    speculative: SpeculativeSpec | None = Field(
        None, description="Speculative decoding (outputs are unchanged, token for token); null: off.")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: prefill and decode pools, KV moved between them; colocated: "
                                     "every worker runs both phases.")
    pools: Pools = Field(Pools(), description="The pools of workers.")
    router: RouterSpec = Field(RouterSpec(), description="Placement, admission and retries.")
    kv_transfer: KVTransferSpec = Field(KVTransferSpec(), description="How KV moves between the pools.")
    server: ServerSpec = Field(ServerSpec(), description="The client-facing gRPC and HTTP servers.")
    security: SecuritySpec = Field(SecuritySpec(), description="The internal channels' protection.")
    supervision: SupervisionSpec = Field(SupervisionSpec(), description="How the workers are watched and "
                                                                        "restarted.")
    ray: RaySpec = Field(RaySpec(), description="Which Ray cluster to run on.")
    planner: PlannerSpec = Field(PlannerSpec(), description="The online planner, which reshapes the pools as traffic "
                                                            "changes; off by default.")
    log_level: LogLevel = Field(
        "warning", description="Diagnostics (Python logging under `pdserve`) of the launcher, the router and every "
                               "worker at this level and above, on stderr; a worker's land in Ray's `worker-*.err` on "
                               "its node and on the console of `pdserve up`. Request lifetime events are apart "
                               "(`pdserve up --lifetime-log`).")
    faults: FaultsSpec = Field(FaultsSpec(), description="Faults injected on purpose (tests, drills); all off by "
                                                         "default.")

    @model_validator(mode="after")
    def _nccl_has_gpus(self) -> "Manifest":
        # Whole GPUs: NCCL refuses two ranks on one device, which fractions would let Ray place.
        # An encode pool sends its embeddings over the same transport, to either pool's workers.
        pools = ("prefill", "decode") if self.mode == "disaggregated" else ("decode",)
        pools += ("encode",) if self.pools.encode.replicas else ()
        no_gpu = [name for name in pools if getattr(self.pools, name).num_gpus < 1]
        if self.kv_transfer.transport == "nccl" and (self.mode == "disaggregated" or self.pools.encode.replicas) \
                and no_gpu:
            raise ValueError(f"kv_transfer.transport nccl moves KV and image embeddings from GPU to GPU: pools "
                             f"{' and '.join(no_gpu)} need num_gpus >= 1, a GPU of their own (gloo is the CPU "
                             "equivalent)")
        return self

    @model_validator(mode="after")
    def _model_where_it_is_said_to_be(self) -> "Manifest":
        # Checked here as a path only: a manifest for a cluster loads on machines without the model.
        if self.model_path_shared and not Path(self.model).is_absolute():
            raise ValueError(f"model_path_shared needs the model directory's absolute path, read at that path on "
                             f"every node; {self.model!r} is not one")
        return self

    @model_validator(mode="after")
    def _kv_tls_files_here(self) -> "Manifest":
        # Checked on a local cluster only: a cluster's head node may not hold the workers' files.
        tls = self.kv_transfer.tls
        if self.ray.address == "local" and tls is not None and tls.missing():
            raise ValueError(f"kv_transfer.tls: {', '.join(map(str, tls.missing()))} does not exist")
        return self

    @model_validator(mode="after")
    def _profile_there(self) -> "Manifest":
        # A path checked on a local cluster only, as the TLS files are; a misspelt keyword reads as a path.
        path = Path(self.profile).expanduser()
        if self.profile not in ("auto", "measure") and self.ray.address == "local" and not path.is_file():
            raise ValueError(f"profile: no profile file at {str(path)!r} (auto, measure, or the path of a file "
                             f"`pdserve profile` wrote)")
        return self

    @model_validator(mode="after")
    def _float16_on_gpus(self) -> "Manifest":
        cpu_pools = [name for _, name, spec in self.workers() if spec.num_gpus == 0]
        if self.dtype == "float16" and cpu_pools:
            raise ValueError(f"dtype float16 runs on GPUs only, and workers {', '.join(cpu_pools)} have num_gpus 0: "
                             f"use bfloat16 or float32, or give their pools GPUs")
        return self

    @model_validator(mode="after")
    def _pools_fit_the_mode(self) -> "Manifest":
        if self.mode == "disaggregated" and (self.pools.prefill.replicas < 1 or self.pools.decode.replicas < 1):
            raise ValueError("disaggregated mode needs pools.prefill.replicas >= 1 and pools.decode.replicas >= 1")
        if self.mode == "colocated" and self.pools.prefill.replicas + self.pools.decode.replicas < 1:
            raise ValueError("colocated mode needs at least one replica (in either pool)")
        return self

    @model_validator(mode="after")
    def _planner_has_pools_to_reshape(self) -> "Manifest":
        if not self.planner.online:
            return self
        if self.mode != "disaggregated":
            raise ValueError("planner.online reshapes the prefill and decode pools: it needs mode disaggregated")
        workers = len(self.workers())
        fewest, most = self.planner_budget()
        if fewest > most:
            raise ValueError(f"planner.min_workers ({fewest}) is above planner.max_workers ({most})")
        if not fewest <= workers <= most:
            raise ValueError(f"the pools' {workers} workers are outside the planner's budget: min_workers {fewest}, "
                             f"max_workers {most}")
        if most < 3:
            raise ValueError("planner.online reshapes the prefill and decode pools: it needs at least 3 workers, or "
                             "max_workers 3 or more (1 prefill + 1 decode leave no other split)")
        if self.profile == "measure":
            raise ValueError("planner.online simulates with a stored profile: set profile to auto (after `pdserve "
                             "profile`) or to a profile file, not measure")
        return self

    @model_validator(mode="after")
    def _faults_name_workers(self) -> "Manifest":
        names = {name for _, name, _ in self.workers()}
        unknown = sorted((set(self.faults.kill_after_requests) | set(self.faults.workers or ())) - names)
        if unknown:
            raise ValueError(f"faults name workers this manifest does not have: {unknown}; it has {sorted(names)}")
        return self

    @model_validator(mode="after")
    def _deadlines_in_order(self) -> "Manifest":
        self.deadlines  # noqa: B018  raises, naming the timings out of order
        return self

    @property
    def deadlines(self) -> Deadlines:
        """Every timing that another depends on, checked against each other (`pdserve.deadlines`)."""
        return Deadlines(kv=self.kv_transfer.deadlines, health=self.supervision.deadlines)

    @property
    def served_name(self) -> str:
        """What clients call the model: `served_model_name`, else a directory's name or the model as given
        (a preset, a shipped model, a Hub id such as `Qwen/Qwen2.5-0.5B`)."""
        if self.served_model_name is not None:
            return self.served_model_name
        path = Path(self.model).expanduser()
        return path.name if path.is_absolute() or path.is_dir() else self.model

    def planner_budget(self) -> tuple[int, int]:
        """The fewest and the most workers the online planner may run (the replicas when unset)."""
        workers = len(self.workers())
        p = self.planner
        return (workers if p.min_workers is None else p.min_workers,
                workers if p.max_workers is None else p.max_workers)

    def workers(self) -> list[tuple[str, str, PoolSpec]]:
        """(role, name, pool spec) of every worker, in start order: prefill, decode or colocated, numbered
        across the pools."""
        out = []
        for pool_name, spec in (("prefill", self.pools.prefill), ("decode", self.pools.decode)):
            role = "colocated" if self.mode == "colocated" else pool_name
            out += [(role, f"{role}-{len(out) + i}", spec) for i in range(spec.replicas)]
        return out

    def engine_config(self, pool: PoolSpec) -> dict:
        return {
            "dtype": self.dtype, "block_size": self.block_size, "kv_memory_bytes": self.kv_memory_mb * 2**20,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "num_threads": pool.threads,
            "device": "cuda" if pool.num_gpus > 0 else "cpu",
            "speculative": self.speculative.engine_config() if self.speculative else None,
            "image_limits": self.server.images.limits(),
        }


class ManifestError(ValueError):
    pass


def load_manifest(source: str | Path | dict | None = None, overrides: ManifestOverrides | None = None) -> Manifest:
    """Read and validate a manifest (path, dict, or None for the default), with `overrides` (command-line
    options) written over its fields first; raise ManifestError, naming the option of an overridden field."""
    if source is None:
        source = DEFAULT_MANIFEST
    if isinstance(source, dict):
        data, where = source, "manifest"
    else:
        path = Path(source)
        if not path.is_file():
            raise ManifestError(f"manifest {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ManifestError(f"{path}: not valid YAML: {e}") from e
        where = str(path)
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: the top level must be a mapping of fields")
    overrides = overrides or ManifestOverrides()
    try:
        return Manifest.model_validate(overrides.apply(data))
    except ValidationError as e:
        problems = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            option = overrides.option_for(field)
            problems.append(f"  {field}{f' (set by {option})' if option else ''}: {err['msg']}")
        raise ManifestError(f"{where} is invalid:\n" + "\n".join(problems)) from None
