"""Train the project's small Llama on the Python standard library's own source, offline, on 2 cores.

Compression of the KV cache can only be judged on a model whose keys and values have real
statistics, and a demo should print readable text: random weights give neither. The one text that
is on every machine without a download is the running Python's standard library, so that is the
corpus: every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded), in
sorted order, read as UTF-8 (the few files that are not valid UTF-8, test data for the encoding
machinery, are left out).

Held-out split: a file is held out when the CRC32 of its path relative to the stdlib root (POSIX
separators) is below 3 modulo 100, about 3% of the files, the same on every machine and Python
version. The tokenizer and the model see only the training split; `heldout_text` (perplexity) and
`calibration_text` (codec statistics, from the training split) give other code fixed samples.

`train(TrainConfig(), out_dir)` is the whole recipe: the tokenizer, the model, a fixed number of
AdamW steps with warmup and cosine decay on random windows of the token stream, the held-out loss,
and a normal Hugging Face checkpoint directory plus `training.json` (recipe and results). Same
config, same Python stdlib, same torch and thread count: same weights. `pdserve train-model` runs it.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from tqdm import tqdm
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    get_cosine_with_min_lr_schedule_with_warmup,
)
from transformers.utils import logging as hf_logging

from pdserve.engine.models.tokenizer import train_tokenizer

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 3
RECIPE_FILE = "training.json"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % 100 < HELDOUT_PERCENT


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def corpus_files(split: Split) -> list[Path]:
    """The stdlib source files of one split, sorted by path (files that are not UTF-8 left out)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts or _is_heldout(relative.as_posix()) != (split == "heldout"):
            continue
        if path.is_file() and _read(path) is not None:
            files.append(path)
    return files


def corpus_texts(split: Split) -> list[str]:
    return [path.read_text(encoding="utf-8") for path in corpus_files(split)]


def _sample(split: Split, num_chars: int) -> str:
    """The first `num_chars` characters of the split's files, concatenated in an order that mixes
    the whole library (by CRC32 of the relative path) rather than alphabetically."""
    root = stdlib_root()
    files = sorted(corpus_files(split), key=lambda p: (zlib.crc32(p.relative_to(root).as_posix()[::-1].encode()), p))
    parts, total = [], 0
    for path in files:
        if total >= num_chars:
            break
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        total += len(text)
    return "".join(parts)[:num_chars]


def heldout_text(num_chars: int) -> str:
    """Text the model never saw, for perplexity: `num_chars` characters of the held-out files."""
    return _sample("heldout", num_chars)


def calibration_text(num_chars: int) -> str:
    """Text from the training split, for profiling statistics (of codecs, say): `num_chars` characters."""
    return _sample("train", num_chars)


@dataclass(frozen=True)
class TrainConfig:
    """The recipe. The defaults are the shipped `pystd-llama` (README of `training.json` for why)."""

    steps: int = 1000
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    seq_len: int = 1024
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 2
    eval_tokens: int = 131072  # held-out tokens scored at the end (windows of seq_len)
    max_train_chars: int | None = None  # cap on the training text (tiny runs in tests); None: all of it

    def llama_config(self, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )


def token_stream(texts: list[str], tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """All texts as one stream of token ids, each file followed by the end-of-sequence token."""
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _cap(texts: list[str], max_chars: int | None) -> list[str]:
    if max_chars is None:
        return texts
    kept, total = [], 0
    for text in texts:
        if total >= max_chars:
            break
        kept.append(text[: max_chars - total])
        total += len(kept[-1])
    return kept


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, max_tokens: int) -> tuple[float, int]:
    """Mean next-token loss (nats) over consecutive windows of the held-out stream, and tokens scored."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, min(len(stream), max_tokens + 1) - 1, seq_len):
        window = stream[start : start + seq_len + 1]
        if len(window) < 2:
            break
        logits = model(input_ids=window[None, :-1]).logits[0]
        total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    model.train()
    return total / count, count


def train(cfg: TrainConfig, out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Run the whole recipe and write the checkpoint to `out_dir` (replacing it); returns the results."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    hf_logging.disable_progress_bar()
    say = print if progress else (lambda *a, **k: None)

    train_texts = _cap(corpus_texts("train"), cfg.max_train_chars)
    heldout_texts = corpus_texts("heldout")
    say(f"corpus: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f}M chars), "
        f"{len(heldout_texts)} held out, from {stdlib_root()}", flush=True)
    tokenizer = train_tokenizer(train_texts, cfg.vocab_size)
    train_stream = token_stream(train_texts, tokenizer)
    heldout_stream = token_stream(heldout_texts, tokenizer)
    say(f"tokenizer: {len(tokenizer)} tokens; {len(train_stream) / 1e6:.2f}M training tokens, "
        f"{sum(map(len, train_texts)) / len(train_stream):.2f} chars/token "
        f"({time.perf_counter() - started:.0f} s)", flush=True)

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM._from_config(cfg.llama_config(tokenizer), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    # Cosine decay to min_lr_ratio of the peak rather than to 0: the last steps still learn.
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    windows = torch.Generator().manual_seed(cfg.seed)
    model.train()
    train_start, loss_avg = time.perf_counter(), None
    bar = tqdm(range(cfg.steps), desc="train", disable=not progress, mininterval=5, file=sys.stdout)
    for step in bar:
        starts = torch.randint(0, len(train_stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=windows)
        batch = torch.stack([train_stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        tokens_per_s = (step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - train_start)
        bar.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}", tok_s=f"{tokens_per_s:.0f}")
    bar.close()
    train_s = time.perf_counter() - train_start

    loss, scored = heldout_loss(model, heldout_stream, cfg.seq_len, cfg.eval_tokens)
    say(f"held-out: loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} over {scored} tokens", flush=True)
    results = {
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(train_s, 1),
        "train_tokens_per_s": round(cfg.steps * cfg.batch_size * cfg.seq_len / train_s, 1),
        "final_train_loss_ema": round(loss_avg or float("nan"), 4),
        "heldout_loss": round(loss, 4),
        "heldout_perplexity": round(math.exp(loss), 3),
        "heldout_tokens_scored": scored,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    corpus = {
        "stdlib": str(stdlib_root()), "python": platform.python_version(), "heldout_percent": HELDOUT_PERCENT,
        "train_files": len(train_texts), "heldout_files": len(heldout_texts),
        "train_chars": sum(map(len, train_texts)), "train_tokens": len(train_stream),
        "heldout_tokens": len(heldout_stream),
    }
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    save_checkpoint(model, tokenizer, Path(out_dir), {"recipe": asdict(cfg), "corpus": corpus, "versions": versions,
                                           "results": results})
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    record_wall_time(Path(out_dir), results["wall_seconds"])
    say(f"wrote {out_dir} in {results['wall_seconds']:.0f} s wall time "
        f"({results['train_tokens_per_s']:.0f} training tokens/s)", flush=True)
    return results


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms' gains have nothing to shrink towards zero."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path,
                    recipe: dict[str, Any]) -> None:
    """Write into a temporary sibling, then rename: a crash never leaves a half-written checkpoint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    for path in [staging, *staging.iterdir()]:  # mkdtemp makes it private; a shipped model is readable
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def record_wall_time(out: Path, wall_seconds: float) -> None:
    recipe = json.loads((out / RECIPE_FILE).read_text())
    recipe["results"]["wall_seconds"] = wall_seconds
    (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
