"""Row layout, noise and targets of the two-stream row (docs/design.md section 2 and 4)."""

import random

import pytest
import torch

from tests.tiny import EOT_ID, FILLER_ID, MASK_ID, random_sample
from train.config import BlockDiffusionConfig
from train.noise import noise_generator
from train.rows import Sample, SpecialIds, build_batch, two_stream_length

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def test_layout_of_a_small_sample_by_hand():
    cfg = BlockDiffusionConfig(bd_size=4, views=2)
    s = Sample([10, 11, 12, 20, 21, 22, 23, EOT_ID], [(3, 8)])
    b = build_batch([[s]], cfg, IDS, noise_generator(0, 0, 0))
    m = b.meta
    assert b.input_ids.shape == (1, 8 + 2 * 8) == (1, two_stream_length(s, 4, 2))
    noised_clean = [20, 21, 22, 23, EOT_ID, FILLER_ID, FILLER_ID, FILLER_ID]
    assert b.clean_ids[0].tolist() == s.input_ids + noised_clean * 2
    assert m.stream[0].tolist() == [0] * 8 + [1] * 8 + [2] * 8
    assert m.pos[0].tolist() == list(range(8)) + list(range(3, 11)) * 2
    assert m.blk[0].tolist() == [-1, -1, -1, 0, 0, 0, 0, 1] + [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert m.bstart[0].tolist() == [0, 1, 2, 3, 3, 3, 3, 7] + ([3] * 4 + [7] * 4) * 2
    # Noised inputs are the clean tokens or <|mask|>; clean inputs are untouched.
    assert b.input_ids[0, :8].tolist() == s.input_ids
    noised = b.input_ids[0, 8:]
    assert torch.equal(noised == MASK_ID, b.masked[0, 8:])
    # AR targets: every response token (first one from the last prompt row); never a filler.
    assert b.ar_index.tolist() == [2, 3, 4, 5, 6]
    assert b.ar_labels.tolist() == [20, 21, 22, 23, EOT_ID]
    # Each diffusion target's draft offset: the block of positions 3-6 has its seed at 3 and drafts 4, 5, 6
    # (offsets 0, 1, 2); the block at 7 drafts 8-10.
    target_pos = m.pos.flatten()[b.diff_index + 1]
    assert b.diff_offset.tolist() == [{4: 0, 5: 1, 6: 2, 8: 0, 9: 1, 10: 2}[p] for p in target_pos.tolist()]


def _rows(seed: int, cfg: BlockDiffusionConfig, *, turns: int = 1, pack: int = 1, n_rows: int = 2):
    rng = random.Random(seed)
    rows = [[random_sample(rng, turns=turns) for _ in range(pack)] for _ in range(n_rows)]
    return rows, build_batch(rows, cfg, IDS, noise_generator(seed, 0, 0))


@pytest.mark.parametrize("seed", range(6))
def test_complementary_views_cover_every_non_seed_token_once(seed):
    cfg = BlockDiffusionConfig(bd_size=4, views=2)
    _, b = _rows(seed, cfg, turns=2, pack=2)
    m = b.meta
    for row in range(b.input_ids.shape[0]):
        v1 = (m.stream[row] == 1).nonzero().flatten()
        v2 = (m.stream[row] == 2).nonzero().flatten()
        assert len(v1) == len(v2) and len(v1) > 0
        both = b.masked[row, v1].int() + b.masked[row, v2].int()
        assert both.eq(1).all(), "each response slot is masked in exactly one view"
        # Diffusion targets (the token i + 1 of each target row) over both views hit every
        # slot that is not a block seed exactly once.
        T = b.input_ids.shape[1]
        tgt = b.diff_index[b.diff_index // T == row] % T + 1
        slot_of = {int(i): k for k, i in enumerate(v1)} | {int(i): k for k, i in enumerate(v2)}
        hits = sorted(slot_of[int(i)] for i in tgt)
        non_seed = [k for k, i in enumerate(v1) if m.pos[row, i] != m.bstart[row, i]]
        assert hits == non_seed


def test_diffusion_targets_are_masked_same_block_and_never_seeds():
    cfg = BlockDiffusionConfig(bd_size=5, views=2)
    _, b = _rows(11, cfg, turns=3, pack=3, n_rows=3)
    flat = {k: v.flatten() for k, v in b.meta._asdict().items()}
    t = b.diff_index + 1
    assert (flat["stream"][b.diff_index] > 0).all()
    assert torch.equal(flat["blk"][t], flat["blk"][b.diff_index])
    assert (flat["pos"][t] != flat["bstart"][t]).all()
    assert b.masked.flatten()[t].all()
    assert torch.equal(b.diff_labels, b.clean_ids.flatten()[t])
    assert (b.diff_labels == FILLER_ID).any(), "fillers are diffusion targets"
    assert not (b.ar_labels == FILLER_ID).any(), "fillers are never AR targets"
    assert not (b.diff_labels == MASK_ID).any() and not (b.ar_labels == MASK_ID).any()


def test_rates_are_per_block_and_complementary():
    cfg = BlockDiffusionConfig(bd_size=4, views=2)
    s = Sample(list(range(3)) + list(range(40)), [(3, 43)])
    b = build_batch([[s]], cfg, IDS, noise_generator(3, 0, 0))
    rate1 = b.diff_rate[b.meta.stream.flatten()[b.diff_index] == 1]
    rate2 = b.diff_rate[b.meta.stream.flatten()[b.diff_index] == 2]
    assert ((rate1 >= 1e-3) & (rate1 <= 1)).all() and ((rate2 >= 0) & (rate2 <= 1 - 1e-3 + 1e-6)).all()
    # One rate per block: within a block and view all targets share it; across views they sum to 1.
    blk = b.meta.blk.flatten()[b.diff_index]
    view = b.meta.stream.flatten()[b.diff_index]
    per = {}
    for k, v, r in zip(blk.tolist(), view.tolist(), b.diff_rate.tolist()):
        per.setdefault((k, v), set()).add(round(r, 6))
    assert all(len(rs) == 1 for rs in per.values())
    for (k, v), rs in per.items():
        if (k, 3 - v) in per:
            assert abs(next(iter(rs)) + next(iter(per[(k, 3 - v)])) - 1) < 1e-5


def test_noise_is_reproducible_and_differs_by_rank_and_step():
    cfg = BlockDiffusionConfig(bd_size=4)
    rows = [[Sample(list(range(5)) + list(range(60)), [(5, 65)])]]
    m = lambda *key: build_batch(rows, cfg, IDS, noise_generator(*key)).masked  # noqa: E731
    assert torch.equal(m(7, 0, 3), m(7, 0, 3))
    assert not torch.equal(m(7, 0, 3), m(7, 1, 3))
    assert not torch.equal(m(7, 0, 3), m(7, 0, 4))
    assert not torch.equal(m(7, 0, 3), m(8, 0, 3))


def test_odd_view_count_and_single_view():
    for views in (1, 3):
        cfg = BlockDiffusionConfig(bd_size=4, views=views)
        _, b = _rows(5, cfg)
        assert int(b.meta.stream.max()) == views


def test_multiturn_blocks_restart_at_each_turn():
    cfg = BlockDiffusionConfig(bd_size=4)
    s = Sample([1, 2, 10, 11, 12, 13, 14, EOT_ID, 3, 4, 20, EOT_ID], [(2, 8), (10, 12)])
    b = build_batch([[s]], cfg, IDS, noise_generator(0, 0, 0))
    v1 = b.meta.stream[0] == 1
    assert b.meta.bstart[0, v1].tolist() == [2] * 4 + [6] * 4 + [10] * 4
    assert b.meta.blk[0, v1].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert b.ar_labels.tolist() == [10, 11, 12, 13, 14, EOT_ID, 20, EOT_ID]


@pytest.mark.parametrize(
    "spans, match",
    [
        ([], "no supervised"),
        ([(0, 3)], "context token"),
        ([(2, 2)], "empty"),
        ([(2, 9)], "past"),
        ([(3, 5), (4, 6)], "sorted"),
    ],
)
def test_bad_spans_are_rejected_with_a_reason(spans, match):
    with pytest.raises(ValueError, match=match):
        build_batch([[Sample(list(range(8)), spans)]], BlockDiffusionConfig(bd_size=4), IDS, noise_generator(0, 0, 0))


def test_padding_rows_and_row_length():
    cfg = BlockDiffusionConfig(bd_size=4)
    rows, b = _rows(2, cfg, n_rows=3)
    longest = max(sum(two_stream_length(s, 4, 2) for s in r) for r in rows)
    assert b.input_ids.shape[1] == longest
    b2 = build_batch(rows, cfg, IDS, noise_generator(2, 0, 0), row_length=longest + 5)
    assert b2.input_ids.shape[1] == longest + 5 and (b2.meta.stream[:, -5:] == -1).all()
    with pytest.raises(ValueError, match="row_length"):
        build_batch(rows, cfg, IDS, noise_generator(2, 0, 0), row_length=longest - 1)


def test_config_validation():
    with pytest.raises(ValueError, match="clean_causal"):
        BlockDiffusionConfig(ar_loss_weight=0.5, clean_causal=False)
    assert BlockDiffusionConfig(ar_loss_weight=0.0).clean_causal is False
    assert BlockDiffusionConfig(ar_loss_weight=0.2).clean_causal is True
    with pytest.raises(ValueError, match="bd_size"):
        BlockDiffusionConfig(bd_size=1)
    with pytest.raises(ValueError, match="loss_weighting"):
        BlockDiffusionConfig(loss_weighting="nope")


def test_ar_only_rows_hold_the_clean_stream_only():
    cfg = BlockDiffusionConfig(bd_size=4, views=0, ar_loss_weight=1.0)
    rows, b = _rows(3, cfg, turns=2, pack=2)
    assert (b.meta.stream <= 0).all() and b.diff_index.numel() == 0
    assert b.input_ids.shape[1] == max(sum(len(s.input_ids) for s in r) for r in rows)
    assert b.ar_labels.numel() == sum(e - s for r in rows for smp in r for s, e in smp.spans)
    with pytest.raises(ValueError, match="plain AR"):
        BlockDiffusionConfig(views=0, ar_loss_weight=0.0)
