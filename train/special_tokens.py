"""The special tokens block diffusion adds or picks (docs/design.md sections 2 and 5)."""

from __future__ import annotations

import torch

from bdcore.tokens import MASK_TOKEN, end_of_turn_id, filler_id, token_id  # noqa: F401  (re-exported)


def add_mask_to_tokenizer(tokenizer, token: str = MASK_TOKEN) -> tuple[int, int | None]:
    """Add `<|mask|>` to the tokenizer; return (its id, the number of real ids before it, or None if it existed)."""
    existing = token_id(tokenizer, token)
    if existing is not None:
        return int(existing), None
    num_real = len(tokenizer)
    tokenizer.add_tokens([token], special_tokens=True)
    return int(token_id(tokenizer, token)), num_real


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
