"""OPD's revisited states (`train.opd.choose_states`): `per_block` of each block's recorded canvases, drawn
uniformly at random, every seed kept. Always revisiting a block's first state (its all-masked canvas)
would train the student only on the state it sees first and never on the partly filled canvases it
commits most tokens from; the KL tests revisit whatever was chosen, so they cannot tell. The trainer
draws the choice from its step's generator, so other steps revisit other states."""

from collections import Counter

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from tests.conftest import in_process_trainer
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from tests.train_args import train_args
from train import opd_trainer
from train.opd import choose_states
from train.rollout import rollout


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Greedy rollouts at a high threshold: one slot a step, so every block has several canvas states."""
    loaded = load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("opd_states"), bd_size=4))
    return rollout(
        loaded.model,
        _prompts(loaded.tokenizer, 2, seed=2),
        caps=loaded.capabilities,
        decode=DecodeConfig(mode="diffusion", threshold=0.99),
        params=SamplingParams(max_tokens=12),
    )


def _states_by_block(ro) -> dict[int, list[int]]:
    """Per block start, the ids of its canvas states in decode order."""
    by_block: dict[int, list[int]] = {}
    for step in ro.steps:
        if step.canvas is not None:
            by_block.setdefault(step.start, []).append(id(step))
    return by_block


def test_each_state_of_a_block_is_revisited_equally_often(recorded):
    gen = torch.Generator().manual_seed(0)  # one generator across draws, as the trainer's step generator
    n = 600
    for ro in recorded:
        blocks = _states_by_block(ro)
        assert max(len(v) for v in blocks.values()) >= 3, "blocks with several states (the test has a choice)"
        seen = {start: Counter() for start in blocks}
        for _ in range(n):
            chosen = choose_states(ro, 1, gen)
            assert [s for s in chosen.steps if s.canvas is None] == [s for s in ro.steps if s.canvas is None]
            got = _states_by_block(chosen)
            assert got.keys() == blocks.keys() and all(len(v) == 1 for v in got.values())
            for start, (state,) in got.items():
                seen[start][blocks[start].index(state)] += 1
        for start, states in blocks.items():
            for place in range(len(states)):  # uniform over the block's states: 1/k each
                assert abs(seen[start][place] / n - 1 / len(states)) < 0.08, (start, seen[start])


def test_several_states_per_block_are_distinct_and_zero_keeps_all(recorded):
    gen = torch.Generator().manual_seed(1)
    for ro in recorded:
        blocks = _states_by_block(ro)
        chosen = _states_by_block(choose_states(ro, 2, gen))
        for start, states in blocks.items():
            assert len(set(chosen[start])) == min(2, len(states))
            assert [states.index(s) for s in chosen[start]] == sorted(states.index(s) for s in chosen[start])
        assert choose_states(ro, 0, gen).steps == ro.steps


@pytest.mark.e2e
def test_the_trainer_revisits_other_states_at_other_steps(demo_kit, tmp_path, monkeypatch):
    """A generator that restarts at every step (or every rollout) revisits the same place in each block for
    the whole run; the step's generator goes on drawing. The kit's base never ends an answer early and
    commits about one slot a step at this threshold, so every block has several states to choose from."""
    draws = []  # (states in the block, the place of the chosen one) for each rollout's first block

    def spy(ro, per_block, generator):
        chosen = choose_states(ro, per_block, generator)
        first = min(_states_by_block(ro))
        states, (pick,) = _states_by_block(ro)[first], _states_by_block(chosen)[first]
        draws.append((len(states), states.index(pick)))
        return chosen

    monkeypatch.setattr(opd_trainer, "choose_states", spy)
    flags = dict(opd_on_policy=True, opd_prompts_per_step=2, opd_max_new_tokens=8, opd_threshold=0.99, lr="1e-3")
    with in_process_trainer(train_args(demo_kit, tmp_path / "run", max_steps=4, **flags)) as trainer:
        for _ in range(4):
            trainer.train_step()
    assert len(draws) == 8
    k = max(n for n, _ in draws)
    assert k >= 3 and sum(n == k for n, _ in draws) >= 6, draws
    assert len({place for n, place in draws if n == k}) > 1, draws
