"""Tokenized samples -> the shared-clean two-stream training row (docs/design.md section 2).

A row packs documents; each document contributes `[C ; N_1 ; ... ; N_V]`:
- C:   the clean sequence (prompt + responses), positions 0..L-1;
- N_v: every supervised response, noised, with the last block of each response filled to
       `bd_size` with the filler token; noised tokens reuse their clean copies' positions.
Blocks are counted from the start of each supervised span (multi-turn: every assistant turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bdcore.attention_rule import CLEAN_STREAM, PAD_STREAM, TokenMeta
from train.config import BlockDiffusionConfig
from train.noise import draw_masks


@dataclass(frozen=True)
class Sample:
    """One tokenized document: its ids and the supervised response spans [start, end).

    Each span is an assistant turn's content including its end-of-turn token; the tokens before
    the first span (and between spans) are context.
    """

    input_ids: Sequence[int]
    spans: Sequence[tuple[int, int]]


@dataclass(frozen=True)
class SpecialIds:
    mask_id: int
    filler_id: int  # closes the last block; never the end-of-turn token
    noise_vocab: int = 0  # canvas_fill="noise" draws slot ids from [0, noise_vocab): the embedding's rows

    def __post_init__(self) -> None:
        if self.mask_id == self.filler_id:
            raise ValueError("mask_id and filler_id must differ")


@dataclass
class TwoStreamBatch:
    """A batch of two-stream rows, ready for the model and both losses.

    `*_index` are flat indices into the [B * T] rows: row i predicts the label (token i + 1).
    """

    input_ids: torch.Tensor  # [B, T] noised views carry <|mask|> where masked
    meta: TokenMeta  # [B, T] each; meta.pos are the position ids
    clean_ids: torch.Tensor  # [B, T] the uncorrupted token at every slot (fillers included)
    masked: torch.Tensor  # [B, T] bool: noised slots replaced by <|mask|>
    ar_index: torch.Tensor
    ar_labels: torch.Tensor
    diff_index: torch.Tensor
    diff_labels: torch.Tensor
    diff_rate: torch.Tensor  # effective masking rate of each diffusion target's view
    # which draft each diffusion target is: 0 for the token right after its block's seed (the first
    # draft self-spec verifies), 1 for the next ...
    diff_offset: torch.Tensor
    # the flat index of the clean-stream row at the diffusion row's document and position: the AR row that
    # predicts the same token, whose distribution self-spec verifies the draft against; -1 where the target is
    # a filler past the document's end, which no AR row predicts (None: no clean stream)
    diff_teacher: torch.Tensor | None = None
    # which block of which document each diffusion target drafts in (one id per block of the batch; None: unknown)
    diff_block: torch.Tensor | None = None

    @property
    def position_ids(self) -> torch.Tensor:
        return self.meta.pos

    @property
    def num_real_tokens(self) -> int:
        return int((self.meta.stream != PAD_STREAM).sum())

    def to(self, device) -> TwoStreamBatch:
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        fields["meta"] = self.meta.to(device)
        return TwoStreamBatch(**fields)


def validate_sample(sample: Sample) -> None:
    """Raise ValueError naming what is wrong with a sample (the data pipeline counts these)."""
    n = len(sample.input_ids)
    if not sample.spans:
        raise ValueError("sample has no supervised response span")
    prev_end = 1
    for start, end in sample.spans:
        if start < prev_end:
            raise ValueError(
                f"span ({start}, {end}) starts before {prev_end}: spans must be sorted, disjoint and "
                "follow at least one context token (the first response token is predicted from it)"
            )
        if end <= start or end > n:
            raise ValueError(f"span ({start}, {end}) is empty or runs past the sample's {n} tokens")
        prev_end = end


def two_stream_length(sample: Sample, bd_size: int, views: int) -> int:
    """Tokens a sample occupies in a row: L + V * (responses rounded up to whole blocks)."""
    noised = sum(-(-(end - start) // bd_size) * bd_size for start, end in sample.spans)
    return len(sample.input_ids) + views * noised


def _layout_row(samples: Sequence[Sample], cfg: BlockDiffusionConfig, ids: SpecialIds) -> dict[str, torch.Tensor]:
    """Per-token metadata of one packed row, before noise. `slot` ties a noised token's copies across views."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("clean", "stream", "doc", "pos", "blk", "bstart", "slot")}
    num_blocks = num_slots = 0

    def add(clean, stream, doc, pos, blk, bstart, slot):
        for key, value in zip(parts, (clean, stream, doc, pos, blk, bstart, slot)):
            parts[key].append(value if isinstance(value, torch.Tensor) else torch.full_like(pos, value))

    B = cfg.bd_size
    for doc, sample in enumerate(samples):
        validate_sample(sample)
        tokens = torch.as_tensor(list(sample.input_ids), dtype=torch.long)
        L = tokens.numel()
        pos = torch.arange(L)
        blk = torch.full((L,), -1)
        bstart = pos.clone()
        noised = []  # per span: (clean ids with fillers, positions, block ids, block starts)
        for start, end in sample.spans:
            padded = -(-(end - start) // B) * B
            npos = torch.arange(start, start + padded)
            nblk = num_blocks + (npos - start) // B
            nbstart = start + (npos - start) // B * B
            blk[start:end] = nblk[: end - start]
            bstart[start:end] = nbstart[: end - start]
            nclean = torch.full((padded,), ids.filler_id)
            nclean[: end - start] = tokens[start:end]
            noised.append((nclean, npos, nblk, nbstart))
            num_blocks += padded // B
        add(tokens, CLEAN_STREAM, doc, pos, blk, bstart, -1)
        n_noised = sum(t[0].numel() for t in noised)
        for view in range(1, cfg.views + 1):
            slot = torch.arange(num_slots, num_slots + n_noised)
            cat = [torch.cat(x) for x in zip(*noised)]
            add(cat[0], view, doc, cat[1], cat[2], cat[3], slot)
        num_slots += n_noised

    row = {k: torch.cat(v) for k, v in parts.items()}
    row["num_blocks"] = torch.tensor(num_blocks)
    row["num_slots"] = torch.tensor(num_slots)
    return row


def _pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return torch.cat([t, torch.full((length - t.numel(),), value, dtype=t.dtype)])


def build_batch(
    rows: Sequence[Sequence[Sample]],
    cfg: BlockDiffusionConfig,
    ids: SpecialIds,
    generator: torch.Generator,
    *,
    row_length: int | None = None,
) -> TwoStreamBatch:
    """Lay out, noise and label a batch of packed rows. Padded to `row_length` (default: longest row)."""
    layouts = [_layout_row(r, cfg, ids) for r in rows]
    longest = max(lay["clean"].numel() for lay in layouts)
    T = row_length if row_length is not None else longest
    if T < longest:
        raise ValueError(f"row_length={T} is shorter than a packed row of {longest} tokens")

    noise_fill = cfg.canvas_fill == "noise"
    if noise_fill and ids.noise_vocab < 1:
        raise ValueError("canvas_fill=noise needs SpecialIds.noise_vocab, the range its slot ids are drawn from")
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("input", "clean", "masked", "rate", *TokenMeta._fields)}
    for lay in layouts:
        noised = lay["stream"] > CLEAN_STREAM
        if noise_fill:  # every slot noised (rate 1), each with an id of its own, as UNO's draft pass fills them
            noise = torch.randint(0, ids.noise_vocab, noised.shape, generator=generator)
            inp = torch.where(noised, noise, lay["clean"])
            masked, rate = noised.clone(), noised.float()
        else:
            inp, masked, rate = _masked_views(lay, noised, cfg, ids, generator)
        cols["input"].append(_pad(inp, T, ids.filler_id))
        cols["clean"].append(_pad(lay["clean"], T, ids.filler_id))
        cols["masked"].append(_pad(masked, T, False))
        cols["rate"].append(torch.cat([rate, torch.zeros(T - rate.numel())]))
        cols["stream"].append(_pad(lay["stream"], T, PAD_STREAM))
        cols["doc"].append(_pad(lay["doc"], T, -1))
        cols["pos"].append(_pad(lay["pos"], T, 0))
        cols["blk"].append(_pad(lay["blk"], T, -1))
        cols["bstart"].append(_pad(lay["bstart"], T, 0))
    t = {k: torch.stack(v) for k, v in cols.items()}
    meta = TokenMeta(*(t[f] for f in TokenMeta._fields))
    ar_index, ar_labels, diff_index, diff_labels, diff_rate, diff_offset, diff_teacher, diff_block = _targets(
        meta, t["clean"], t["masked"], t["rate"]
    )
    return TwoStreamBatch(
        input_ids=t["input"],
        meta=meta,
        clean_ids=t["clean"],
        masked=t["masked"],
        ar_index=ar_index,
        ar_labels=ar_labels,
        diff_index=diff_index,
        diff_labels=diff_labels,
        diff_rate=diff_rate,
        diff_offset=diff_offset,
        diff_teacher=diff_teacher,
        diff_block=diff_block,
    )


