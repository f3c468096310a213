"""Tiny random models and samples for tests: the models and checkpoints come from benchmark/tiny.py."""

from __future__ import annotations

import random

from benchmark.tiny import (  # noqa: F401 (re-exported for the tests)
    EOT_ID,
    FILLER_ID,
    MASK_ID,
    VOCAB,
    tiny_checkpoint,
    tiny_config,
    tiny_hybrid_config,
    tiny_hybrid_model,
    tiny_model,
)
from train.rows import Sample


def random_sample(rng: random.Random, *, turns: int = 1, max_prompt: int = 9, max_resp: int = 13) -> Sample:
    """Prompt / response turns of random ids; every response ends with the end-of-turn token."""
    ids: list[int] = []
    spans = []
    for _ in range(turns):
        ids += [rng.randrange(0, 90) for _ in range(rng.randint(1, max_prompt))]
        start = len(ids)
        ids += [rng.randrange(0, 90) for _ in range(rng.randint(0, max_resp - 1))] + [EOT_ID]
        spans.append((start, len(ids)))
    return Sample(ids, spans)


def agreeable(path, tok, prompts: list[list[int]], *, eot_boost: float, common_boost: float) -> None:
    """Edit a tiny checkpoint at `path` in place so that decoding reaches every branch: a random model rarely
    stops or agrees with its own drafts. The end-of-turn token's (tied) embedding row is scaled by
    `eot_boost`, so some answers end with it; one ordinary token's row ("e") is pushed along the model's mean
    final hidden state over `prompts` by `common_boost`, so it is likely at many rows of both streams and
    self-spec sees full acceptances as well as rejections. `tok`: the checkpoint's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from bdcore.tokens import end_of_turn_id

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        rows = model.get_output_embeddings().weight
        hidden = torch.cat(
            [model.get_decoder()(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]
        ).mean(0)
        rows[tok.convert_tokens_to_ids("e")] += common_boost * rows.norm(dim=1).mean() * hidden / hidden.norm()
        rows[end_of_turn_id(tok)] *= eot_boost
    model.save_pretrained(path)


def agreeing_checkpoint(directory, arch: str, *, boost: float = 1.5):
    """A servable tiny checkpoint (bd_size 4) edited by `agreeable` (both boosts `boost`), so that its drafts
    are often right and its answers stop: the draft-tree tests' model. Its path."""
    from bdcore.loading import load_checkpoint
    from tests.test_invariant_4_self_spec import _prompts

    path = tiny_checkpoint(directory, arch=arch, bd_size=4)
    tok = load_checkpoint(path).tokenizer
    agreeable(path, tok, _prompts(tok, 4, seed=1), eot_boost=boost, common_boost=boost)
    return path
