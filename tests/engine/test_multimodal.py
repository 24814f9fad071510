"""Vision-language models in the engine: prompts with images give transformers' own greedy output,
alone, batched, chunked, from the prefix cache and after a move; bad images are refused."""

from __future__ import annotations

import io

import pytest
from helpers import VISION_PRESETS, assert_pool_idle, drain, noise_png
from PIL import Image

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.multimodal.images import ImageLimits
from pdserve.engine.sampling_params import BadParameter

NEW_TOKENS = 10
GREEDY = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
# Sizes the Qwen2-VL preset turns into 4 to 28 tokens; LLaVA's crop makes 16 of any.
A, B, C = noise_png(1, 56, 56), noise_png(2, 200, 120), noise_png(3, 90, 150)


@pytest.fixture
def references(vision_references):
    return vision_references


def engine_for(vision_models, family: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_memory_bytes", 8 * 2**20)
    return LLMEngine(vision_models[family], EngineConfig(**kwargs))


def prompt(engine: LLMEngine, text: str) -> str:
    return text.replace("<img>", engine.image_token)


def run(engine: LLMEngine, requests: list[tuple[str, list[bytes]]], params: SamplingParams = GREEDY):
    ids = [engine.add_request(prompt(engine, text), params, images=images) for text, images in requests]
    expanded = [list(engine.requests[i].prompt_token_ids) for i in ids]
    return expanded, drain(engine, ids)


REQUESTS = [
    ("a question with no picture at all, only text", []),
    ("describe <img> briefly", [A]),
    ("compare <img> with <img> and say which is larger", [B, C]),
    ("<img> then <img> then <img> again", [C, A, C]),
]


@pytest.mark.parametrize("family", VISION_PRESETS)
@pytest.mark.parametrize("chunk", [None, 7])
def test_greedy_with_images_matches_generate_alone_and_batched(vision_models, references, family, chunk):
    engine = engine_for(vision_models, family, prefill_chunk_size=chunk, max_num_batched_tokens=64)
    expanded, batched = run(engine, REQUESTS)
    want = [references[family].greedy(ids, images, NEW_TOKENS) for ids, (_, images) in zip(expanded, REQUESTS)]
    assert [o.token_ids for o in batched] == want
    alone = [run(engine, [request])[1][0].token_ids for request in REQUESTS[1:3]]
    assert alone == want[1:3]
    assert_pool_idle(engine)


@pytest.mark.parametrize("family", VISION_PRESETS)
def test_the_prefix_cache_tells_images_apart(vision_models, references, family):
    engine = engine_for(vision_models, family, block_size=4)
    text = "look at this picture <img> and tell me what you see in it, in a few words"
    (first_ids,), (first,) = run(engine, [(text, [B])])
    (_,), (again,) = run(engine, [(text, [B])])
    (other_ids,), (other,) = run(engine, [(text, [C])])
    image_offset = engine.tokenize("look at this picture ").__len__()
    assert again.token_ids == first.token_ids == references[family].greedy(first_ids, [B], NEW_TOKENS)
    assert again.num_cached_tokens >= len(first_ids) - 4  # all but the last block: the image's KV reused
    # Same token ids (the placeholders), another image: nothing past the text before the image is reused.
    assert other_ids[:image_offset] == first_ids[:image_offset]
    assert other.num_cached_tokens <= image_offset
    assert other.token_ids == references[family].greedy(other_ids, [C], NEW_TOKENS)
    assert_pool_idle(engine)


@pytest.mark.parametrize("family", VISION_PRESETS)
def test_a_request_with_images_moves_to_another_engine_exactly(vision_models, references, family):
    source, target = engine_for(vision_models, family), engine_for(vision_models, family)
    text, images = REQUESTS[2]
    request_id = source.add_request(prompt(source, text), GREEDY, images=images)
    expanded = list(source.requests[request_id].prompt_token_ids)
    for _ in range(100):  # the prompt pass and a few tokens
        source.step()
        if len(source.requests[request_id].output_token_ids) >= 3:
            break
    handoff = source.hold_decoding(request_id)
    assert handoff is not None and handoff.images is not None
    target.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens,
                        output_token_ids=handoff.output_token_ids[:-1], images=handoff.images)
    target.import_kv(source.export_kv(request_id))
    target.commit_import(handoff)
    source.release(request_id)
    (moved,) = drain(target, [request_id])
    assert moved.token_ids == references[family].greedy(expanded, images, NEW_TOKENS)
    with pytest.raises(ValueError, match="images"):  # its prompt pass needs embeddings it no longer has
        source.resume_request(handoff)
    assert_pool_idle(source)
    assert_pool_idle(target)


