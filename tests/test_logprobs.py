"""Log-probabilities of answer tokens (`SamplingParams.logprobs`, the server's `logprobs`/`top_logprobs`).

causal and self-spec report the AR log-probability of each emitted token, checked against one independent
full forward of the stock model over [prompt, answer]; diffusion reports the shared diffusion
log-probability (the token's in the state it was committed from), checked against the rollout trace and
`train.trajectory.trajectory_logprobs`. The server carries them in OpenAI's shapes, whole and streamed."""

import copy

import pytest
import torch
from openai import OpenAI

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from inference.native.engine import Engine
from tests.conftest import native_server
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.rollout import rollout
from train.trajectory import trajectory_logprobs


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("lp"), bd_size=4))


def ar_logprobs(model, mask_id: int, prompt, answer) -> torch.Tensor:
    """log p(answer[i] | prompt, answer[:i]) from one stock causal forward of `model`, `<|mask|>` banned."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + answer])).logits[0].float()
    logits[:, mask_id] = float("-inf")
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].log_softmax(-1)
    return rows.gather(-1, torch.tensor(answer)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "decode,params",
    [
        (DecodeConfig(mode="causal"), SamplingParams(max_tokens=12, logprobs=3)),
        (DecodeConfig(mode="self-spec"), SamplingParams(max_tokens=12, logprobs=3)),
        (DecodeConfig(mode="self-spec", self_spec_canvases="all"), SamplingParams(max_tokens=12, logprobs=0)),
        (DecodeConfig(mode="self-spec"), SamplingParams(max_tokens=12, logprobs=2, temperature=0.9, seed=3)),
    ],
    ids=["causal", "self-spec", "self-spec-all", "self-spec-sampled"],
)
def test_causal_and_self_spec_report_the_ar_logprob_of_each_emitted_token(loaded, decode, params):
    engine = Engine(loaded, decode)
    for prompt in _prompts(loaded.tokenizer, 3, seed=2):
        g = engine.generate(prompt, params)
        assert [e.token for e in g.logprobs] == g.tokens and g.tokens
        want = ar_logprobs(loaded.model, loaded.mask_id, prompt, g.tokens)
        torch.testing.assert_close(torch.tensor([e.logprob for e in g.logprobs]), want, atol=1e-4, rtol=1e-4)
        for e in g.logprobs:
            values = [lp for _, lp in e.top]
            assert len(e.top) == params.logprobs and values == sorted(values, reverse=True)
            if params.logprobs and params.greedy:
                assert e.top[0] == (e.token, pytest.approx(e.logprob, abs=1e-6))


def test_diffusion_reports_the_shared_diffusion_logprob(loaded):
    sc = loaded.sidecar
    decode = DecodeConfig(mode="diffusion", threshold=0.3)
    engine = Engine(loaded, decode)
    prompts = _prompts(loaded.tokenizer, 3, seed=2)
    traced = rollout(
        loaded.model,
        prompts,
        caps=loaded.capabilities,
        decode=decode,
        params=SamplingParams(max_tokens=12),
    )
    lm = TwoStreamLM(copy.deepcopy(loaded.model), BlockDiffusionConfig(bd_size=sc.bd_size))
    shared = trajectory_logprobs(
        lm, traced, mask_id=loaded.mask_id, filler_id=filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))
    )
    for prompt, ro, logp in zip(prompts, traced, shared):
        g = engine.generate(prompt, SamplingParams(max_tokens=12, logprobs=1))
        assert g.tokens == ro.tokens and [e.token for e in g.logprobs] == g.tokens
        by_position = {st.start + s: lp for st in ro.steps for s, lp in zip(st.slots, st.logprobs)}
        P = len(prompt)
        want = torch.tensor([by_position[P + i] for i in range(len(g.tokens))])
        got = torch.tensor([e.logprob for e in g.logprobs])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        # trajectory_logprobs is in commit order; re-order it by position to compare
        in_commit_order = [st.start + s for st in ro.steps for s in st.slots if st.start + s < P + len(ro.response)]
        shared_by_pos = dict(zip(in_commit_order, logp.detach().tolist()))
        torch.testing.assert_close(
            got, torch.tensor([shared_by_pos[P + i] for i in range(len(g.tokens))]), atol=2e-4, rtol=1e-4
        )


def test_no_logprobs_unless_asked(loaded):
    g = Engine(loaded, DecodeConfig(mode="diffusion")).generate(_prompts(loaded.tokenizer, 1)[0], SamplingParams())
    assert g.logprobs is None


@pytest.mark.e2e
def test_the_server_returns_logprobs_in_openai_shapes(tmp_path):
    with native_server(tiny_checkpoint(tmp_path, bd_size=4)) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msg = [{"role": "user", "content": "Copy: abc"}]
        for mode in ("causal", "diffusion", "self-spec"):
            r = client.chat.completions.create(
                model="tiny", messages=msg, max_tokens=8, logprobs=True, top_logprobs=2, extra_body={"mode": mode}
            )
            content = r.choices[0].logprobs.content
            assert "".join(c.token for c in content) == r.choices[0].message.content
            assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
            stream = client.chat.completions.create(
                model="tiny",
                messages=msg,
                max_tokens=8,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                extra_body={"mode": mode},
            )
            streamed = [
                c for ch in stream if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
            ]
            assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
        plain = client.chat.completions.create(model="tiny", messages=msg, max_tokens=4)
        assert plain.choices[0].logprobs is None
        comp = client.completions.create(model="tiny", prompt="Copy: abc", max_tokens=8, logprobs=2)
        lp = comp.choices[0].logprobs
        assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        chunks = client.completions.create(model="tiny", prompt="Copy: abc", max_tokens=8, logprobs=2, stream=True)
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert len(parts) > 1 and [t for p in parts for t in p.tokens] == lp.tokens
        assert [o for p in parts for o in p.text_offset] == lp.text_offset, "offsets run on across chunks"
        with pytest.raises(Exception, match="top_logprobs"):
            client.chat.completions.create(model="tiny", messages=msg, max_tokens=2, top_logprobs=2)
        with pytest.raises(Exception, match="logprobs"):
            client.completions.create(model="tiny", prompt="ab", max_tokens=2, logprobs=9)
