"""The backend-neutral decode rules."""

from collections import Counter

import torch

from bdcore.decode.rules import commit_slots, first_stop, greedy_accept, speculative_accept
from bdcore.decode.sampling import SamplingParams, probabilities


def test_commit_slots_threshold_at_least_one_and_last_step():
    conf = torch.tensor([0.95, 0.2, 0.6, 0.99])
    masked = torch.tensor([True, True, True, False])
    assert commit_slots(conf, masked, threshold=0.9, last_step=False).tolist() == [True, False, False, False]
    assert commit_slots(conf, masked, threshold=0.97, last_step=False).tolist() == [True, False, False, False]
    low = torch.tensor([0.3, 0.2, 0.6, 0.99])
    assert commit_slots(low, masked, threshold=0.9, last_step=False).tolist() == [False, False, True, False]
    assert commit_slots(low, masked, threshold=0.9, last_step=True).tolist() == [True, True, True, False]


def test_greedy_accept_counts_the_agreeing_prefix():
    assert greedy_accept(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 8])) == 3
    assert greedy_accept(torch.tensor([5, 9, 7]), torch.tensor([5, 6, 7, 8])) == 1
    assert greedy_accept(torch.tensor([1, 6, 7]), torch.tensor([5, 6, 7, 8])) == 0
    assert greedy_accept(torch.tensor([], dtype=torch.long), torch.tensor([5])) == 0


def test_speculative_accept_samples_exactly_the_target():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])
    first = Counter()
    n = 20000
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=gen)
        k, tok = speculative_accept(d, q, p, gen)
        first[int(d[0]) if k == 1 else tok] += 1
    for t in range(4):
        assert abs(first[t] / n - float(p[0, t])) < 0.015, (t, first)


def test_probabilities_ban_mask_and_truncate():
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0]])
    greedy = probabilities(logits, SamplingParams(), banned=3)
    assert greedy.argmax().item() == 0
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2), banned=3)
    assert p[0, 3] == 0 and p[0, 2] == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5), banned=None)
    assert (p > 0).sum() == 1 and p[0, 3] == 1
    assert first_stop([4, 5, 2, 2], {2}) == 2 and first_stop([4], {2}) is None


def test_greedy_pick_is_the_one_hot_argmax_without_building_it():
    """`pick` answers greedy rows with the argmax alone (no distribution); it must be the argmax of
    `probabilities`' one-hot rows, the banned token never chosen, and the caller's logits left as they were."""
    from bdcore.decode.sampling import pick

    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0], [0.0, 4.0, 1.0, -1.0], [1.0, 1.5, 9.0, 2.0]])
    before = logits.clone()
    tokens, probs = pick(logits, SamplingParams(), 3, None)
    assert probs is None
    assert tokens.tolist() == probabilities(logits, SamplingParams(), banned=3).argmax(-1).tolist() == [0, 1, 2]
    assert torch.equal(logits, before)
    assert pick(logits, SamplingParams(), None, None)[0].tolist() == [3, 1, 2]