def huge_png() -> bytes:
    """A few KiB of PNG that decodes to 100 megapixels."""
    out = io.BytesIO()
    Image.new("RGB", (10_000, 10_000)).save(out, "PNG")
    return out.getvalue()


def test_bad_images_are_refused_by_name_and_the_engine_keeps_serving(vision_models, references, model_dirs):
    family = VISION_PRESETS[0]
    engine = engine_for(vision_models, family)
    engine.image_limits = ImageLimits(max_images=2, max_bytes=1 << 20, max_pixels=1000 * 1000)
    one = prompt(engine, "see <img>")
    bad = {
        "truncated": (one, [A[: len(A) // 2]]),
        "not an image": (one, [b"%PDF-1.4 definitely not a picture"]),
        "too many pixels": (one, [huge_png()]),
        "too thin": (one, [noise_png(4, 1, 200)]),
        "too many bytes": (one, [b"\x89PNG" + bytes(2 << 20)]),
        "too many images": (prompt(engine, "<img><img><img>"), [A, A, A]),
        "placeholders differ from images": (prompt(engine, "see <img> and <img>"), [A]),
        "not bytes": (one, ["a string"]),
    }
    for case, (text, images) in bad.items():
        with pytest.raises(BadParameter) as refused:
            engine.add_request(text, GREEDY, images=images)
        assert refused.value.param == "images", case
        assert not engine.requests, case
    text_only = LLMEngine(model_dirs["tiny-llama"], EngineConfig(kv_memory_bytes=8 * 2**20))
    with pytest.raises(BadParameter, match="takes no images"):
        text_only.add_request("see this", GREEDY, images=[A])
    expanded, (served,) = run(engine, [("see <img>", [A])])
    assert served.token_ids == references[family].greedy(expanded[0], [A], NEW_TOKENS)


def test_adjacent_images_of_an_mrope_model_are_refused_by_name(vision_models):
    engine = engine_for(vision_models, "tiny-qwen2-vl")
    with pytest.raises(BadParameter, match="adjacent"):
        engine.add_request(prompt(engine, "see <img><img> now"), GREEDY, images=[A, B])
    assert not engine.requests


def target_block_bytes(vision_models) -> int:
    """Bytes of one 4-token KV block of the Qwen2-VL preset."""
    engine = engine_for(vision_models, "tiny-qwen2-vl", block_size=4)
    return engine.kv_layout.bytes_per_block


def test_an_imported_request_with_images_is_never_recomputed_without_its_embeddings(vision_models):
    """Out of KV memory, an engine recomputes a preempted request from its tokens later; an imported one
    with images has no embeddings here to do it with, so it is ended (a worker's hook hands it back to
    the router first), and the engine goes on serving the others."""
    source = engine_for(vision_models, "tiny-qwen2-vl", block_size=4)
    text, images = REQUESTS[2]
    request_id = source.add_request(prompt(source, text), SamplingParams.greedy(max_tokens=40, ignore_eos=True),
                                    request_id="moved", images=images)
    for _ in range(100):
        source.step()
        if source.requests[request_id].output_token_ids:
            break
    handoff = source.hold_decoding(request_id)
    # 40 blocks of 4 tokens: the four requests outgrow them as they decode
    target = engine_for(vision_models, "tiny-qwen2-vl", block_size=4, max_model_len=128,
                        kv_memory_bytes=40 * target_block_bytes(vision_models))
    others = [target.add_request(f"some text only prompt number {i}", SamplingParams.greedy(max_tokens=40,
                                                                                           ignore_eos=True))
              for i in range(3)]
    for _ in range(3):  # the text prompts run first: the import joins behind them, the first to give way
        target.step()
    target.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens,
                        images=handoff.images)
    target.import_kv(source.export_kv(request_id))
    target.commit_import(handoff)
    source.release(request_id)
    preempted: list[str] = []
    target.set_preempt_hook(preempted.append)
    outputs = drain(target, others)
    assert request_id in preempted and request_id not in target.requests
    assert all(len(o.token_ids) == 40 for o in outputs)
    assert_pool_idle(target)


@pytest.mark.parametrize("family", VISION_PRESETS)
def test_the_routers_estimate_of_an_images_tokens_is_what_the_engine_expands_it_to(vision_models, family):
    from transformers import AutoConfig

    from pdserve.engine.multimodal.vision import tokens_per_image

    engine = engine_for(vision_models, family)
    square = noise_png(9, 300, 300)
    expanded = engine.prepare_images(prompt(engine, "<img>"), [square]).token_ids
    assert tokens_per_image(vision_models[family], AutoConfig.from_pretrained(vision_models[family]), 300) == len(expanded)
