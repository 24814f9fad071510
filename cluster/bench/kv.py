"""`pdserve bench kv`: the KV transports and codecs, each table measured in one run.

Transports: a prompt's KV (2K and 16K tokens of random bytes, as many per token and layer as the
model's layout has, or `token_bytes`) is sent as frames from this process to a receiving half in a
child process, whose sink copies every frame into one preallocated buffer, as the receiver's write
into the reserved blocks does: the transport alone (the frames' checksums are made beforehand and
not checked; `pdserve bench cluster`'s probes time the whole path, checksums, decoding and the write
into blocks included). Beside each, the same bytes over a plain TCP socket on loopback (`socket`),
read straight into the same kind of buffer with no copy: the ceiling. `nccl` (asked for with
`--transports`, on
a machine with two GPUs) sends frames from GPU 0 into a buffer on GPU 1. Each transport is set up
with a socket of its own beside it (and no other transport: their receiving halves alive at once cost
the socket a third of its speed here, and not the transports) and the two timed in turn, each repeat
in a shuffled order, after one warm-up each (connections, groups and segments set up): medians of
`repeats` runs, and each transport's share of the socket is the median of its per-repeat ratios.

Codecs, on the trained model: held-out text windows; the first half's KV is encoded and decoded
frame by frame, then the model continues from it. Bits per KV element count every byte a frame puts
on the wire (payload, scales, escapes and the frame header); perplexity change is on the second half
of each window against exact KV; greedy agreement compares 64-token continuations from compressed and
exact KV. Encode and decode speeds are MB of KV in the engine's dtype (float32 here) per second on one
thread, the median of `SPEED_PASSES` passes, and decode also as MB of the same KV in bf16 (half the
bytes for the same elements): over whole chunks of held-out text (`FRAME_TOKENS`, the frames a long
prompt travels in), and over the windows' shorter frames, where each frame's fixed costs weigh more.
(`pdserve bench cluster` gives the serving side: TTFT against colocated and the hidden share.)
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import random
import socket
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pdserve.cluster.bench.kv_receiving import receive_into_one_buffer
from pdserve.cluster.bench.report import provenance
from pdserve.engine.kv_cache import KVLayout
from pdserve.engine.model_loader import cache_argument, cache_of, load_model, load_tokenizer
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.models.training import heldout_text
from pdserve.kv_transfer.codecs import checksum, make_codec
from pdserve.kv_transfer.frames import FRAME_TOKENS
from pdserve.kv_transfer.interface import MAX_FRAME_BYTES, Codec, FrameHeader
from pdserve.kv_transfer.transports import make_sender


@dataclass
class KVBenchConfig:
    model: str = "pystd-llama"
    transports: tuple[str, ...] = ("shm", "tcp", "grpc", "gloo")
    prompt_tokens: tuple[int, ...] = (2048, 16384)
    repeats: int = 20  # a 2K-token prompt's KV takes milliseconds: fewer left one run's median to a hiccup
    runs: int = 1  # whole transport runs, each setting every transport up afresh; shown side by side
    # KV bytes per token and layer of the transports' frames (None: the model's). A frame is FRAME_TOKENS
    # tokens of one layer, so this sets the frame size: 4096 for an 8B-class layout (8 KV heads x 128, bf16).
    token_bytes: int | None = None
    codecs: tuple[str, ...] = ("raw", "fp8", "int8", "cachegen")  # none: no codec table
    windows: int = 16  # held-out windows for perplexity
    window_tokens: int = 1024
    continuations: int = 128
    continuation_tokens: int = 64
    out: Path = Path("bench-results/kv.json")

    def __post_init__(self) -> None:
        if self.token_bytes is not None and not 0 < self.token_bytes * FRAME_TOKENS <= MAX_FRAME_BYTES:
            raise ValueError(f"token bytes must make frames of 1 to {MAX_FRAME_BYTES} bytes ({FRAME_TOKENS} tokens "
                             f"each): at most {MAX_FRAME_BYTES // FRAME_TOKENS}, got {self.token_bytes}")


# --- transports ----------------------------------------------------------------------------------
def _frames(num_layers: int, per_token: int, num_tokens: int) -> list[tuple[FrameHeader, np.ndarray]]:
    rng = np.random.default_rng(0)
    frames = []
    for layer in range(num_layers):
        for start in range(0, num_tokens, FRAME_TOKENS):
            n = min(FRAME_TOKENS, num_tokens - start)
            data = rng.integers(0, 256, n * per_token, dtype=np.uint8)
            frames.append((FrameHeader("bench", layer, start, n, "raw", 0, checksum(data), data.nbytes), data))
    return frames


class _TransportRun:
    """One transport (or the plain TCP socket) set up once, its receiving half in a child
    process: `once()` sends every frame through it and returns the seconds until the last is taken."""

    def __init__(self, kind: str, frames: list[tuple[FrameHeader, np.ndarray]]) -> None:
        self.kind, self.frames = kind, frames
        self.total = sum(d.nbytes for _, d in frames)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=receive_into_one_buffer,
                                    args=(kind, max(d.nbytes for _, d in frames) * 4, child))
        self._process.start()
        self._runs = 0
        self._closers: list = []
        address = self._conn.recv()
        if address is None:
            self.close()
            raise RuntimeError(f"KV transport {kind!r} needs two GPUs for this benchmark")
        if kind == "socket":
            host, port = address.rsplit(":", 1)
            self._sock = socket.create_connection((host, int(port)))
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._closers.append(self._sock.close)
        else:
            self._address = address
            self._sender = make_sender(kind, frame_bytes=max(d.nbytes for _, d in frames))  # as the prefill worker
            self._closers.append(self._sender.close)
            device = getattr(self._sender, "device", None)  # NCCL's frames start on the GPU, as the KV does
            self._payloads = [data if device is None else torch.from_numpy(data).to(device) for _, data in frames]

    def once(self) -> float:
        t0 = time.perf_counter()
        if self.kind == "socket":
            self._conn.send(self.total)
            for _, data in self.frames:
                self._sock.sendall(data)
            self._sock.recv(1)
        else:
            channel = self._sender.open(self._address, "bench")  # the frames' transfer
            for (header, _), payload in zip(self.frames, self._payloads):
                channel.send(header, payload)
            channel.finish(timeout=120)
            channel.close()
        self._runs += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        for close in self._closers:
            close()
        try:
            self._conn.send(None)  # the child stops
        except (BrokenPipeError, OSError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def bench_transports(cfg: KVBenchConfig, layout: KVLayout, log=print) -> list[dict]:
    """Per prompt length and transport: that transport and a plain socket set up together (and nothing
    else: with every transport's receiving half alive at once, the socket alone lost a third of its
    speed here), then timed in turn, each repeat in a shuffled order, so the machine's drift falls on
    both alike; its share of the socket is the median of the per-repeat ratios. One warm-up each first
    (connections, groups and segments set up)."""
    rows = []
    order_rng = random.Random(0)
    per_token = cfg.token_bytes or layout.bytes_per_token_layer
    for num_tokens in cfg.prompt_tokens:
        frames = _frames(layout.num_layers, per_token, num_tokens)
        total = sum(d.nbytes for _, d in frames)
        for kind in cfg.transports:
            pair = ("socket", kind)
            with ExitStack() as stack:
                runs = {}
                for each in pair:
                    runs[each] = _TransportRun(each, frames)
                    stack.callback(runs[each].close)
                seconds: dict[str, list[float]] = {each: [] for each in pair}
                for repeat in range(cfg.repeats + 1):
                    for each in order_rng.sample(pair, len(pair)):
                        s = runs[each].once()
                        if repeat:  # the first is the warm-up
                            seconds[each].append(s)
            s, socket_s = statistics.median(seconds[kind]), statistics.median(seconds["socket"])
            share = statistics.median(t / k for t, k in zip(seconds["socket"], seconds[kind]))
            rows.append({"transport": kind, "tokens": num_tokens, "bytes": total, "frames": len(frames),
                         "frame_bytes": max(d.nbytes for _, d in frames),
                         "seconds": s, "gb_per_s": total / s / 1e9, "socket_gb_per_s": total / socket_s / 1e9,
                         "share_of_socket": share})
            log(f"  {kind:10s} {num_tokens:6d} tokens ({total / 2**20:.0f} MiB): {total / s / 1e9:.2f} GB/s, "
                f"plain socket beside it {total / socket_s / 1e9:.2f} GB/s (per repeat, {share:.0%} of it)")
    return rows


# --- codecs --------------------------------------------------------------------------------------
SPEED_CHUNKS = 4  # whole chunks of held-out text (FRAME_TOKENS each), whose KV times the codecs
SPEED_PASSES = 5  # speeds are of the median of this many passes


@dataclass
class CodecRow:
    codec: str
    level: int
    bits_per_element: float = 0.0
    ratio_vs_bf16: float = 0.0
    ratio_vs_int8: float = 0.0
    perplexity: float = 0.0
    perplexity_change: float = 0.0
    token_agreement: float = 0.0
    identical_continuations: float = 0.0
    # Speeds in MB/s of raw KV per core, over the perplexity windows' frames (512 tokens) and over
    # whole chunks (`chunk_`: FRAME_TOKENS, what a long prompt's frames hold); decode also in bf16 bytes.
    encode_mb_per_s: float = 0.0
    decode_mb_per_s: float = 0.0
    decode_bf16_mb_per_s: float = 0.0
    chunk_encode_mb_per_s: float = 0.0
    chunk_decode_mb_per_s: float = 0.0
    chunk_decode_bf16_mb_per_s: float = 0.0
    extra: dict = field(default_factory=dict)


def _cache_kv(cache: DynamicCache) -> list[torch.Tensor]:
    """Per layer [2, batch, tokens, heads, dim] of a transformers cache."""
    return [torch.stack([layer.keys, layer.values]).transpose(2, 3) for layer in cache.layers]


def _roundtrip(codec: Codec, level: int, kv_layers: list[torch.Tensor]) -> tuple[DynamicCache, int, float, float]:
    """The cache after encoding and decoding every frame; wire bytes, encode and decode seconds."""
    cache, wire, enc_s, dec_s = DynamicCache(), 0, 0.0, 0.0
    header_bytes = len(FrameHeader("0" * 32, 0, 0, 0, codec.name, 0, 0, 0).pack())
    for layer, kv in enumerate(kv_layers):
        rows = []
        for b in range(kv.shape[1]):
            pieces = []
            for start in range(0, kv.shape[2], FRAME_TOKENS):
                frame = kv[:, b, start : start + FRAME_TOKENS].contiguous()
                t0 = time.perf_counter()
                payload = codec.encode(frame, layer, level)
                t1 = time.perf_counter()
                pieces.append(codec.decode(payload, layer, level, frame.shape[1], frame.dtype))
                dec_s += time.perf_counter() - t1
                enc_s += t1 - t0
                wire += memoryview(payload).nbytes + header_bytes
            rows.append(torch.cat(pieces, dim=1))
        restored = torch.stack(rows, dim=1).transpose(2, 3)  # [2, batch, heads, tokens, dim]
        cache.update(restored[0].contiguous(), restored[1].contiguous(), layer)
    return cache, wire, enc_s, dec_s


def _coding_seconds(codec: Codec, level: int, kv_layers: list[torch.Tensor]) -> tuple[float, float]:
    """Encode and decode seconds for all of kv_layers: the median of SPEED_PASSES passes."""
    passes = [_roundtrip(codec, level, kv_layers)[2:] for _ in range(SPEED_PASSES)]
    return statistics.median(p[0] for p in passes), statistics.median(p[1] for p in passes)


@torch.no_grad()
def bench_codecs(cfg: KVBenchConfig, model_dir: Path, layout: KVLayout, log=print) -> list[CodecRow]:
    torch.set_num_threads(1)  # speeds are per core
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windowed = cfg.windows * cfg.window_tokens
    # Characters, set by the windows and prompts alone: the prompts (its last tokens) stay those of earlier runs.
    text_size = (windowed + cfg.continuations * 256) * 6
    need = windowed + SPEED_CHUNKS * FRAME_TOKENS + cfg.continuations * 256
    ids = tokenizer(heldout_text(text_size), add_special_tokens=False)["input_ids"]
    if len(ids) < need:
        raise ValueError(f"held-out text gives {len(ids)} tokens, the benchmark needs {need}")
    windows = torch.tensor(ids[:windowed]).view(cfg.windows, cfg.window_tokens)
    chunks = torch.tensor(ids[windowed : windowed + SPEED_CHUNKS * FRAME_TOKENS]).view(SPEED_CHUNKS, FRAME_TOKENS)
    prompts = torch.tensor(ids[len(ids) - cfg.continuations * 256 :]).view(cfg.continuations, 256)
    half = cfg.window_tokens // 2
    continue_from_cache = cache_argument(model)
    prefix_kv = _cache_kv(cache_of(model(windows[:, :half], use_cache=True)))
    prompt_kv = _cache_kv(cache_of(model(prompts[:, :-1], use_cache=True)))
    chunk_kv = _cache_kv(cache_of(model(chunks, use_cache=True)))
    raw_bytes = sum(kv.numel() for kv in prefix_kv) * 4
    chunk_bytes = sum(kv.numel() for kv in chunk_kv) * 4

    def loss_from(cache: DynamicCache) -> float:
        logits = model(windows[:, half:], **{continue_from_cache: cache}).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, half + 1 :].flatten()))

    def continue_from(cache: DynamicCache) -> torch.Tensor:
        token, out = prompts[:, -1:], []
        for _ in range(cfg.continuation_tokens):
            token = model(token, **{continue_from_cache: cache}).logits[:, -1:].argmax(-1)
            out.append(token)
        return torch.cat(out, dim=1)

    exact_raw = make_codec("raw", model_dir, layout)
    exact_cache, _, _, _ = _roundtrip(exact_raw, 0, prefix_kv)
    exact_loss = loss_from(exact_cache)
    exact_tokens = continue_from(_roundtrip(exact_raw, 0, prompt_kv)[0])
    frame_tokens = min(half, FRAME_TOKENS)  # the windows' frames
    rows: list[CodecRow] = []
    for name in cfg.codecs:
        codec = make_codec(name, model_dir, layout)
        for level in range(codec.num_levels):
            cache, wire, _, _ = _roundtrip(codec, level, prefix_kv)
            loss = loss_from(cache)
            tokens = continue_from(_roundtrip(codec, level, prompt_kv)[0])
            chunk_enc_s, chunk_dec_s = _coding_seconds(codec, level, chunk_kv)
            enc_s, dec_s = _coding_seconds(codec, level, prefix_kv)
            row = CodecRow(name, level, bits_per_element=wire * 8 / (raw_bytes / 4), perplexity=math.exp(loss),
                           perplexity_change=math.exp(loss - exact_loss) - 1,
                           token_agreement=float((tokens == exact_tokens).float().mean()),
                           identical_continuations=float((tokens == exact_tokens).all(dim=1).float().mean()),
                           encode_mb_per_s=raw_bytes / enc_s / 1e6, decode_mb_per_s=raw_bytes / dec_s / 1e6,
                           decode_bf16_mb_per_s=raw_bytes / 2 / dec_s / 1e6,
                           chunk_encode_mb_per_s=chunk_bytes / chunk_enc_s / 1e6,
                           chunk_decode_mb_per_s=chunk_bytes / chunk_dec_s / 1e6,
                           chunk_decode_bf16_mb_per_s=chunk_bytes / 2 / chunk_dec_s / 1e6)
            rows.append(row)
            log(f"  {name:8s} level {level}: {row.bits_per_element:6.2f} bits/element, perplexity "
                f"{row.perplexity:.3f} ({row.perplexity_change:+.2%}), agreement {row.token_agreement:.1%}; "
                f"MB/s of float32 KV (as bf16) in {FRAME_TOKENS}-token chunks: encode "
                f"{row.chunk_encode_mb_per_s:.0f}, decode {row.chunk_decode_mb_per_s:.0f} "
                f"({row.chunk_decode_bf16_mb_per_s:.0f}); in {frame_tokens}-token frames: encode "
                f"{row.encode_mb_per_s:.0f}, decode {row.decode_mb_per_s:.0f} ({row.decode_bf16_mb_per_s:.0f})")
    int8_bits = next((r.bits_per_element for r in rows if r.codec == "int8"), None)
    for row in rows:
        row.ratio_vs_bf16 = 16 / row.bits_per_element
        row.ratio_vs_int8 = int8_bits / row.bits_per_element if int8_bits else 0.0
    return rows


def run(cfg: KVBenchConfig, log=print) -> dict:
    model_dir = resolve_model(cfg.model)
    layout = load_model(model_dir, torch.float32, "cpu", block_size=16).kv_layout  # what the engine caches
    kv = (f"{cfg.token_bytes} bytes of KV per token and layer" if cfg.token_bytes else
          f"{layout.num_kv_heads} KV heads x {layout.head_dim}, float32")
    log(f"transports ({cfg.model}: {layout.num_layers} layers, {kv}; frames of {FRAME_TOKENS} tokens)")
    transports = []
    for run_index in range(1, cfg.runs + 1):
        if cfg.runs > 1:
            log(f"run {run_index} of {cfg.runs}")
        transports += [{**row, "run": run_index} for row in bench_transports(cfg, layout, log)]
    codecs = []
    if cfg.codecs:
        log(f"codecs ({cfg.model}, held-out text)")
        codecs = bench_codecs(cfg, model_dir, layout, log)
    result = {
        "benchmark": "kv", "provenance": provenance(), "model": cfg.model, "kv_per_token_layer": kv,
        "torch": torch.__version__, "config": {k: str(v) for k, v in asdict(cfg).items()},
        "transports": transports, "codecs": [asdict(r) for r in codecs],
    }
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    log(f"wrote {cfg.out}")
    return result


def markdown(result: dict) -> str:
    """The results as the docs show them: bytes/s per transport beside a plain socket's, and the codecs."""
    by_case: dict[tuple[str, int], list[dict]] = {}
    for row in result["transports"]:
        by_case.setdefault((row["transport"], row["tokens"]), []).append(row)
    runs = max(len(rows) for rows in by_case.values())
    lines = [f"Transports alone ({result['model']}, {result['kv_per_token_layer']}, frames of {FRAME_TOKENS} tokens): "
             "a prompt's KV sent from this process into a receiving half in a child process, whose sink copies "
             "each frame into a buffer, beside the same bytes over a plain TCP socket read straight into one "
             "(the ceiling), set up with each transport and timed in turn with it. "
             f"{runs} run(s), each setting every transport up afresh; within a run, medians of the "
             "repeats, and the share is the median of per-repeat ratios. GB/s: the median over the runs.", "",
             "| transport | prompt tokens | KV (MiB) | GB/s | plain socket GB/s | share of the socket, per run |",
             "|---|---|---|---|---|---|"]
    if any(row["share_of_socket"] > 1.0 for row in result["transports"]):
        lines[0] += (" Here a transport moved more bytes per second than the plain socket, which one Python loop "
                     "on each side drives (`recv_into` as the bytes come): a share above 100% says the transport "
                     "loses nothing to that socket, not that a socket could not go faster.")
    for (transport, tokens), rows in by_case.items():
        shares = " / ".join(f"{row['share_of_socket']:.0%}" for row in rows)
        lines.append(f"| {transport} | {tokens:,} | {rows[0]['bytes'] / 2**20:.0f} | "
                     f"{statistics.median(row['gb_per_s'] for row in rows):.2f} | "
                     f"{statistics.median(row['socket_gb_per_s'] for row in rows):.2f} | {shares} |")
    if result["codecs"]:
        lines += ["", "Codecs on the trained model (held-out text): bits per KV element on the wire (payload, "
                      "scales, escapes, frame header), perplexity change against exact KV, greedy agreement of "
                      "64-token continuations, and speeds per core (MB of float32 KV per second).", "",
                  "| codec | level | bits/element | x smaller than int8 | perplexity change | greedy agreement | "
                  "encode MB/s | decode MB/s |", "|---|---|---|---|---|---|---|---|"]
        for c in result["codecs"]:
            lines.append(f"| {c['codec']} | {c['level']} | {c['bits_per_element']:.2f} | {c['ratio_vs_int8']:.2f} | "
                         f"{c['perplexity_change']:+.2%} | {c['token_agreement']:.1%} | "
                         f"{c['chunk_encode_mb_per_s'] or c['encode_mb_per_s']:.0f} | "
                         f"{c['chunk_decode_mb_per_s'] or c['decode_mb_per_s']:.0f} |")
    return "\n".join(lines)
