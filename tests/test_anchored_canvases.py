"""`--noised_layout anchored` (docs/design.md section 2): the noised rows are canvases at random anchors,
the seed clean and the rest masked, each a block of its own. By hand, and against an independent forward
of what self-spec drafts from: the clean prefix before the anchor, then the canvas."""

import random

import pytest
import torch

from tests.tiny import EOT_ID, FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import Sample, SpecialIds, build_batch, two_stream_length

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)
CFG = BlockDiffusionConfig(bd_size=4, views=2, ar_loss_weight=0.2, noised_layout="anchored")


def test_canvases_of_a_small_sample_by_hand():
    s = Sample([10, 11, 12, 20, 21, 22, 23, EOT_ID], [(3, 8)])
    b = build_batch([[s]], CFG, IDS, noise_generator(0, 0, 0))
    m = b.meta
    assert b.input_ids.shape == (1, two_stream_length(s, 4, 2)) == (1, 8 + 16)
    assert m.stream[0].tolist() == [0] * 8 + [1] * 16
    assert b.input_ids[0, :8].tolist() == s.input_ids
    T = b.input_ids.shape[1]
    anchors = m.bstart[0, 8::4].tolist()
    assert all(3 <= a <= 6 for a in anchors) and len(set(m.blk[0, 8:].tolist())) == 4
    want_offsets, want_teacher = [], []
    for c, a in enumerate(anchors):
        cols = slice(8 + 4 * c, 12 + 4 * c)
        tokens = [s.input_ids[p] if p < 8 else FILLER_ID for p in range(a, a + 4)]
        assert m.pos[0, cols].tolist() == list(range(a, a + 4))
        assert m.bstart[0, cols].tolist() == [a] * 4
        assert b.clean_ids[0, cols].tolist() == tokens
        assert b.input_ids[0, cols].tolist() == [tokens[0], MASK_ID, MASK_ID, MASK_ID]  # the seed stays clean
        want_offsets += [0, 1, 2]
        want_teacher += [p - 1 if p < 8 else -1 for p in range(a + 1, a + 4)]
    # every canvas drafts its 3 masked tokens; the targets and their AR twins by hand
    assert (b.diff_index // T == 0).all() and b.diff_offset.tolist() == want_offsets
    assert b.diff_labels.tolist() == b.clean_ids[0, b.diff_index + 1].tolist()
    assert b.diff_teacher_index.tolist() == want_teacher
    assert torch.all(b.diff_rate == 1.0)
    assert b.ar_labels.tolist() == [20, 21, 22, 23, EOT_ID]  # the clean stream is unchanged


def test_anchors_cover_the_response_and_follow_the_seed():
    s = Sample([1, 2] + list(range(20, 40)) + [EOT_ID], [(2, 23)])
    seen = set()
    for step in range(40):
        b = build_batch([[s]], CFG, IDS, noise_generator(0, 0, step))
        seen |= set(b.meta.bstart[0, 23:].tolist())
    assert seen == set(range(2, 22))  # every position with a token after it, none past


@pytest.mark.parametrize("seed", range(3))
def test_a_canvas_row_is_what_self_spec_drafts_from(seed):
    """Each canvas's hidden states equal a plain forward of [clean tokens before the anchor ; seed, masks]
    with the prefix causal and the canvas seeing the prefix and itself."""
    model = tiny_model("qwen3")
    rng = random.Random(seed)
    rows = [[random_sample(rng, turns=2) for _ in range(2)]]
    batch = build_batch(rows, CFG, IDS, noise_generator(seed, 0, 0))
    with torch.no_grad():
        hidden = TwoStreamLM(model, CFG).hidden_states(batch)[0]
    m = batch.meta
    checked = 0
    for blk in sorted(set(m.blk[0][m.stream[0] == 1].tolist())):
        cols = ((m.blk[0] == blk) & (m.stream[0] == 1)).nonzero()[:, 0]
        doc, anchor = int(m.doc[0, cols[0]]), int(m.bstart[0, cols[0]])
        prefix = list(rows[0][doc].input_ids[:anchor])
        ids = torch.tensor([prefix + batch.input_ids[0, cols].tolist()])
        n, k = len(prefix), cols.numel()
        mask = torch.ones(n + k, n + k).tril().bool()
        mask[n:, n:] = True  # the canvas sees itself both ways
        with torch.no_grad():
            want = model.get_decoder()(
                input_ids=ids, attention_mask=mask[None, None], position_ids=torch.arange(n + k)[None]
            ).last_hidden_state[0, n:]
        torch.testing.assert_close(hidden[cols], want, atol=2e-5, rtol=1e-4)
        checked += 1
    assert checked >= 4


def test_anchored_needs_a_causal_clean_stream():
    with pytest.raises(ValueError, match="causal clean stream"):
        BlockDiffusionConfig(ar_loss_weight=0.0, noised_layout="anchored")
    with pytest.raises(ValueError, match="choose one of"):
        BlockDiffusionConfig(noised_layout="random")
