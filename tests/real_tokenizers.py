"""Real-style tokenizers built offline, for what a character tokenizer cannot show.

`byte_level()` is a GPT-2/Qwen-style byte-level BPE ("Ġworld"), `sentencepiece()` a Llama/Mistral-style
SentencePiece BPE ("▁world", Metaspace, byte fallback `<0xED>`). Both are trained on text without "é" or
"한", so those split over several byte tokens, and both have a ChatML template and the end-of-text /
end-of-turn tokens the engine needs."""

from __future__ import annotations

import json

TEXTS = ["Hello world, the cafe is here.", "the world is wide", "a b c", "Copy: abc"] * 5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _wrap(core):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIALS
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core.train_from_iterator(
        TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    return _wrap(core)


def sentencepiece():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", *SPECIALS]))
    spec = json.loads(core.to_str())  # the trainer cannot add byte-fallback pieces: add them, as Llama has
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        ],
    }
    return _wrap(Tokenizer.from_str(json.dumps(spec)))
