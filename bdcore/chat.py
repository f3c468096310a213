"""Prompt rendering: a chat through the tokenizer's chat template, then tokenised without added specials.

One definition for the trainer's rows (train/data.py), the server's prompts (inference/server), the
self-distillation data (data/self_distill.py) and the benchmarks, so the prompt a model is trained on is
the very token sequence it is served and measured on.
"""

from __future__ import annotations


def chat_text(tokenizer, messages: list[dict], *, tools=None, generation_prompt: bool = True, **template_kwargs) -> str:
    """The chat rendered by the tokenizer's template (with the assistant's generation prompt, by default).
    `template_kwargs` go to the template (e.g. `enable_thinking`, or `chat_template` to replace it)."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def chat_ids(
    tokenizer, messages: list[dict], *, tools=None, generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """`chat_text` tokenised. The template writes its own special tokens (bos, role markers), so the
    tokenizer adds none: adding them again would put a second bos before the prompt."""
    text = chat_text(tokenizer, messages, tools=tools, generation_prompt=generation_prompt, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
