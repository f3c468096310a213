"""A tiny character-level chat tokenizer, built offline (tests, demo, benchmarks).

It mimics the parts of real chat tokenizers that block diffusion depends on: a ChatML template,
an end-of-turn token (`<|im_end|>`) distinct from end-of-text (`<|endoftext|>`), and pad set to
the end-of-turn token as many real tokenizers do (so nothing may read "pad" as "ignore").
"""

from __future__ import annotations

import string

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=list(SPECIALS[:2]),
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