def _masked_views(lay: dict, noised: torch.Tensor, cfg: BlockDiffusionConfig, ids: SpecialIds, generator):
    """<|mask|> at each view's draw (train/noise.py): the row's input ids, mask flags and effective rates."""
    masked = torch.zeros_like(noised)
    rate = torch.zeros(noised.shape)
    m, r = draw_masks(
        lay["stream"][noised],
        lay["blk"][noised],
        lay["slot"][noised],
        num_views=cfg.views,
        num_blocks=int(lay["num_blocks"]),
        num_slots=int(lay["num_slots"]),
        min_rate=cfg.min_rate,
        generator=generator,
    )
    masked[noised], rate[noised] = m, r
    return torch.where(masked, ids.mask_id, lay["clean"]), masked, rate


def _targets(meta: TokenMeta, clean: torch.Tensor, masked: torch.Tensor, rate: torch.Tensor):
    """Shifted targets: row i predicts token i + 1 (docs/design.md section 4)."""
    B, T = clean.shape
    cur = TokenMeta(*(x[:, :-1] for x in meta))
    nxt = TokenMeta(*(x[:, 1:] for x in meta))
    same = (cur.doc == nxt.doc) & (cur.stream == nxt.stream)
    # AR: clean rows whose next token is a supervised response token (blk >= 0 marks response tokens).
    ar = same & (cur.stream == CLEAN_STREAM) & (nxt.blk >= 0)
    # Diffusion: noised rows whose next token is in the same block and masked; seeds never qualify
    # because a seed's previous row lies in another block (or another stream).
    diff = same & (cur.stream > CLEAN_STREAM) & (cur.blk == nxt.blk) & masked[:, 1:]

    def flat(sel: torch.Tensor):
        b, i = sel.nonzero(as_tuple=True)
        return b * T + i, clean[b, i + 1], rate[b, i + 1], nxt.pos[b, i] - nxt.bstart[b, i] - 1

    ar_index, ar_labels, _, _ = flat(ar)
    diff_index, diff_labels, diff_rate, diff_offset = flat(diff)
    b, i = diff.nonzero(as_tuple=True)
    teacher = _clean_row_at(meta, b, i)
    # a block id per (batch row, document, block): the views of one block share it
    blocks, docs = int(meta.blk.max()) + 2, int(meta.doc.max()) + 2
    block = (b * docs + cur.doc[b, i] + 1) * blocks + cur.blk[b, i] + 1
    return ar_index, ar_labels, diff_index, diff_labels, diff_rate, diff_offset, teacher, block


def _clean_row_at(meta: TokenMeta, b: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Flat indices of the clean-stream rows at the documents and positions of rows (b, i): a noised row at
    position p predicts token p + 1 of its document, and so does the clean row at p (it shares the position id).
    -1 where the document holds no token p + 1 (a filler of the last block: no AR row predicts it)."""
    T = meta.pos.shape[1]
    cb, ci = (meta.stream == CLEAN_STREAM).nonzero(as_tuple=True)
    span, docs = int(meta.pos.max()) + 2, int(meta.doc.max()) + 2

    def key(rb, ri, shift=0):
        return (rb * docs + meta.doc[rb, ri] + 1) * span + meta.pos[rb, ri] + shift

    keys, order = key(cb, ci).sort()
    if not len(keys):
        return torch.full_like(b, -1)

    def find(want):
        at = torch.searchsorted(keys, want).clamp(max=len(keys) - 1)
        return at, keys[at] == want

    at, here = find(key(b, i))
    _, next_token = find(key(b, i, 1))
    return torch.where(here & next_token, (cb * T + ci)[order][at], -1)
