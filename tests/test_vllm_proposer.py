"""Self-spec drafts for a live vLLM (`inference.vllm_backend.proposer`): vLLM's custom-class proposer call, with
vLLM's arguments as it passes them (numpy token buffers, per-row sampled lists), on a tiny draft-adapter
checkpoint. Every draft is held to an independent reference: the same checkpoint's drafting rows computed
afresh from the whole context (no cache), so the proposer's cache bookkeeping (tokens kept across steps,
rows whose request changed or moved, rows that sampled nothing) cannot drift unseen."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import SequenceCache
from bdcore.loading import load_checkpoint
from bdcore.serving_gate import CannotServe
from benchmark.tiny import draft_checkpoint, tiny_checkpoint
from inference.vllm_backend.proposer import SelfSpecProposer

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return draft_checkpoint(tmp_path_factory.mktemp("proposer") / "ckpt")


def vllm_config(path, k: int = K):
    """What the proposer reads of vLLM's config."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(path), dtype=torch.float32),
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
    )


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The drafts after a context, from one fresh forward over all of it: its tokens but the last as clean rows,
    then the seeded canvas [last, fill x K], whose row j drafts the token j + 1 places after the last."""
    loaded = load_checkpoint(checkpoint, device="cpu", dtype="fp32")
    runner = ModelRunner.for_checkpoint(loaded.model, loaded.capabilities)
    fill = CanvasFill.for_checkpoint(loaded.capabilities)

    def drafts(tokens: list[int]) -> list[int]:
        n = len(tokens) - 1
        rows = Rows().clean(tokens[:-1], 0).canvas([tokens[-1]] + fill(K), n)
        (logits,) = runner.forward([(SequenceCache(), Forward(rows, n))])
        return logits[n : n + K].argmax(-1).tolist()

    return drafts


def propose(proposer, contexts: list[list[int] | None]):
    """One vLLM call: row i holds contexts[i] (None: a row that sampled nothing this step)."""
    width = 64
    buffer = np.zeros((len(contexts), width), dtype=np.int64)
    lengths = np.zeros(len(contexts), dtype=np.int32)
    for i, tokens in enumerate(contexts):
        if tokens is not None:
            buffer[i, : len(tokens)], lengths[i] = tokens, len(tokens)
    sampled = [[] if tokens is None else [tokens[-1]] for tokens in contexts]
    return proposer.propose(sampled, lengths, buffer, slot_mappings=None)


def test_the_proposer_drafts_what_a_fresh_forward_over_the_context_drafts(checkpoint, reference):
    proposer = SelfSpecProposer(vllm_config(checkpoint))
    a = [5, 9, 14, 3, 7, 22, 8, 11]
    b = [4, 17, 2, 9, 40, 6]
    c = [12, 6, 31, 25, 19]
    steps = [
        [a, b],  # two prompts
        [a + [30], b + [3, 8, 8]],  # one token accepted in row 0, three in row 1
        [a + [30, 2, 2], None],  # row 1 sampled nothing this step
        [b + [3, 8, 8, 1], a + [30, 2, 2, 9]],  # the two requests swapped rows
        [c, a + [30, 2, 2, 9, 4]],  # a new request in row 0; row 1 goes on
        [c + [7]],  # row 1 finished: the batch shrank
        [c[:3] + [50, 51, 52]],  # a new request sharing the first 3 tokens (a chat template's, say): kept
    ]
    for contexts in steps:
        got = propose(proposer, contexts)
        want = [[] if tokens is None else reference(tokens) for tokens in contexts]
        assert got == want
        assert all(len(d) == K for d, t in zip(got, contexts) if t is not None)
    assert set(proposer.drafter.rows) == {0}, "a row out of the batch keeps no cache"
    state = proposer.drafter.rows[0]
    assert state.tokens == c[:3] + [50, 51], "the cache holds the context but its last token"
    assert state.cache.length == 5


def test_the_proposer_refuses_what_cannot_self_spec(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="at least one token"):
        SelfSpecProposer(vllm_config(checkpoint, k=0))
    with pytest.raises(CannotServe):  # a canvas longer than the block the checkpoint was trained on
        SelfSpecProposer(vllm_config(checkpoint, k=8))
    unshifted = tiny_checkpoint(tmp_path / "unshifted", shift=False)
    with pytest.raises(CannotServe):  # a single-stream checkpoint: no AR head to verify with, no self-spec
        SelfSpecProposer(vllm_config(unshifted))
