"""Tokenized samples -> the single-stream masked-diffusion training row (`--objective single_stream`).

The other half of the block-diffusion world (docs/design.md section 2b): one stream per document, no
clean copy. Each supervised response is cut into blocks of `bd_size` counted from its first token, its
last block filled to `bd_size` with the filler token *inside* the stream (positions run on through the
fillers, so a later turn's positions shift by them); every block draws one masking rate and each of its
tokens is replaced by `<|mask|>` with that probability. Attention is the clean stream's rule with
`clean_causal` off: prompt tokens causal, a response token sees everything before its block and its whole
block (bidirectional inside a block, causal across blocks). Targets are **not shifted**: a masked slot
predicts its own token, and only masked slots are scored. There is no AR target (the stream is not
token-causal, so the checkpoint has no AR head: self-spec cannot run on it).

The batch reuses `TwoStreamBatch`, so the model wrapper, the loss and the trainer run it unchanged: its
`diff_index` rows are the masked slots themselves and `ar_index` is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bdcore.attention_rule import CLEAN_STREAM, PAD_STREAM, TokenMeta
from train.config import BlockDiffusionConfig
from train.noise import draw_masks
from train.rows import Sample, SpecialIds, TwoStreamBatch, build_batch, two_stream_length, validate_sample


def single_stream_length(sample: Sample, bd_size: int) -> int:
    """Tokens a sample occupies in a row: its own plus the fillers that close each response's last block."""
    pads = sum(-(end - start) % bd_size for start, end in sample.spans)
    return len(sample.input_ids) + pads


def _layout(samples: Sequence[Sample], bd_size: int, filler_id: int) -> dict[str, torch.Tensor]:
    """Per-token ids and metadata of one packed row, before noise; `slot` numbers the response tokens."""
    cols: dict[str, list[int]] = {k: [] for k in ("clean", "doc", "pos", "blk", "bstart")}
    num_blocks = 0
    for doc, sample in enumerate(samples):
        validate_sample(sample)
        ids = list(sample.input_ids)
        tokens, blks, bstarts = [], [], []  # positions run on through the fillers: pos = index in the doc
        cursor = 0
        for start, end in sample.spans:
            tokens += ids[cursor:start]
            blks += [-1] * (start - cursor)
            bstarts += range(len(bstarts), len(bstarts) + start - cursor)
            first, padded = len(tokens), -(-(end - start) // bd_size) * bd_size
            tokens += ids[start:end] + [filler_id] * (padded - (end - start))
            blks += [num_blocks + j // bd_size for j in range(padded)]
            bstarts += [first + j // bd_size * bd_size for j in range(padded)]
            num_blocks += padded // bd_size
            cursor = end
        tokens += ids[cursor:]
        blks += [-1] * (len(ids) - cursor)
        bstarts += range(len(bstarts), len(bstarts) + len(ids) - cursor)
        for key, value in zip(cols, (tokens, [doc] * len(tokens), range(len(tokens)), blks, bstarts)):
            cols[key] += value
    row = {k: torch.tensor(v, dtype=torch.long) for k, v in cols.items()}
    row["slot"] = (row["blk"] >= 0).long().cumsum(0) - 1  # response slots numbered 0.. (context: unused)
    row["num_blocks"] = torch.tensor(num_blocks)
    return row


def build_single_stream_batch(
    rows: Sequence[Sequence[Sample]],
    cfg: BlockDiffusionConfig,
    ids: SpecialIds,
    generator: torch.Generator,
    *,
    row_length: int | None = None,
) -> TwoStreamBatch:
    """Lay out, noise and label a batch of packed single-stream rows (padded to `row_length`)."""
    layouts = [_layout(r, cfg.bd_size, ids.filler_id) for r in rows]
    longest = max(lay["clean"].numel() for lay in layouts)
    T = row_length if row_length is not None else longest
    if T < longest:
        raise ValueError(f"row_length={T} is shorter than a packed row of {longest} tokens")

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((T - t.numel(),), value, dtype=t.dtype)])

    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("input", "clean", "masked", "rate", *TokenMeta._fields)}
    for lay in layouts:
        response = lay["blk"] >= 0
        masked = torch.zeros_like(response)
        rate = torch.zeros(response.shape)
        n = int(response.sum())
        masked[response], rate[response] = draw_masks(
            torch.ones(n, dtype=torch.long),  # one view: every block masks at its own rate
            lay["blk"][response],
            lay["slot"][response],
            num_views=1,
            num_blocks=int(lay["num_blocks"]),
            num_slots=n,
            min_rate=cfg.min_rate,
            generator=generator,
        )
        cols["input"].append(pad(torch.where(masked, ids.mask_id, lay["clean"]), ids.filler_id))
        cols["clean"].append(pad(lay["clean"], ids.filler_id))
        cols["masked"].append(pad(masked, False))
        cols["rate"].append(pad(rate, 0.0))
        cols["stream"].append(pad(torch.full_like(lay["pos"], CLEAN_STREAM), PAD_STREAM))
        cols["doc"].append(pad(lay["doc"], -1))
        cols["pos"].append(pad(lay["pos"], 0))
        cols["blk"].append(pad(lay["blk"], -1))
        cols["bstart"].append(pad(lay["bstart"], 0))
    t = {k: torch.stack(v) for k, v in cols.items()}
    meta = TokenMeta(*(t[f] for f in TokenMeta._fields))
    b, i = t["masked"].nonzero(as_tuple=True)  # unshifted: the masked slot's own row predicts it
    empty = torch.zeros(0, dtype=torch.long)
    return TwoStreamBatch(
        input_ids=t["input"],
        meta=meta,
        clean_ids=t["clean"],
        masked=t["masked"],
        ar_index=empty,
        ar_labels=empty,
        diff_index=b * T + i,
        diff_labels=t["clean"][b, i],
        diff_rate=t["rate"][b, i],
        diff_offset=meta.pos[b, i] - meta.bstart[b, i],  # unshifted: a block's every token is drafted
    )


def sample_length(sample: Sample, cfg: BlockDiffusionConfig) -> int:
    """Tokens a sample occupies in a training row of the configured objective."""
    if cfg.single_stream:
        return single_stream_length(sample, cfg.bd_size)
    return two_stream_length(sample, cfg.bd_size, cfg.views)


def batch_builder(cfg: BlockDiffusionConfig):
    """`build_batch` or `build_single_stream_batch`, as the objective asks (same signature)."""
    return build_single_stream_batch if cfg.single_stream else build_batch
