"""The engine: requests in, one scheduled forward pass per `step()`, tokens out.

Besides serving requests end to end (the colocated mode), it can hand a request over to another
engine: `add_request(..., prefill_only=True)` stops after the first token and holds the KV;
`export_handoff` + `export_kv` read it out (all layers, or one layer at a time), and `layer_hook`
sees each layer's KV the moment the forward pass has written it; on the receiving engine
`begin_import` reserves blocks (sharing the leading ones its own prefix cache already holds, which
then need no transfer), `import_kv` (or a direct write into the reserved blocks) fills them, and
`commit_import(handoff)` queues the request for the batch (it takes the next free slot);
`resume_request(handoff)` instead recomputes the KV from the tokens. `abort_request` frees whatever
a request holds, in any state. A decoding request moves the same way (live migration): `hold_decoding`
takes it out of the batch with its KV and gives its handoff, the receiving engine reserves with the
tokens it has sampled (`begin_import(..., output_token_ids=...)`), and `resume_held` puts it back
into the batch here when the move fails. With a draft model, its prompt KV can travel too: the sending engine
computes it beside the target's (`EngineConfig.draft_prompt_kv`; the layer hook numbers its layers
after the target's), the receiving one reserves blocks for it (`begin_import(..., draft_kv=True)`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.block_pool import BlockPool, OutOfBlocks, hash_prompt_blocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.cost_model import StepCostModel
from pdserve.engine.detokenizer import StopStrings, cut_at_stop
from pdserve.engine.kv_cache import KVBlocks, PagedKVCache
from pdserve.engine.model_loader import load_model
from pdserve.engine.model_runner import LayerHook, ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.multimodal.images import decode_image
from pdserve.engine.multimodal.placement import PromptImages
from pdserve.engine.multimodal.vision import EncodedImage, PreparedImage
from pdserve.engine.sampling_params import BadParameter, RequestOutput, SamplingParams, check_prompt
from pdserve.engine.scheduler import ScheduledChunk, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculative.proposer import Proposer, make_proposer
from pdserve.engine.speculative.draft import WORKER_RECORD_DECAY, DraftRequest, DraftWorth, WorkerRecord
from pdserve.engine.speculative.sizing import (
    ACCEPTANCE_PRIOR, DecodeCost, DecodeCostModel, DecodeStepShape, DraftCandidate, draft_lengths,
)


@dataclass
class RequestHandoff:
    """Everything but the KV that another engine needs to continue a request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int  # tokens whose KV travels with the handoff
    logprobs: list[float]
    # False once its KV came through a lossy codec (a moved request's may have): never cached as a prefix
    exact_kv: bool = True
    images: PromptImages | None = None  # where a multimodal prompt's images are (their KV travels, not them)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images decoded and processed (`LLMEngine.prepare_images`), not yet encoded:
    its token ids have each image's placeholder repeated once per embedding row."""

    token_ids: list[int]
    images: PromptImages
    prepared: list[PreparedImage]  # to encode as the request is added
    embeddings: list[torch.Tensor] | None = None  # or encoded already (by an encode worker)


