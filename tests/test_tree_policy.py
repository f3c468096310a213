"""Draft trees in the self-spec policy (bdcore/decode/policy/tree_policy.py, speculation.py, issue 44 item 3): a tree
verify's figures by hand and against an independent simulation; the policy never picks a tree that the same
simulation rates slower than the best chain layout, picks none before a side candidate was seen right, and
picks one where rows are cheap and side candidates often right; the estimate of side candidates; and the
engine under any sequence of tree, chain, cold and causal steps equals the reference decoder and causal
decoding, alone and batched."""

import random
from collections import Counter

import pytest

from bdcore.decode.layout import Layout
from bdcore.decode.policy.acceptance import AlternativeEstimate, DraftAcceptance, DraftRates
from bdcore.decode.policy.cost import ForwardCost
from bdcore.decode.policy.speculation import SpeculationPolicy, cycle, layouts
from bdcore.decode.policy.tree_policy import tree_outcome, tree_shapes
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.tree import SHAPES, TreeShape, cut
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from inference.native.scheduler import Scheduler
from tests import reference_decoder as ref
from tests.layout_simulation import simulated_speed
from tests.test_invariant_4_self_spec import _prompts
from tests.test_speculation import RandomPolicy, _batch_choice_by_brute_force
from tests.tiny import agreeing_checkpoint

# ---- the figures, by hand and by simulation ---------------------------------------------------------------


def test_tree_outcome_by_hand():
    rates, alts = [0.5, 0.4], [(0.0, 0.5, 0.6, 0.7), (0.0, 0.25, 0.3, 0.3)]
    spine = TreeShape((2, 2), spine=True)
    # depth 1: argmax 0.5; a side leaf 0.5 * 0.5 = 0.25 (one token, then cold); a rejection 0.25 at row 0
    # depth 2: argmax 0.5 * 0.4 = 0.2; a side leaf 0.5 * 0.6 * 0.25 = 0.075; a rejection 0.225 at row 1
    tokens, cold, stale = tree_outcome(spine, 2, rates, alts)
    assert (tokens, cold, stale) == pytest.approx((1 + 0.25 + 0.5 + 0.075 + 0.2, 0.25 + 0.25 + 0.075 + 0.225, 0))
    tokens, cold, stale = tree_outcome(spine, 0, rates, alts)  # canvases after every spine row
    assert (cold, stale) == pytest.approx((0.25 + 0.075, 0.25 + 0.225))
    # a full tree: the side node at depth 1 has children too, right as often as the spine's (0.4 + 0.15)
    tokens, cold, stale = tree_outcome(TreeShape((2, 2)), 2, rates, alts)
    assert tokens == pytest.approx(1 + 0.75 + 0.2 + 0.075 + 0.25 * 0.55)
    assert cold == pytest.approx(0.25 + 0.225 + 0.25 + 0.075) and stale == 0
    # widths of one are the chain: the chain's figures whatever the alternatives
    chain = cycle(Layout(2, 2, 1), DraftRates(rates, rates))
    tree = cycle(Layout(2, 2, 1, tree=TreeShape((1, 1, 2))), DraftRates(rates, rates, alts))
    assert (tree.tokens, tree.forwards) == pytest.approx((chain.tokens, chain.forwards))


def test_tree_cycles_match_the_simulation():
    rng = random.Random(3)
    cost = ForwardCost({1: {1: 1.0, 4096: 1.0}})  # forwards counted: speed is tokens per forward
    for _ in range(12):
        fresh = [rng.uniform(0.2, 0.9) for _ in range(5)]
        stale = [rng.uniform(0.1, 0.6) for _ in range(5)]
        alts = [tuple(sorted([0.0] + [rng.uniform(0, 0.8) for _ in range(3)])) for _ in range(5)]
        for layout in rng.sample(layouts(5, "auto", None, "auto"), 6):
            want = cycle(layout, DraftRates(fresh, stale, alts)).tokens_per_forward
            got = simulated_speed(layout, fresh, cost, steps=30000, stale_rates=stale, alternatives=alts)
            assert got == pytest.approx(want, rel=0.03), layout


# ---- the choice -------------------------------------------------------------------------------------------


