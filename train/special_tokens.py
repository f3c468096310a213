"""The special tokens block diffusion adds or picks (DESIGN sections 2 and 5)."""

from __future__ import annotations

import torch

MASK_TOKEN = "<|mask|>"

# End-of-text spellings, tried in order when picking the filler that closes a response's last block.
_END_OF_TEXT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def _token_id(tokenizer, token: str | None) -> int | None:
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
        tid = _token_id(tokenizer, name)
        if tid is not None and tid != eot_id and name != MASK_TOKEN:
            return int(tid)
    raise ValueError(
        "no filler token: the tokenizer has no end-of-text/pad/eos/bos token distinct from the end-of-turn "
        f"token (id {eot_id}); add one, e.g. tokenizer.add_special_tokens({{'pad_token': '<|endoftext|>'}})"
    )


def add_mask_to_tokenizer(tokenizer, token: str = MASK_TOKEN) -> tuple[int, int | None]:
    """Add `<|mask|>` to the tokenizer; return (its id, the number of real ids before it, or None if it existed)."""
    existing = _token_id(tokenizer, token)
    if existing is not None:
        return int(existing), None
    num_real = len(tokenizer)
    tokenizer.add_tokens([token], special_tokens=True)
    return int(_token_id(tokenizer, token)), num_real


def vocab_rows_needed(config, mask_id: int) -> int:
    """Embedding rows after adding `mask_id`: never fewer than the model has (padding rows are reused)."""
    return max(config.vocab_size, mask_id + 1)


@torch.no_grad()
def init_mask_rows(model, mask_id: int, num_real: int) -> None:
    """Give `mask_id` the mean of the real token rows, in the input and (untied) output embeddings."""
    embed = model.get_input_embeddings()
    if mask_id >= embed.weight.shape[0]:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        embed = model.get_input_embeddings()
    rows = [embed.weight]
    out = model.get_output_embeddings()
    if out is not None and out.weight.data_ptr() != embed.weight.data_ptr():
        rows.append(out.weight)
    for weight in rows:
        weight[mask_id] = weight[:num_real].float().mean(0).to(weight.dtype)


def add_mask_token(model, tokenizer, token: str = MASK_TOKEN) -> int:
    """Add `<|mask|>` to tokenizer and model; return its id.

    The new input row (and the output row, when untied) is the mean of the real token rows, so the
    token starts neutral instead of random or equal to a padding row. The matrix is never shrunk:
    if the new id falls inside existing padding rows, that row is reused. An existing token is kept.
    """
    mask_id, num_real = add_mask_to_tokenizer(tokenizer, token)
    if num_real is not None:
        init_mask_rows(model, mask_id, num_real)
    return mask_id
