"""Byte-level BPE tokenizers the project trains itself, so no tokenizer is ever downloaded.

`train_tokenizer` learns one from any iterator of texts (the trained model's: the Python standard
library's source, see `training.py`). `build_tokenizer`, for the random-weight presets, trains on
text made from a fixed syllable inventory by a seeded generator: English-looking words, sentences
and a little code-like text. Training is deterministic, so the same texts (or the same
(vocab_size, seed)) always give the same tokenizer.

Every tokenizer made here carries `CHAT_TEMPLATE`, so `/v1/chat/completions` can render messages with
`tokenizer.apply_chat_template`. The models are not chat-tuned, so it is plain text: one
`<role>: <content>` line per message (content a string, or OpenAI-style parts whose texts are joined),
then `assistant:` when a generation prompt is asked for.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")

# transformers renders with trim_blocks, which eats a newline right after a tag: hence {{ '\n' }}.
_TEXT_PARTS = "{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join }}"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}"
    + _TEXT_PARTS +
    "{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_ONSETS = "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp st str th tr wh".split()
_VOWELS = "a e i o u ai ea ee io oo ou".split()
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck", "m"]
_COMMON = (
    "the of and to in is it that for was on are with as be this by from at or an not have which one you "
    "all were can there use each word how said if will up other about out many then them these so some "
    "would make like into time has look two more write see number way could people than first water been "
    "def return class import self None True False for while print value list dict int str len range"
).split()


def _corpus(seed: int, num_sentences: int = 6000) -> list[str]:
    rng = random.Random(seed)
    lexicon = [
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        for _ in range(3000)
    ]
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_COMMON) if rng.random() < 0.4 else rng.choice(lexicon) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ",", ":"])
        if rng.random() < 0.1:
            sentence += f" {rng.randint(0, 99999)} = {rng.choice(lexicon)}({rng.choice(lexicon)}, {rng.randint(0, 9)})"
        lines.append(sentence)
    return lines


def chat_template(image_token: str | None = None) -> str:
    """The presets' chat template; with `image_token` (a vision-language model's), `{"type": "image"}`
    parts render as that placeholder where they stand among the text parts."""
    if image_token is None:
        return CHAT_TEMPLATE
    parts = ("{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
             f"{{% elif part['type'] == 'image' %}}{image_token}{{% endif %}}{{% endfor %}}")
    return CHAT_TEMPLATE.replace(_TEXT_PARTS, parts)


def build_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """The random presets' tokenizer: trained on seeded English-looking text."""
    return train_tokenizer(_corpus(seed), vocab_size)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (no unknown token: every byte is in the alphabet) learnt from `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
