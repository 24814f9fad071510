"""Output text decoded as tokens come (`engine.detokenizer`) against decoding every token again, the
router's text deltas against the final text, over every family's tokenizer and the shipped one, on
text and on random ids (bytes that are not UTF-8 included)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from pdserve.engine.detokenizer import GrowingText, StopStrings, TextStream
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.frontend import Detokenizer

TEXTS = ["def f(x):\n    return x + 1  # é ü 日本語 🙂\n", "  leading spaces\tand\ttabs\n\nthen text.",
         "He said : it 's fine , do n't ask ! Hello, world?"]


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama 2 style tokenizer: SentencePiece's ▁ for spaces, bytes as <0xNN> tokens, and a decoder
    that strips the text's leading space, so that text decoded from ids that are not UTF-8 is not
    always the start of the text of more ids (tokenizers' stream then raises)."""
    vocab = {"<unk>": 0, "</s>": 1, "▁": 2, "a": 3, "b": 4, "▁a": 5, "ab": 6, "é": 7}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(model_dirs) -> dict[str, PreTrainedTokenizerFast]:
    found = {name: load_tokenizer(path) for name, path in model_dirs.items()}
    found["shipped"] = load_tokenizer(resolve_model("pystd-llama"))
    found["byte-fallback"] = byte_fallback_tokenizer()
    cleaning = load_tokenizer(model_dirs["tiny-llama"])
    # " ." becomes "." after decoding (transformers skips it for BPE unless forced): the stream cannot follow
    cleaning.clean_up_tokenization_spaces = True
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    found["cleaning-up"] = cleaning
    return found


def text_ids(tokenizer) -> list[list[int]]:
    """Real text's ids, one text long enough to fold `GrowingText`."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in [*TEXTS, "".join(TEXTS) * 12]]


def random_ids(tokenizer, rng: random.Random, count: int) -> list[list[int]]:
    """Random ids: special tokens and byte tokens that are not UTF-8 among them."""
    return [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 48))] for _ in range(count)]


def id_lists(tokenizer, rng: random.Random, count: int = 150) -> list[list[int]]:
    return text_ids(tokenizer) + random_ids(tokenizer, rng, count)


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """`ids` in runs of 1 to 3, as engine steps with drafts accepted deliver them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(ids[i : i + n])
        i += n
    return out


def test_the_text_is_every_token_decoded_again_without_an_incomplete_end(tokenizers):
    """At every run of tokens for byte-level tokenizers. A byte-fallback one decodes a run of byte tokens
    that is not all UTF-8 as one � per byte, the complete characters in it too: on text, the stream has
    those characters at once, and the same text when the run is complete; on bytes that are not UTF-8
    the stream and decoding again may show them differently."""
    rng = random.Random(0)
    for name, tokenizer in tokenizers.items():
        for ids in id_lists(tokenizer, rng):
            final = tokenizer.decode(ids, skip_special_tokens=True)
            stream, fed, checked = TextStream(tokenizer), [], 0
            for run in chunks(ids, rng):
                stream.add(run)
                fed += run
                if len(fed) - checked < 50 and len(ids) > 100:
                    continue  # a long text: checked every 50 tokens or so, each check decoding it all
                checked = len(fed)
                whole = tokenizer.decode(fed, skip_special_tokens=True).rstrip("\ufffd")
                if name != "byte-fallback":
                    assert stream.text == whole and stream.length == len(whole), (name, fed)
                elif "\ufffd" not in final:
                    assert stream.text.startswith(whole), (name, fed)
            if name != "byte-fallback" or "\ufffd" not in final:
                assert stream.text == final.rstrip("\ufffd"), (name, ids)


def test_a_stream_that_tokenizers_cannot_follow_is_decoded_whole_from_then_on():
    """tokenizers raises where the text of a byte run stops being the start of the next text; the text
    is then the whole decode's, with no piece of it twice."""
    tokenizer = byte_fallback_tokenizer()
    byte = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xFF)}
    stream = TextStream(tokenizer)
    for run in ([byte[0xC3], byte[0xA9]], [byte[0xFF], tokenizer.convert_tokens_to_ids("a"), byte[0xC3]], [byte[0xA9]]):
        stream.add(run)
        assert stream.text == tokenizer.decode(stream.ids, skip_special_tokens=True).rstrip("\ufffd")
    assert stream.text == "\ufffd" * 3 + "aé"