def test_the_policy_never_picks_a_tree_slower_than_the_best_chain():
    """On random acceptance, side candidates and row costs, the policy's pick among chains and trees serves
    at least as fast (by the simulation, within its noise) as the best chain layout it had without trees."""
    rng = random.Random(5)
    trees = 0
    for _ in range(25):
        points = {1: 1.0}
        for rows in (4, 16, 64, 256):
            points[rows] = points[max(points)] * rng.uniform(1.0, 2.2)
        cost = ForwardCost({1: points})
        fresh = [rng.uniform(0.2, 0.9) for _ in range(4)]
        stale = [a * rng.uniform(0.3, 1.0) for a in fresh]
        alts = [tuple(sorted([0.0] + [rng.uniform(0, 0.9) for _ in range(3)])) for _ in range(4)]
        options = layouts(4, "auto", None, "auto")
        (picked,) = SpeculationPolicy(cost).choose([DraftRates(fresh, stale, alts)], [options])
        chains = [o for o in options if o.tree is None]
        draws = dict(steps=8000, stale_rates=stale, alternatives=alts)
        best_chain = max(simulated_speed(o, fresh, cost, **draws) for o in chains)
        assert simulated_speed(picked, fresh, cost, **draws) >= 0.97 * best_chain, picked
        trees += picked.tree is not None
    assert trees > 0, "trees were picked where they pay"


def test_no_tree_before_a_side_candidate_was_seen_right_and_trees_where_they_pay():
    free = ForwardCost({1: {1: 1.0, 4096: 1.0}})
    options = [layouts(7, "auto", None, "auto")]
    none = DraftRates([0.6] * 7, [0.4] * 7, [(0.0,) * 4] * 7)
    assert SpeculationPolicy(free).choose([none], options)[0].tree is None
    right = DraftRates([0.6] * 7, [0.4] * 7, [(0.0, 0.5, 0.7, 0.8)] * 7)
    assert SpeculationPolicy(free).choose([right], options)[0].tree is not None
    steep = ForwardCost({1: {1: 1.0, 2: 2.0}})  # every row a forward's worth: causal steps
    assert SpeculationPolicy(steep).choose([right], options)[0] == Layout(0, 0, 0)


def test_batch_policy_with_trees_equals_the_brute_force_rule():
    rng = random.Random(9)
    for trial in range(20):
        points = {1: 1.0}
        for rows in (4, 16, 64, 256, 1024):
            points[rows] = points[max(points)] * rng.uniform(1.0, 2.5)
        policy = SpeculationPolicy(ForwardCost({1: points}))
        rates, options = [], []
        for _ in range(rng.randint(2, 5)):
            alts = [tuple(sorted([0.0] + [rng.random() for _ in range(3)])) for _ in range(4)]
            rates.append(DraftRates([rng.random() for _ in range(4)], [rng.random() for _ in range(4)], alts))
            trees = rng.choice(["auto", TreeShape((2, 2))])
            options.append(layouts(4, rng.choice(["last", "all", "auto"]), None, trees))
        got = policy.choose(rates, options)
        assert got == _batch_choice_by_brute_force(policy, rates, options), trial


def test_layouts_with_trees():
    chains = layouts(3, "auto", None)
    auto = layouts(3, "auto", None, "auto")
    assert [o for o in auto if o.tree is None] == chains
    for n in (1, 2, 3):  # trees after the last spine row or every one, one per distinct cut of the family
        trees = {(o.tree, o.first_canvas) for o in auto if o.drafts == n and o.tree is not None}
        assert trees == {(s, m) for s in tree_shapes(n, "auto") for m in (0, n)}
        assert len({cut(s, n) for s in tree_shapes(n, "auto")}) == len(tree_shapes(n, "auto"))
    forced = layouts(3, "last", None, TreeShape((2,), spine=True))
    assert forced == [Layout(0, 0, 0)] + [Layout(n, n, n, tree=TreeShape((2,), spine=True)) for n in (1, 2, 3)]
    assert Layout(3, 3, 3, tree=TreeShape((2, 2))).rows == 1 + (2 + 4 + 4) + 3
    # at depth 1: (2,) as a spine, (2,) full (as (2, 2)), (4,) (as (4, 2)), (3,)
    assert tree_shapes(1, "auto") == [SHAPES[i] for i in (0, 1, 3, 5)]


