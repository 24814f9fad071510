"""Train a draft model for speculative decoding: a one-layer copy of a target, distilled from it.

A draft proposes the tokens the target is likely to sample next, so what matters is how often it
agrees with the target, not its own perplexity. The recipe (after DistillSpec, Zhou et al. 2023):

  - the draft has the target's tokenizer, width and vocabulary, and fewer layers; it starts as the
    target's embeddings, first `num_layers` decoder layers, final norm and output head (a model that
    exits early, LayerSkip's self-draft), so it agrees with the target somewhat before training;
  - it is then trained to match the target's next-token distribution (KL divergence from the target's
    softmax) on random windows of the target's own training corpus (`training.corpus_texts`).

Held out, it reports how often its most likely token is the target's (greedy acceptance) and
Σ min(p, q), the chance a sampled draft token is accepted by rejection sampling at temperature 1.
`pdserve train-draft` runs it; the shipped `pystd-llama-draft` was made by the defaults.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM, get_cosine_with_min_lr_schedule_with_warmup
from transformers.utils import logging as hf_logging

from pdserve.engine.models.training import corpus_texts, param_groups, record_wall_time, save_checkpoint, token_stream


@dataclass(frozen=True)
class DraftConfig:
    """The recipe. The defaults made the shipped `pystd-llama-draft`."""

    steps: int = 600
    seed: int = 0
    num_layers: int = 1
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    threads: int = 2
    eval_tokens: int = 65536  # held-out tokens scored at the end (windows of seq_len)
    max_train_chars: int | None = None  # cap on the training text (tiny runs in tests); None: all of it


def draft_from_target(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A model with the target's config but `num_layers` layers, holding the target's embeddings, first
    layers, final norm and head."""
    if not 1 <= num_layers < target.config.num_hidden_layers:
        raise ValueError(f"a draft has 1 to {target.config.num_hidden_layers - 1} layers, not {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    config.layer_types = None  # per-layer attention kinds are rebuilt for the new depth
    draft = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    kept = {name for name in target.state_dict() if not name.startswith("model.layers.")
            or int(name.split(".")[2]) < num_layers}
    if missing or set(unexpected) & kept:
        raise RuntimeError(f"the draft does not take the target's weights: missing {missing}, left out "
                           f"{sorted(set(unexpected) & kept)}")
    return draft


@torch.no_grad()
def agreement(draft: LlamaForCausalLM, target: LlamaForCausalLM, stream: torch.Tensor, seq_len: int,
              max_tokens: int) -> dict[str, float]:
    """Over consecutive windows of `stream`: how often the draft's most likely next token is the target's,
    the mean Σ min(p, q) (sampled acceptance at temperature 1), and the mean KL(target ‖ draft)."""
    draft.eval()
    greedy = sampled = kl = 0.0
    count = 0
    for start in range(0, min(len(stream), max_tokens + 1) - 1, seq_len):
        window = stream[start : start + seq_len][None]
        p_log = F.log_softmax(target(input_ids=window).logits[0].float(), dim=-1)
        q_log = F.log_softmax(draft(input_ids=window).logits[0].float(), dim=-1)
        greedy += (p_log.argmax(-1) == q_log.argmax(-1)).sum().item()
        sampled += torch.minimum(p_log.exp(), q_log.exp()).sum().item()
        kl += F.kl_div(q_log, p_log, log_target=True, reduction="sum").item()
        count += window.shape[1]
    draft.train()
    return {"greedy_agreement": round(greedy / count, 4), "sampled_acceptance": round(sampled / count, 4),
            "kl_nats": round(kl / count, 4), "tokens_scored": count}


def train_draft(target_dir: str | Path, cfg: DraftConfig, out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """Distil a draft of `target_dir` into `out_dir` (replacing it); returns the results."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    hf_logging.disable_progress_bar()
    say = print if progress else (lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    target.requires_grad_(False)
    texts = corpus_texts("train")
    if cfg.max_train_chars is not None:
        texts = ["".join(texts)[: cfg.max_train_chars]]
    train_stream = token_stream(texts, tokenizer)
    heldout_stream = token_stream(corpus_texts("heldout"), tokenizer)
    say(f"corpus: {len(train_stream) / 1e6:.2f}M training tokens, {len(heldout_stream)} held out", flush=True)

    torch.manual_seed(cfg.seed)
    draft = draft_from_target(target, cfg.num_layers)
    before = agreement(draft, target, heldout_stream, cfg.seq_len, cfg.eval_tokens)
    say(f"before training (the target's first {cfg.num_layers} layer(s)): {before}", flush=True)
    optimizer = torch.optim.AdamW(param_groups(draft, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps,
                                                           min_lr_rate=cfg.min_lr_ratio)
    windows = torch.Generator().manual_seed(cfg.seed)
    draft.train()
    train_start, loss_avg = time.perf_counter(), None
    bar = tqdm(range(cfg.steps), desc="distil", disable=not progress, mininterval=5)
    for _ in bar:
        starts = torch.randint(0, len(train_stream) - cfg.seq_len, (cfg.batch_size,), generator=windows)
        batch = torch.stack([train_stream[s : s + cfg.seq_len] for s in starts.tolist()])
        with torch.no_grad():
            p_log = F.log_softmax(target(input_ids=batch).logits, dim=-1).flatten(0, 1)
        q_log = F.log_softmax(draft(input_ids=batch).logits, dim=-1).flatten(0, 1)
        loss = F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.set_postfix(kl=f"{loss_avg:.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}", refresh=False)
    bar.close()
    train_s = time.perf_counter() - train_start

    after = agreement(draft, target, heldout_stream, cfg.seq_len, cfg.eval_tokens)
    say(f"held-out: {after}", flush=True)
    results = {"train_seconds": round(train_s, 1), "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
               "parameters": sum(p.numel() for p in draft.parameters()), "before": before, "after": after}
    recipe = {"recipe": asdict(cfg), "target": Path(target_dir).name, "results": results,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    save_checkpoint(draft.half(), tokenizer, Path(out_dir), recipe)  # half: a draft's weights need no more
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    record_wall_time(Path(out_dir), results["wall_seconds"])
    say(f"wrote {out_dir} in {results['wall_seconds']:.0f} s ({json.dumps(after)})", flush=True)
    return results