def test_growing_text_reads_its_end_across_folds():
    text, plain = GrowingText(), ""
    for i in range(3 * GrowingText.FOLD + 7):
        piece = f"{i}é" if i % 3 else ""
        text.append(piece)
        plain += piece
        start = max(0, len(plain) - (i % 17))
        assert text.tail(start) == plain[start:] and text.length == len(plain)
    assert str(text) == plain and text.tail(0) == plain and text.tail(len(plain) + 5) == ""


def test_the_byte_fallback_tokenizer_makes_tokenizers_stream_raise():
    """What the test above relies on to reach the stream's restart."""
    tokenizer, rng, raised = byte_fallback_tokenizer(), random.Random(1), 0
    for ids in id_lists(tokenizer, rng, 300):
        stream = DecodeStream(skip_special_tokens=True)
        try:
            for token in ids:
                stream.step(tokenizer.backend_tokenizer, token)
        except Exception:
            raised += 1
    assert raised > 0


def test_stop_strings_are_found_where_searching_the_whole_text_finds_them(tokenizers):
    """Output given one token or several at a time (a sequence moved here brings all of its output)."""
    rng = random.Random(2)
    for name, tokenizer in tokenizers.items():
        if name == "byte-fallback":  # the stream may see a character sooner than decoding again (above)
            continue
        for ids in id_lists(tokenizer, rng, 60):
            if len(ids) > 100:
                continue  # the long text: every prefix of it would be decoded whole
            text = tokenizer.decode(ids, skip_special_tokens=True)
            stops = [text[i : i + rng.randint(1, 4)] for i in sorted(rng.sample(range(len(text)), min(2, len(text))))]
            stops = [s for s in stops if s and "\ufffd" not in s] or ["never in the text"]
            search, k = StopStrings(tokenizer, stops), 0
            while k < len(ids):
                k = min(len(ids), k + rng.choice([1, 1, 2, 5]))
                whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
                expected = any(s in whole for s in stops)
                assert search.found(ids[:k]) == expected, (name, ids[:k], stops)
                if expected:
                    break


def stream_through_router(tokenizer, ids: list[int], stop: list[str], rng: random.Random) -> str:
    """What a client receives of `ids`: the deltas, then the rest of the worker's final text. Asserts on
    the way that no delta runs past where a stop string could still cut the text."""
    hold = max((len(s) for s in stop), default=1) - 1
    detok, received, fed = Detokenizer(tokenizer, SamplingParams(stop=stop)), "", []
    for run in chunks(ids, rng):
        received += detok.add(run)
        fed += run
        assert len(received) <= max(0, len(tokenizer.decode(fed, skip_special_tokens=True)) - hold)
    return received + detok.finish(tokenizer.decode(ids, skip_special_tokens=True))


def test_the_routers_deltas_and_its_final_part_make_the_final_text(tokenizers):
    """On text cut after any token (`max_tokens` may end a request inside a character), and on random
    ids (bytes that are not UTF-8 aside, for the byte-fallback tokenizer)."""
    rng = random.Random(3)
    for name, tokenizer in tokenizers.items():
        texts = [ids for ids in text_ids(tokenizer) if len(ids) <= 100]
        cases = [ids[:end] for ids in texts for end in range(1, len(ids) + 1)] + random_ids(tokenizer, rng, 60)
        for ids in cases:
            final = tokenizer.decode(ids, skip_special_tokens=True)
            if name == "byte-fallback" and "\ufffd" in final and not any(ids == t[: len(ids)] for t in texts):
                continue  # random bytes: the stream may show them otherwise than the final text does
            stop = rng.choice([[], ["\n\n"], ["zzzz", "q"]])
            assert stream_through_router(tokenizer, ids, stop, rng) == final, (name, ids, stop)
