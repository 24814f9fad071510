"""Output text decoded as tokens come (`engine.detokenizer`) against decoding every token again, the
router's text deltas against the final text, over every family's tokenizer and the shipped one, on
text and on random ids (bytes that are not UTF-8 included)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from pdserve.engine.detokenizer import StopStrings, TextStream
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.frontend import Detokenizer

TEXTS = ["def f(x):\n    return x + 1  # é ü 日本語 🙂\n", "  leading spaces\tand\ttabs\n\nthen text.", "Hello, world!"]


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
    cleaning.clean_up_tokenization_spaces = True  # " ." becomes "." after decoding: the stream cannot follow
    found["cleaning-up"] = cleaning
    return found


def id_lists(tokenizer, rng: random.Random, count: int = 150) -> list[list[int]]:
    """Real text's ids, and random ids (special tokens and byte tokens that are not UTF-8 among them)."""
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    return texts + [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 48))] for _ in range(count)]


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """`ids` in runs of 1 to 3, as engine steps with drafts accepted deliver them."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(ids[i : i + n])
        i += n
    return out


def test_the_text_is_every_token_decoded_again_without_an_incomplete_end(tokenizers):
    """At every token for byte-level tokenizers. A byte-fallback one decodes a run of byte tokens that is
    not all UTF-8 as one � per byte, the complete characters in it too: on text, the stream has those
    characters at once, and the same text when the run is complete; on bytes that are not UTF-8 the two
    show them differently (and the stream restarts where tokenizers' raises)."""
    rng = random.Random(0)
    for name, tokenizer in tokenizers.items():
        for ids in id_lists(tokenizer, rng):
            final = tokenizer.decode(ids, skip_special_tokens=True)
            if name == "byte-fallback" and "\ufffd" in final:
                TextStream(tokenizer).add(ids)
                continue
            stream, fed = TextStream(tokenizer), []
            for run in chunks(ids, rng):
                stream.add(run)
                fed += run
                whole = tokenizer.decode(fed, skip_special_tokens=True).rstrip("\ufffd")
                assert stream.text == whole or (name == "byte-fallback" and stream.text.startswith(whole)), (name, fed)
            assert stream.text == final.rstrip("\ufffd"), (name, ids)


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
    rng = random.Random(2)
    for name, tokenizer in tokenizers.items():
        if name == "byte-fallback":  # the stream sees a character sooner than decoding again (above)
            continue
        for ids in id_lists(tokenizer, rng, 60):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            stops = [text[i : i + rng.randint(1, 4)] for i in sorted(rng.sample(range(len(text)), min(2, len(text))))]
            stops = [s for s in stops if s and "\ufffd" not in s] or ["never in the text"]
            search = StopStrings(tokenizer, stops)
            for k in range(1, len(ids) + 1):
                whole = tokenizer.decode(ids[:k], skip_special_tokens=True)
                cuts = [i for i in (whole.find(s) for s in stops) if i >= 0]
                assert search.find(ids[:k]) == (min(cuts) if cuts else None), (name, ids[:k], stops)
                if cuts:
                    break


def test_the_routers_deltas_and_its_final_part_make_the_final_text(tokenizers):
    """The deltas a client receives, then the rest of the worker's final text, are that text; with stop
    strings, no delta runs past where a stop string could still cut the text."""
    rng = random.Random(3)
    for name, tokenizer in tokenizers.items():
        for ids in id_lists(tokenizer, rng, 60):
            stop = rng.choice([[], ["\n\n"], ["zzzz", "q"]])
            hold = max((len(s) for s in stop), default=1) - 1
            detok, received, fed = Detokenizer(tokenizer, SamplingParams(stop=stop)), "", []
            for run in chunks(ids, rng):
                received += detok.add(run)
                fed += run
                shown = tokenizer.decode(fed, skip_special_tokens=True).rstrip("\ufffd")
                assert len(received) <= max(0, len(shown) - hold) or name == "byte-fallback", (name, fed)
            final = tokenizer.decode(ids, skip_special_tokens=True)
            if name == "byte-fallback" and "\ufffd" in final:
                continue  # the stream has characters that the final text's run of bytes shows as �
            assert received + detok.finish(final) == final, (name, ids)
