"""Which token is which: `<|mask|>`, end-of-turn and the block filler (docs/design.md sections 2, 5, 6).

Shared by the trainer (row layout) and the engine (stop conditions), so both agree on the ids.
"""

from __future__ import annotations

MASK_TOKEN = "<|mask|>"

# End-of-text spellings, tried in order when picking the filler that closes a response's last block.
_END_OF_TEXT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def token_id(tokenizer, token: str | None) -> int | None:
    if token is None:
        return None
    vocab = tokenizer.get_vocab()
    return vocab.get(token)


def end_of_turn_id(tokenizer) -> int:
    """The token that closes an assistant turn in the chat template (falls back to eos).

    Found by rendering a one-turn chat and taking the first special token after the reply's text,
    because `eos_token` is not the end-of-turn token in every tokenizer.
    """
    if getattr(tokenizer, "chat_template", None):
        marker = "bdstack reply"
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        tail = text[text.rfind(marker) + len(marker) :]
        tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        for tid in tail_ids:
            if tid in special:
                return int(tid)
    if tokenizer.eos_token_id is None:
        raise ValueError("cannot tell the end-of-turn token: the tokenizer has no chat template and no eos_token")
    return int(tokenizer.eos_token_id)


def filler_id(tokenizer, eot_id: int) -> int:
    """The filler of a response's last block: an end-of-text token that is not end-of-turn."""
    names = [*_END_OF_TEXT_CANDIDATES, tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token]
    for name in names:
        tid = token_id(tokenizer, name)
        if tid is not None and tid != eot_id and name != MASK_TOKEN:
            return int(tid)
    raise ValueError(
        "no filler token: the tokenizer has no end-of-text/pad/eos/bos token distinct from the end-of-turn "
        f"token (id {eot_id}); add one, e.g. tokenizer.add_special_tokens({{'pad_token': '<|endoftext|>'}})"
    )


def stop_ids(tokenizer) -> frozenset[int]:
    """The tokens that end an answer: end-of-turn, the tokenizer's eos, and the block filler (a filler
    committed in a slot closes the block after the answer, so it ends the output there too)."""
    eot = end_of_turn_id(tokenizer)
    stops = {eot}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    try:
        stops.add(filler_id(tokenizer, eot))
    except ValueError:  # no filler token: nothing else to stop at
        pass
    return frozenset(stops)