def test_alternative_estimate_by_hand():
    e = AlternativeEstimate([(0.0, 0.5, 0.5, 0.5)], strength=2.0)
    e.observe(1, 1)  # slot 1's AR token was its second candidate
    e.observe(1, 4)  # not among its candidates
    e.observe(2, 2)
    assert e.tried == [2, 1] and e.within[0] == [0, 1, 1, 1] and e.within[1] == [0, 0, 1, 1]
    r = e.rates(3)
    assert r[0] == pytest.approx((0.0, 2 / 4, 2 / 4, 2 / 4))
    assert r[1] == pytest.approx((0.0, 1 / 3, 2 / 3, 2 / 3))  # shrunk towards its own prior (the last repeats)
    assert r[2] == pytest.approx(r[1])  # no observation, no prior of its own: the slot before
    pooled = DraftAcceptance.from_prior([0.5], strength=8.0)
    assert pooled.rates(2).alternatives == [(0.0,) * 4] * 2
    for _ in range(10):
        pooled.alternatives.observe(1, 1)
    pooled.halve_above(4)
    assert pooled.alternatives.tried == [5]


# ---- the engine under chosen layouts ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def agreeing(request, tmp_path_factory):
    return agreeing_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("tree", ["auto", "3,2"])
def test_engine_equals_the_reference_for_random_layouts_with_trees(agreeing, tree, monkeypatch, tmp_path):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path))
    loaded = load_checkpoint(agreeing)
    model = ref.ReferenceModel(agreeing, mask_id=loaded.mask_id, clean_causal=True, within_block_causal=False)
    decode = DecodeConfig(mode="self-spec", draft_len="auto", self_spec_canvases="auto", tree=tree)
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    engine = Engine(loaded, decode, cost=ForwardCost({1: {1: 1.0}}))
    picked = Counter()
    for i, ids in enumerate(_prompts(loaded.tokenizer, 8, seed=11)):
        policy = RandomPolicy(seed=i)
        engine.driver.speculation.policy = policy
        got = engine.generate(ids, SamplingParams(max_tokens=20))
        chosen = iter([(p.drafts, p.canvas, p.first_canvas, p.tree) for (p,) in policy.picks])
        want = ref.self_spec(
            model, ids, draft_len=4, max_tokens=20, stop_ids=loaded.stop_ids, mask_id=loaded.mask_id, layouts=chosen
        )
        assert got.tokens == want.tokens == causal.generate(ids, SamplingParams(max_tokens=20)).tokens
        assert (got.stats.forwards, got.stats.accepted) == (want.forwards, want.accepted)
        picked.update(tree=sum(p.tree is not None for (p,) in policy.picks), off_spine=got.stats.off_spine)
    assert picked["tree"] > 0 and picked["off_spine"] > 0, picked


def test_auto_with_trees_is_lossless_alone_and_batched_and_learns_side_candidates(agreeing, monkeypatch, tmp_path):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path))
    loaded = load_checkpoint(agreeing)
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    decode = DecodeConfig(mode="self-spec", draft_len="auto", self_spec_canvases="auto", tree="auto")
    auto = Engine(loaded, decode, cost=ForwardCost({1: {1: 1.0, 4096: 1.05}}))  # rows nearly free: trees pay
    prompts = _prompts(loaded.tokenizer, 8, seed=2)
    params = SamplingParams(max_tokens=16)
    want = [causal.generate(ids, params).tokens for ids in prompts]
    trees = 0
    for ids, w in zip(prompts, want):
        g = auto.generate(ids, params)
        assert g.tokens == w
        trees += g.stats.tree_verifies
    assert auto.driver.speculation.pooled.alternatives.tried, "side candidates were observed and pooled"
    assert trees > 0, "the policy verified trees once side candidates were seen right"
    scheduler = Scheduler(auto, max_batch=4)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ids: scheduler.generate(ids, params).tokens, prompts))
    assert got == want and max(scheduler.batch_sizes) > 1
    sampled, _ = auto.start(prompts[0], SamplingParams(temperature=1.0, max_tokens=4))
    assert not sampled.keep_candidates and all(o.tree is None for o in sampled.policy.options), "sampled: chains only"
