"""The reply's `top_logprobs` (`inference.server.responses.answer_logprobs`) carry each alternative's own
log-probability under the model, in chat and completions shapes, checked against one stock causal
forward over [prompt, answer]. The logprob tests check the engine's `TokenLogprob.top` and the reply's
shapes and lengths, so a reply that wrote the chosen token's log-probability against every alternative
passed them."""

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import Engine
from inference.server.responses import answer_logprobs
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint

K = 3


def _stock_top(model, mask_id, prompt, answer) -> list[list[float]]:
    """Per answer token, the K largest log-probabilities of the row that produced it (`<|mask|>` banned)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + answer])).logits[0].float()
    logits[:, mask_id] = float("-inf")
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].log_softmax(-1)
    return rows.topk(K, dim=-1).values.tolist()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_each_alternative_carries_its_own_logprob(tmp_path, kind):
    loaded = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    engine = Engine(loaded, DecodeConfig(mode="causal"))
    for prompt in _prompts(loaded.tokenizer, 2, seed=2):
        g = engine.generate(prompt, SamplingParams(max_tokens=8, logprobs=K))
        field = answer_logprobs(kind, g.logprobs, loaded.tokenizer)
        if kind == "chat":
            got = [[alt["logprob"] for alt in c["top_logprobs"]] for c in field["content"]]
        else:  # {token string: logprob}; the char tokenizer's alternatives have distinct strings
            got = [list(top.values()) for top in field["top_logprobs"]]
        want = _stock_top(loaded.model, loaded.mask_id, prompt, g.tokens)
        assert len(got) == len(want) == len(g.tokens) > 0
        for values, row in zip(got, want):
            assert len(set(row)) > 1, "the alternatives differ (the test can tell them apart)"
            torch.testing.assert_close(
                torch.tensor(sorted(values, reverse=True)), torch.tensor(row), atol=1e-4, rtol=1e-4
            )
