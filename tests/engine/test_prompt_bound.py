"""The bound that lets the router refuse a prompt too long for the context before tokenizing it: no
token stands for more than `max_token_chars` characters, so a text holds at least len(text) /
max_token_chars tokens. The bound is read from tokenizers that keep every character (byte-level BPE,
byte-fallback BPE) and withheld from those that can drop text; for the former it holds on any text."""

from __future__ import annotations

import pytest
from fuzz_strategies import ODD_TEXT, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pdserve.engine.model_loader import load_tokenizer, max_token_chars
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.models.tokenizer import build_tokenizer
from pdserve.engine.sampling_params import check_prompt_text


def wrapped(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def byte_fallback_bpe() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE as Llama 2, Mistral and Gemma have it: spaces become ▁, characters the
    vocabulary lacks fall back to their bytes, unknown tokens fused."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}}
    for piece in ("▁", "t", "h", "e", "▁t", "he", "▁the", "▁theeeeeeeeee"):
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return wrapped(tokenizer)


def bpe(vocab: dict[str, int], **kwargs: object) -> Tokenizer:
    return Tokenizer(models.BPE(vocab=vocab, merges=[], **kwargs))


def dropping_whitespace() -> PreTrainedTokenizerFast:
    tokenizer = bpe({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return wrapped(tokenizer)


def composing() -> PreTrainedTokenizerFast:
    tokenizer = bpe({"a": 0, "?": 1}, unk_token="?")
    tokenizer.normalizer = normalizers.NFKC()
    return wrapped(tokenizer)


def wordpiece() -> PreTrainedTokenizerFast:
    return wrapped(Tokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")))


def missing_bytes() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose vocabulary lacks most bytes and that has no unknown token: it skips them."""
    tokenizer = bpe({"a": 0, "b": 1})
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    return wrapped(tokenizer)


def stripping_added_token() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(256, 0).backend_tokenizer
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # takes in every space before it
    return wrapped(tokenizer)


def test_the_bound_is_the_longest_token_of_a_tokenizer_that_keeps_every_character():
    pystd = load_tokenizer(resolve_model("pystd-llama"))
    assert max_token_chars(pystd) == max(len(t) for t in pystd.backend_tokenizer.get_vocab())
    assert max_token_chars(build_tokenizer(256, 0)) == max(len(t) for t in build_tokenizer(256, 0).get_vocab())
    assert max_token_chars(byte_fallback_bpe()) == len("▁theeeeeeeeee")


@pytest.mark.parametrize("make", [dropping_whitespace, composing, wordpiece, missing_bytes, stripping_added_token])
def test_no_bound_from_a_tokenizer_that_can_drop_text(make):
    tokenizer = make()
    assert max_token_chars(tokenizer) is None
    # What the bound would have wrongly refused: a text much longer than its tokens can cover.
    text = {dropping_whitespace: "a" + " " * 100, composing: "\u1100\u1161\u11a8" * 30, wordpiece: "a" * 80,
            missing_bytes: "a" + "z" * 100, stripping_added_token: " " * 100 + "<mask>"}[make]
    longest = max(len(t) for t in tokenizer.get_vocab())
    assert len(tokenizer.encode(text, add_special_tokens=False)) * longest < len(text)


BOUNDED = {"pystd-llama": lambda: load_tokenizer(resolve_model("pystd-llama")),
           "preset": lambda: build_tokenizer(256, 0), "byte-fallback": byte_fallback_bpe}


@pytest.fixture(scope="module", params=sorted(BOUNDED))
def bounded(request) -> tuple[PreTrainedTokenizerFast, int]:
    tokenizer = BOUNDED[request.param]()
    return tokenizer, max_token_chars(tokenizer)


@st.composite
def texts(draw: st.DrawFn, vocab: list[str]) -> str:
    """Odd unicode, runs of spaces and newlines, and texts made of the tokenizer's longest tokens."""
    pieces = st.one_of(ODD_TEXT, st.sampled_from([" " * 50, "\n" * 30, "\t \u3000" * 10, "<|eos|>", "▁" * 20]),
                       st.sampled_from(vocab))
    return "".join(draw(st.lists(pieces, max_size=8)))


@fuzz_settings(300)
@given(data=st.data())
def test_a_text_holds_at_least_its_length_over_the_bound_in_tokens(bounded, data):
    tokenizer, bound = bounded
    longest = sorted(tokenizer.get_vocab(), key=len)[-20:]
    text = data.draw(texts([tokenizer.convert_tokens_to_string([t]) for t in longest]))
    assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)


def test_text_past_the_bound_is_refused_and_text_at_it_is_not():
    check_prompt_text("x" * 511 * 7, max_token_chars=7, max_model_len=512)  # may fit: tokenized, then judged
    check_prompt_text("x" * 10**6, max_token_chars=None, max_model_len=512)  # no bound: always tokenized
    with pytest.raises(ValueError, match=r"prompt has 3578 characters, more than the 3577 that can fit the context "
                                         r"limit of 512 tokens"):
        check_prompt_text("x" * (511 * 7 + 1), max_token_chars=7, max_model_len=512)
