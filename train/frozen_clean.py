"""The draft-adapter step: the clean stream runs once without grad, the noised views train against its cache.

With a draft-only adapter (`--draft_adapter`, docs/design.md 8.13) the clean stream is the frozen base
model bit for bit: no trainable weight acts at a clean row (the adapter's gate is 0 there, the trained
`<|mask|>` row is read only where the input is `<|mask|>`), so no gradient can flow into or through
it. Its backward is pure waste, and so is keeping its activations. This step therefore runs the decoder
twice over the training row's own tokens:

1. the clean tokens of each row alone, under no-grad, leaving their keys/values in a cache;
2. the noised tokens alone, with that cache as past keys/values and the row's own mask restricted to
   [noised queries] x [clean keys ; noised keys], with grad.

Who attends to whom is the attention rule applied to the row laid out as [clean ; noised], which is the
same rule on the same tokens (it reads positions, blocks and streams, not slots), so hidden states,
loss and gradients equal the joint forward's (`tests/test_frozen_clean.py`). Only dense attention layers
can take a cache of clean keys this way; hybrids (gated-delta layers) and routed experts (whose
load-balancing loss counts every row) keep the joint forward.
"""

from __future__ import annotations

import contextlib

import torch

from bdcore.attention_rule import CLEAN_STREAM, PAD_STREAM, TokenMeta, dense_mask
from bdcore.draft_adapter import draft_rows


def _clean_prefix_cache(config):
    """A cache that stores the clean pass's keys/values, then (`frozen = True`) serves them as a read-only
    prefix: each layer's update returns prefix + the noised rows' keys without storing them, so a layer
    that backward recomputes (activation checkpointing) sees the same prefix as its forward did."""
    from transformers import DynamicCache

    class CleanPrefix(DynamicCache):
        frozen = False

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if not self.frozen:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            layer = self.layers[layer_idx]
            return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)

    return CleanPrefix(config=config)


@contextlib.contextmanager
def _checkpointed_layers_keep_the_cache(decoder):
    """transformers drops `past_key_values` from a layer it checkpoints (a cache written in forward would be
    written again by the recomputation); ours is read-only by then, so the layers may keep it."""
    layers = list(decoder.layers)
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _gather(meta: TokenMeta, ids: torch.Tensor, select: torch.Tensor):
    """Per batch row, the selected slots in order, right-padded to the longest: (ids, meta, slot index,
    real) with padding marked as its own stream (it sees only itself)."""
    B = ids.shape[0]
    counts = select.sum(1)
    width = max(1, int(counts.max()))
    order = torch.argsort((~select).to(torch.int8), dim=1, stable=True)[:, :width]  # selected slots first
    real = torch.arange(width, device=ids.device)[None, :] < counts[:, None]
    rows = torch.arange(B, device=ids.device)[:, None]
    picked = TokenMeta(*(t[rows, order] for t in meta))
    picked = picked._replace(stream=torch.where(real, picked.stream, PAD_STREAM), doc=torch.where(real, picked.doc, -1))
    return ids[rows, order], picked, order, real


def frozen_clean_hidden(lm, batch) -> torch.Tensor:
    """[B, T, H] hidden states of the two-stream row, the clean stream computed without grad (see above).
    `lm` is the `TwoStreamLM`; its mask rule (`clean_causal`, `within_block_causal`) is the joint forward's."""
    model, meta, rule = lm.model, batch.meta, lm.mask_rule
    decoder = model.get_decoder()
    clean = meta.stream == CLEAN_STREAM
    noised = meta.stream > CLEAN_STREAM
    c_ids, c_meta, c_order, c_real = _gather(meta, batch.input_ids, clean)
    n_ids, n_meta, n_order, n_real = _gather(meta, batch.input_ids, noised)
    both = TokenMeta(*(torch.cat([a, b], 1) for a, b in zip(c_meta, n_meta)))
    mask = dense_mask(both, **rule)
    Tc = c_ids.shape[1]
    cache = _clean_prefix_cache(model.config)
    with _checkpointed_layers_keep_the_cache(decoder), torch.no_grad(), draft_rows(model, torch.zeros_like(c_real)):
        clean_out = decoder(
            input_ids=c_ids,
            attention_mask=mask[:, :, :Tc, :Tc],
            position_ids=c_meta.pos,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
    cache.frozen = True
    with _checkpointed_layers_keep_the_cache(decoder), draft_rows(model, n_real):  # every real noised row drafts
        noised_out = decoder(
            input_ids=n_ids,
            attention_mask=mask[:, :, Tc:, :],
            position_ids=n_meta.pos,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
    B, T = batch.input_ids.shape
    hidden = noised_out.new_zeros(B, T, noised_out.shape[-1])
    rows = torch.arange(B, device=hidden.device)[:, None]
    hidden = hidden.index_put((rows.expand_as(c_order)[c_real], c_order[c_real]), clean_out[c_real].to(hidden.dtype))
    return hidden.index_put((rows.expand_as(n_order)[n_real], n_order[n_real]), noised_out[n_real])