@dataclass(frozen=True)
class ImportReservation:
    """The blocks reserved for an incoming request's KV: the first `cached_blocks` of them were already
    in this engine's prefix cache (shared, never written); the rest await the transfer."""

    block_ids: list[int]
    cached_blocks: int
    # Blocks of the draft model's pool for the prompt's draft KV (asked for, and the pool had room); else empty.
    draft_block_ids: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class StepStats:
    num_seqs: int = 0
    num_tokens: int = 0
    quad_tokens: int = 0  # Σ new·(cached + new) over the chunks: the attention term of the cost model
    num_decode_seqs: int = 0
    num_preempted: int = 0
    forward_s: float = 0.0
    propose_s: float = 0.0  # drafting (speculative decoding)
    total_s: float = 0.0
    keys_read: int = 0  # Σ (cached + new) over the chunks: the KV attention reads


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(model_dir, config.torch_dtype, config.device, config.block_size, config.max_model_len)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.kv_layout = loaded.kv_layout

        num_blocks = config.kv_memory_bytes // loaded.kv_layout.bytes_per_block
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"kv_memory_bytes={config.kv_memory_bytes} holds {num_blocks} blocks of {config.block_size} "
                f"tokens, fewer than one sequence of max_model_len={self.max_model_len} needs; raise the "
                "budget or lower max_model_len"
            )
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv_cache = PagedKVCache(loaded.kv_layout, num_blocks, config.device)
        self.scheduler = Scheduler(config, self.pool)
        self.vision = loaded.vision
        self.image_limits = config.image_limits
        self.runner = ModelRunner(self.model, self.kv_cache, config.device,
                                  mrope=self.vision is not None and self.vision.uses_mrope)
        self.preempt_hook: Callable[[str], None] | None = None  # `set_preempt_hook`
        self.sampler = Sampler(config.device)
        self.proposer, self.draft_model = (None, None) if config.speculative is None else make_proposer(
            config.speculative, config, num_blocks, self.tokenizer.get_vocab(), self.vocab_size, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self.last_step = StepStats()
        self.step_costs = StepCostModel()  # refined by every step; seeded by `engine.profiler`
        # Steps with no prompt chunk alone: what a decode step costs, and each token a draft adds to it
        # (a prompt pass's per-token cost is far above a small decode batch's). Sizes speculation.
        self.decode_step_costs = DecodeCostModel()
        self.decode_step_shape = DecodeStepShape()  # what speculation adds to a decode step, for the router
        # How drafts fared lately, over every request: a new request's starting belief.
        self.acceptance = WorkerRecord(WORKER_RECORD_DECAY)
        self._ids = itertools.count()
        self._import_targets: dict[str, int] = {}

    # --- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        images: list[bytes] | tuple[bytes, ...] = (),
    ) -> str:
        """Queue a request; raises ValueError (naming the problem) for bad input. `images`: encoded
        images (PNG, JPEG, ...) for a vision-language model, one placeholder token in the prompt each
        (`image_token`), in order; or pass the prompt as an `ImagePrompt`. The images' vision-tower pass
        runs here, before the request is queued."""
        if images:
            prompt = self.prepare_images(prompt, images)
        seq = self._new_sequence(prompt, params or SamplingParams(), request_id, prefill_only=prefill_only)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(
        self,
        prompt: str | list[int] | ImagePrompt,
        params: SamplingParams,
        request_id: str | None,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        images: PromptImages | None = None,
    ) -> Sequence:
        """`images`: where the images of a prompt given as token ids are (an import's: no embeddings)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, ImagePrompt):
            token_ids, images = prompt.token_ids, prompt.images
        else:
            token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(token_ids, self.vocab_size, self.max_model_len, len(output_token_ids or []))
        if images is not None and images.placed[-1].end > len(token_ids):
            raise ValueError(f"images placed up to token {images.placed[-1].end} of a {len(token_ids)}-token prompt")
        seq = Sequence(request_id, token_ids, params, prefill_only=prefill_only,
                       output_token_ids=list(output_token_ids or []), images=images)
        if isinstance(prompt, ImagePrompt):  # the vision tower's pass, once the request is known to fit
            seq.image_embeddings = prompt.embeddings or self.vision.encode(prompt.prepared)
            if self.vision.uses_mrope:
                seq.mrope_positions, _ = self.vision.prompt_positions(token_ids, images)
        return seq

    @property
    def image_token(self) -> str | None:
        """The placeholder a prompt's text holds for each image (None: the model takes no images)."""
        return None if self.vision is None else self.tokenizer.convert_ids_to_tokens(self.vision.placeholder_id)

    def place_encoded(self, prompt: str | list[int], images: list[EncodedImage]) -> ImagePrompt:
        """A prompt with images another worker encoded: their placeholders expanded, their embeddings
        checked to fit this model. Reads no engine state: any thread may call it."""
        if self.vision is None:
            raise BadParameter("images", "this model takes no images (it is not a vision-language model)")
        for image in images:
            image.check_for(self.embedding_width)
        token_ids, placed = self.vision.place(self.tokenize(prompt) if isinstance(prompt, str) else list(prompt), images)
        return ImagePrompt(token_ids, placed, [], [image.embeddings for image in images])

    @property
    def embedding_width(self) -> int:
        """Values per row of the language model's input embeddings (an image's embeddings rows too)."""
        return self.model.get_input_embeddings().embedding_dim

    def prepare_images(self, prompt: str | list[int], images: list[bytes] | tuple[bytes, ...]) -> ImagePrompt:
        """Decode and process a prompt's images and expand their placeholders (no vision-tower pass:
        `add_request` runs it); BadParameter for bad images. Reads no engine state: any thread may call it."""
        if self.vision is None:
            raise BadParameter("images", "this model takes no images (it is not a vision-language model)")
        self.image_limits.check_count(len(images))
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        prepared = [self.vision.prepare(decode_image(data, self.image_limits, i)) for i, data in enumerate(images)]
        token_ids, placed = self.vision.place(token_ids, prepared)
        return ImagePrompt(token_ids, placed, prepared)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks, whatever state it is in. False if it is unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._import_targets.pop(request_id, None)
        if seq.status == SequenceStatus.HELD:
            self.scheduler.release(seq)
        else:
            self.scheduler.finish(seq, "abort")
        self._left(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return an output for every request that got a token."""
        t0 = time.perf_counter()
        if self.proposer is not None:
            self._propose(self.proposer)
        propose_s = time.perf_counter() - t0
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            if self.preempt_hook is not None:
                self.preempt_hook(seq.request_id)
            if not seq.recomputable and seq.request_id in self.requests:  # the hook did not take it elsewhere
                self.abort_request(seq.request_id)  # it cannot be computed again here: never run it without embeddings
        if not plan.chunks:
            self.last_step = StepStats(num_preempted=len(plan.preempted))
            return []
        sampling = [c for c in plan.chunks if c.samples]
        quad = sum(c.num_tokens * (c.seq.num_computed_tokens + c.num_tokens) for c in plan.chunks)
        keys = sum(c.seq.num_computed_tokens + c.num_tokens for c in plan.chunks)
        logits = self.runner.execute(plan.chunks)
        if self.config.draft_prompt_kv:
            self._draft_prompt_pass([c for c in plan.chunks
                                     if not c.seq.output_token_ids and self.draft_model.drafts_for(c.seq.params)])
        # A row per sampled position: a verifying chunk's newest token and each of its drafts.
        rows = [(c.seq, len(c.seq.output_token_ids) + j) for c in sampling for j in range(1 + len(c.draft))]
        tokens, logprobs = self.sampler(logits, *zip(*rows)) if rows else ([], [])
        for chunk in plan.chunks:
            if not chunk.draft:
                self.scheduler.mark_computed(chunk)
        outputs = []
        row = 0
        for chunk in sampling:
            end = row + 1 + len(chunk.draft)
            outputs.append(self._take_sampled(chunk, tokens[row:end], logprobs[row:end]))
            row = end
        self.last_step = StepStats(
            num_seqs=len(plan.chunks),
            num_tokens=plan.num_tokens,
            quad_tokens=quad,
            keys_read=keys,
            num_decode_seqs=sum(1 for c in plan.chunks if c.num_tokens == 1 or c.draft),
            num_preempted=len(plan.preempted),
            forward_s=self.runner.last_forward_s,
            propose_s=propose_s,
            total_s=time.perf_counter() - t0,
        )
        self.step_costs.observe(plan.num_tokens, quad, self.last_step.total_s - propose_s)  # what the pass cost
        if self.proposer is not None and self.last_step.num_decode_seqs == len(plan.chunks):  # sizes drafts
            # Without the drafting: a proposer that spends time (a draft model) weighs that itself.
            self.decode_step_costs.observe(plan.num_tokens, quad, any(c.draft for c in plan.chunks), len(plan.chunks),
                                           keys, self.last_step.total_s - propose_s)
            self.decode_step_shape.observe(plan.num_tokens, len(plan.chunks), propose_s)
        return outputs

    def _draft_prompt_pass(self, prompts: list[ScheduledChunk]) -> None:
        """The draft model's KV of these prompt chunks (`EngineConfig.draft_prompt_kv`), its layers
        shown to the layer hook after the target's (layer `num_layers + i`)."""
        hook, first = self.runner.layer_hook, self.kv_layout.num_layers
        if prompts:
            self.draft_model.prompt_pass(prompts, None if hook is None else lambda i, fed: hook(first + i, fed))

    def _propose(self, proposer: Proposer) -> None:
        """Draft tokens for every decoding sequence (no more than it could still generate), cut to the
        lengths that raise the step's goodput."""
        spec = self.config.speculative
        asking: list[DraftRequest] = []
        self.acceptance.tick()
        # Running sequences, and committed imports that join the batch this step.
        candidates = [*self.scheduler.running, *self.scheduler.ready]
        decoding = [seq for seq in candidates if seq.num_uncomputed_tokens == 1]
        for seq in candidates:
            seq.acceptance.tick()
            seq.draft_token_ids, seq.draft_probabilities = [], []
            room = min(spec.max_draft_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0 and seq.num_uncomputed_tokens == 1 and seq.params.speculative and not seq.prefill_only:
                prior = self.acceptance.of(seq.params).rate(prior=ACCEPTANCE_PRIOR)
                asking.append(DraftRequest(seq, room, seq.acceptance.rate(prior), seq.acceptance.uncertainty(prior)))
        if not asking:
            return
        cost = self._decode_cost() if spec.goodput_sizing else DecodeCost()
        budget = min(self.scheduler.num_pending_tokens, self.config.max_num_batched_tokens)
        prompt_tokens = max(0, budget - len(decoding))
        decoding_quad = sum(s.num_computed_tokens + 1 for s in decoding)
        worth = DraftWorth()  # unmeasured: drafting is worth anything
        if cost.measured:  # an accepted draft token saves this step's time per decoding sequence
            # one query per sequence: the attention term and the keys read are both its context
            step_s = cost.step_s(prompt_tokens + len(decoding), decoding_quad, False, len(decoding), keys=decoding_quad)
            worth = DraftWorth(token_s=step_s / len(decoding), verify_s=cost.verify)
        drafts = proposer.propose(asking, worth)
        drafting = [(r, draft) for r, draft in zip(asking, drafts) if draft.tokens]
        lengths = [len(draft.tokens) for _, draft in drafting]
        if cost.measured and drafting:
            lengths = draft_lengths(
                [DraftCandidate(r.seq.num_computed_tokens, d.probabilities, r.acceptance) for r, d in drafting],
                cost, other_tokens=prompt_tokens + len(decoding) - len(drafting),
                other_quad=decoding_quad - sum(r.seq.num_computed_tokens + 1 for r, _ in drafting),
                other_seqs=len(decoding) - len(drafting))
        for (request, draft), length in zip(drafting, lengths):
            seq = request.seq
            seq.draft_token_ids, seq.draft_probabilities = draft.tokens[:length], draft.probabilities[:length]

    def _decode_cost(self) -> DecodeCost:
        """The cost of decode steps, drafts included, as measured; the whole fit until there is one."""
        decode = self.decode_step_costs.cost
        return decode if decode.measured else DecodeCost(*self.step_costs.coefficients.as_tuple())

    def _take_sampled(self, chunk: ScheduledChunk, tokens: list[int], logprobs: list[float | None]) -> RequestOutput:
        """Append a sampled chunk's tokens to its sequence: the one token sampled, or for a verifying
        chunk the drafts that agree with what was sampled at their positions and the token sampled
        after the last of them; each checked for a stop, as decoding them one by one would."""
        seq = chunk.seq
        accepted = 0
        while accepted < len(chunk.draft) and chunk.draft[accepted] == tokens[accepted]:
            accepted += 1
        if chunk.draft:  # before the tokens are appended: the proposer matches the draft to its proposal
            self.proposer.verified(seq, chunk.draft, accepted)
        new: list[int] = []
        reason = None
        for token, logprob in zip(tokens[: accepted + 1], logprobs):
            seq.append_token(token, logprob)
            new.append(token)
            reason = self._stop_reason(seq)
            if reason:
                break
        if chunk.draft:
            rejected = accepted < len(chunk.draft)
            seq.num_draft_tokens += len(chunk.draft)
            seq.num_accepted_tokens += len(new) - 1
            seq.num_verifications += 1
            seq.num_rejected_drafts += rejected
            seq.acceptance.observe(len(new) - 1, rejected)
            self.acceptance.of(seq.params).observe(len(new) - 1, rejected)
            self.scheduler.mark_verified(chunk)
        if reason:
            self.scheduler.finish(seq, reason)
            if seq.status == SequenceStatus.FINISHED:
                del self.requests[seq.request_id]
                self._left(seq)
        return self._output(seq, new)

    def _left(self, seq: Sequence) -> None:
        """`seq` is no longer this engine's: its proposer state goes (its output may feed others' drafts)."""
        if self.proposer is not None:
            self.proposer.finished(seq)

    def _stop_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        token = seq.output_token_ids[-1]
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._match_stop_string(seq):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return "prefilled" if seq.prefill_only else None

    def _match_stop_string(self, seq: Sequence) -> bool:
        if seq.stop_strings is None:  # a request moved here brings its output: its first search reads it all
            seq.stop_strings = StopStrings(self.tokenizer, seq.params.stop)
        return seq.stop_strings.found(seq.output_token_ids)

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        finished = seq.is_finished
        text = ""
        if finished:
            # Cut where the whole text has a stop string (where a stream of bytes that are not UTF-8 showed
            # them otherwise, the stream's text may have had it elsewhere).
            text = cut_at_stop(self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True), seq.params.stop)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=new_tokens,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
            num_verifications=seq.num_verifications,
            num_rejected_drafts=seq.num_rejected_drafts,
            num_model_verifications=seq.num_model_verifications,
        )

    # --- KV handoff: sending side ---------------------------------------------------------------
    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Call `hook(layer, chunks)` during each forward pass as soon as a layer's KV is written."""
        self.runner.layer_hook = hook

    def layer_blocks(self, seq: Sequence, layer: int) -> list[int]:
        """The blocks holding `seq`'s KV of `layer` (as the layer hook numbers them): the target's
        layers', or past them the draft model's (`EngineConfig.draft_prompt_kv`)."""
        if layer < self.kv_layout.num_layers:
            return list(seq.block_table)
        return self.draft_model.blocks_of(seq.request_id)

    def set_preempt_hook(self, hook: Callable[[str], None] | None) -> None:
        """Call `hook(request_id)` for each request a step preempts, before that step's forward pass
        writes into the blocks it gave up: whoever still reads that request's KV from its old blocks
        (a sender behind the layer hook) must stop."""
        self.preempt_hook = hook

    def _held(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None or seq.status != SequenceStatus.HELD:
            raise KeyError(f"request {request_id!r} is not held for export (add it with prefill_only=True)")
        return seq

    def hold_decoding(self, request_id: str) -> RequestHandoff | None:
        """Take a decoding request out of the batch, keeping its KV (HELD, as a prefill-only request
        after its pass), to move it to another engine; its handoff. None when it has no KV to move
        (unknown, finished, waiting, or prefilling here): it can only move by recompute."""
        seq = self.requests.get(request_id)
        if seq is None or not seq.output_token_ids or not self.scheduler.hold(seq):
            return None
        seq.draft_token_ids, seq.draft_probabilities = [], []  # proposed for a step it will not take here
        return self.export_handoff(request_id)

    def resume_held(self, request_id: str) -> None:
        """Put a request `hold_decoding` took out back into the batch (its move failed)."""
        self.scheduler.add_ready(self._held(request_id))

    def export_handoff(self, request_id: str) -> RequestHandoff:
        seq = self._held(request_id)
        return RequestHandoff(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            output_token_ids=list(seq.output_token_ids),
            params=seq.params,
            num_computed_tokens=seq.num_computed_tokens,
            logprobs=list(seq.logprobs),
            exact_kv=seq.exact_kv,
            images=seq.images,
        )

    def export_kv(self, request_id: str, block_indices: list[int] | None = None, layer: int | None = None) -> KVBlocks:
        """KV of chosen blocks of a held request: every layer (layer=None) or one layer."""
        seq = self._held(request_id)
        indices = list(range(len(seq.block_table))) if block_indices is None else list(block_indices)
        if layer is not None and not 0 <= layer < self.kv_layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.kv_layout.num_layers}), got {layer}")
        data = self.kv_cache.read([seq.block_table[i] for i in indices], layer)
        return KVBlocks(request_id, indices, layer, data, seq.num_computed_tokens, self.config.block_size)

    def release(self, request_id: str) -> None:
        """Free a held request's blocks once its KV has been handed over."""
        seq = self._held(request_id)
        del self.requests[request_id]
        self.scheduler.release(seq)
        self._left(seq)

    # --- KV handoff: receiving side -------------------------------------------------------------
    def begin_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     num_kv_tokens: int, draft_kv: bool = False,
                     output_token_ids: list[int] | tuple[int, ...] = (),
                     images: PromptImages | None = None) -> ImportReservation:
        """Reserve blocks for `num_kv_tokens` tokens of an incoming request, reusing the full leading
        blocks this engine's prefix cache holds (the sender skips those); `draft_kv`: and blocks of
        the draft model's pool for their draft KV, where it has room (`ImportReservation`).
        `output_token_ids`: the tokens a moved request has sampled already, whose KV (all but the
        last's) comes too. `images`: a multimodal prompt's (its KV is cached under their content).

        Raises OutOfBlocks when the pool cannot hold them, ValueError for a bad request.
        """
        seq = self._new_sequence(prompt_token_ids, params, request_id, output_token_ids=list(output_token_ids),
                                 images=images)
        if not 0 < num_kv_tokens <= seq.num_tokens:
            raise ValueError(f"an import must carry 1..{seq.num_tokens} tokens of KV, got {num_kv_tokens}")
        if images is not None and num_kv_tokens < images.placed[-1].end:
            raise ValueError(f"an import of a prompt with images must carry the KV of every image token "
                             f"({images.placed[-1].end}), got {num_kv_tokens}")
        bs = self.config.block_size
        hashes = hash_prompt_blocks(seq.token_ids[: num_kv_tokens // bs * bs], bs, seq.block_extra)
        hits = self.pool.lookup_prefix(hashes)
        need = -(-num_kv_tokens // bs) - len(hits)
        if not self.pool.can_allocate(need):
            self.pool.free(hits)
            raise OutOfBlocks(f"request {request_id!r} needs {need} KV blocks, {self.pool.num_free} free",
                              self.pool.num_free)
        seq.block_table = hits + self.pool.allocate(need)
        self.pool.count_lookup(len(hashes), len(hits))
        seq.block_hashes = hashes[: len(hits)]
        seq.num_cached_tokens = len(hits) * bs
        seq.status = SequenceStatus.IMPORTING
        self.requests[seq.request_id] = seq
        self._import_targets[seq.request_id] = num_kv_tokens
        draft = self.draft_model
        try:
            wanted = draft_kv and draft is not None and draft.drafts_for(params)
            draft_blocks = draft.reserve_import(request_id, num_kv_tokens) if wanted else []
        except BaseException:  # no one else would free what the import holds
            self.abort_request(request_id)
            raise
        return ImportReservation(list(seq.block_table), len(hits), draft_blocks)

    def import_kv(self, kv: KVBlocks) -> None:
        seq = self.requests.get(kv.request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING:
            raise KeyError(f"request {kv.request_id!r} has no import in progress")
        if kv.block_size != self.config.block_size:
            raise ValueError(f"KV block size {kv.block_size} differs from this engine's {self.config.block_size}")
        if any(not 0 <= i < len(seq.block_table) for i in kv.block_indices):
            raise ValueError(f"block indices {kv.block_indices} outside the {len(seq.block_table)} reserved")
        self.kv_cache.write([seq.block_table[i] for i in kv.block_indices], kv.data, kv.layer)

    def commit_import(self, handoff: RequestHandoff, exact: bool = True, draft_arrived: bool = False) -> None:
        """The KV is complete: add the tokens sampled so far and queue the request for the batch.
        `exact`: False when the KV came through a lossy codec (it is then never cached as a prefix);
        `draft_arrived`: the draft model's KV filled its reserved blocks too (else it is computed here)."""
        seq = self.requests.get(handoff.request_id)
        if seq is None or seq.status != SequenceStatus.IMPORTING:
            raise KeyError(f"request {handoff.request_id!r} has no import in progress")
        _check_logprobs(handoff)
        reserved = self._import_targets[handoff.request_id]
        if handoff.num_computed_tokens != reserved or not handoff.output_token_ids:
            raise ValueError(
                f"handoff of {handoff.request_id!r} covers {handoff.num_computed_tokens} tokens with "
                f"{len(handoff.output_token_ids)} sampled; {reserved} tokens were reserved and at least one "
                "sampled token is needed"
            )
        known = len(seq.output_token_ids)  # sampled before the reservation (a moved request's)
        if handoff.output_token_ids[:known] != seq.output_token_ids:
            raise ValueError(f"handoff of {handoff.request_id!r} does not continue the tokens it was reserved with")
        del self._import_targets[handoff.request_id]
        for token in handoff.output_token_ids[known:]:
            seq.append_token(token, None)
        seq.logprobs = list(handoff.logprobs)
        seq.num_computed_tokens = reserved
        seq.exact_kv = exact and handoff.exact_kv
        if self.draft_model is not None:
            self.draft_model.import_committed(seq.request_id, reserved if draft_arrived else 0)
        self.scheduler.publish_full_blocks(seq)
        self.scheduler.add_ready(seq)

    def resume_request(self, handoff: RequestHandoff, prompt: ImagePrompt | None = None) -> None:
        """Continue a request from its tokens alone (prompt + those sampled so far), recomputing the KV
        here: the fallback when its KV cannot arrive. An import in progress for it is dropped first.
        A prompt with images is recomputed from them: `prompt`, prepared again from the request's images
        (the handoff's prompt is then the one before its placeholders were expanded)."""
        _check_logprobs(handoff)
        if handoff.images is not None:  # its prompt pass needs the embeddings, which stay where it was encoded
            raise ValueError(f"request {handoff.request_id!r} has images: it is recomputed from them, not from "
                             "its handoff")
        if handoff.request_id in self.requests:
            self.abort_request(handoff.request_id)
        seq = self._new_sequence(prompt or handoff.prompt_token_ids, handoff.params, handoff.request_id,
                                 output_token_ids=handoff.output_token_ids)
        seq.logprobs = list(handoff.logprobs)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)


def _check_logprobs(handoff: RequestHandoff) -> None:
    """A handoff carries a logprob for each sampled token, or none (nobody asked for them)."""
    if len(handoff.logprobs) not in (0, len(handoff.output_token_ids)):
        raise ValueError(f"handoff of {handoff.request_id!r} has {len(handoff.logprobs)} logprobs for "
                         f"{len(handoff.output_token_ids)} sampled tokens")
