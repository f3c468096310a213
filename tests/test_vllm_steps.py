"""The vLLM plugin's step glue (`inference.vllm_backend.steps`) under an emulation of vLLM 0.33's diffusion
step accounting, on CPU with a tiny Qwen3 (no vLLM needed).

The emulator is vLLM's contract as README.md ("The step contract") states it, restated independently of
the glue: a prefill schedules the prompt with no logit rows (the model computes the last row's itself);
every later step schedules the `canvas_length` drafts the sampler wrote, at the positions after the
computed tokens, each with a row of logits, under the Triton mask of the ranges `prepare_attn` passes;
the scheduler keeps drafts - (drafts - len(sampled)) rows (`update_from_output`), the worker
query_len - num_rejected (`post_update`), both holding the first rows' tokens as output; a request
stops at its stop token or max_tokens (`check_stop`). The KV cache is the tokens of the kept rows, so a
wrong position, range, padding or rollback changes the logits or breaks the cache == output invariant.
A draft-adapter model runs its LoRA at the rows of the step's per-token mapping (`StepGlue.adapter_rows`,
what the plugin hands vLLM), split by request as vLLM's flat batch is (tests/test_vllm_draft_adapter.py).
"""

import pytest
import torch

from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter import draft_rows
from inference.vllm_backend.masks import AttentionSpec, triton_visible
from inference.vllm_backend.steps import BatchRow, StepGlue
from tests.test_vllm_sampler import MASK, PROMPTS, settings
from tests.tiny import tiny_model
from tests.vllm_emulator import native_decode


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3).eval()


@torch.no_grad()
def forward(model, cached: list[int], scheduled: list[int], spec: AttentionSpec, drafting=None) -> torch.Tensor:
    """Logits of the scheduled rows after the cached ones (cache causal, as vLLM's KV holds it); a draft adapter
    acts at the scheduled rows `drafting` names (none by default)."""
    tokens, c = cached + scheduled, len(cached)
    n = len(tokens)
    mask = torch.zeros(1, 1, n, n, dtype=torch.bool)
    mask[0, 0, :c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    mask[0, 0, c:] = triton_visible(spec, c, len(scheduled))
    gate = torch.tensor([[False] * c + (drafting or [False] * len(scheduled))])
    with draft_rows(model, gate):
        out = model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(n)[None], attention_mask=mask)
    return out.logits[0, c:].float()


class Request:
    def __init__(self, prompt, params, arrival):
        self.prompt, self.params, self.arrival = prompt, params, arrival
        self.kv: list[int] = []  # tokens whose KV the cache holds
        self.output: list[int] = []  # vLLM's output tokens
        self.drafts: list[int] | None = None  # what the sampler wrote into req_states.draft_tokens
        self.done = False


def run_vllm(model, s, requests: list[Request], seeds: list[int]) -> list[Request]:
    """Drive a StepGlue as vLLM 0.33's scheduler and model runner v2 would (module docstring)."""
    glue, stops, step = StepGlue(s), {s.end_of_turn_id, *s.other_stop_ids}, 0
    while not all(r.done for r in requests):
        batch = [(str(i), r) for i, r in enumerate(requests) if r.arrival <= step and not r.done]
        for i, r in batch:
            if r.arrival == step:
                glue.add(i, r.prompt, r.params, torch.Generator().manual_seed(seeds[int(i)]))
        rows, all_logits, num_logits = [], [], []
        for i, r in batch:
            prefill = r.drafts is None
            rows.append(BatchRow(i, 0 if prefill else len(r.drafts), len(r.kv), prefill))
        ranges = glue.attention_ranges(rows)
        scheduled = [r.prompt if r.drafts is None else r.drafts for _, r in batch]
        mapping = glue.adapter_rows(rows, [len(x) for x in scheduled])  # one flag per scheduled token, batch order
        for b, (_, r) in enumerate(batch):
            assert r.drafts is None or len(r.drafts) == s.canvas_length  # vLLM schedules the whole width
            spec = AttentionSpec(True, tuple(ranges.get(b, ())))
            drafting, mapping = mapping[: len(scheduled[b])], mapping[len(scheduled[b]) :]
            all_logits.append(forward(model, r.kv, scheduled[b], spec, drafting))
            num_logits.append(rows[b].num_logits)
        flat = torch.cat(all_logits)
        query_end = torch.tensor([len(x) for x in all_logits]).cumsum(0).tolist()
        logits = torch.cat([flat[e - n : e] for e, n in zip(query_end, num_logits)])  # vLLM's logits_indices
        prefill_logits = flat[glue.prefill_rows(rows, query_end)]
        for (i, r), (emission, drafts) in zip(batch, glue.sample(rows, logits, prefill_logits)):
            g = len(emission.tokens)
            if r.drafts is None:  # the prefill: no drafts, nothing rolled back
                assert emission.rejected == 0
                r.kv = list(r.prompt)
            else:
                d = len(r.drafts)
                kept_by_scheduler = d - (d - g)  # update_from_output: num_rejected = drafts - len(generated)
                kept_by_worker = d - emission.rejected  # post_update: query_len - num_rejected
                assert kept_by_scheduler == kept_by_worker or drafts is None  # (a finishing request ends here)
                r.kv += r.drafts[:kept_by_worker]
            for tok in emission.tokens:  # check_stop, token by token
                r.output.append(tok)
                if tok in stops or len(r.output) >= r.params.max_tokens:
                    r.done = True
                    break
            if r.done:
                glue.remove(i)
                continue
            assert r.kv == r.prompt + r.output, "the KV held is the output's, in order"
            assert drafts is not None
            r.drafts = drafts
        step += 1
    assert not glue.requests
    return requests


def native_output(model, s, prompt, params, seed):
    decoder, out = native_decode(model, s, prompt, params, seed, causal_prefill=True)
    stop = [] if out.stop_token is None else [s.end_of_turn_id if out.stop_token == s.filler_id else out.stop_token]
    return out.tokens + stop, decoder


def test_diffusion_batch_equals_the_native_engine(model):
    for threshold in (0.05, 0.13):
        s = settings("diffusion", threshold=threshold)
        for params in (SamplingParams(max_tokens=14), SamplingParams(temperature=0.8, top_k=20, max_tokens=11)):
            # the third request joins late: its prefill shares a step with the others' denoise/commit forwards
            requests = [Request(p, params, arrival) for p, arrival in zip(PROMPTS, (0, 0, 3))]
            run_vllm(model, s, requests, seeds=[0, 1, 2])
            for i, r in enumerate(requests):
                assert r.output == native_output(model, s, r.prompt, params, seed=i)[0]


@pytest.mark.parametrize("size", [3, 4])
def test_self_spec_batch_equals_the_native_engine(model, size):
    s = settings("self-spec", size=size)
    for params in (SamplingParams(max_tokens=16), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=9)):
        requests = [Request(p, params, arrival) for p, arrival in zip(PROMPTS, (0, 2, 0))]
        run_vllm(model, s, requests, seeds=[10, 11, 12])
        for i, r in enumerate(requests):
            want, native = native_output(model, s, r.prompt, params, seed=10 + i)
            assert r.output == want
    assert sum(native.seq.stats.accepted.values()) > 0


def test_the_prefill_seeds_from_the_prompts_last_row(model):
    """A prefill gets its last row alone (vLLM gives it none); the pending token is that row's argmax."""
    glue = StepGlue(settings("self-spec"))
    glue.add("a", PROMPTS[0], SamplingParams(max_tokens=4), torch.Generator())
    row = BatchRow("a", 0, 0, True)
    full = forward(model, [], PROMPTS[0], AttentionSpec(True, ()))
    [(emission, drafts)] = glue.sample([row], full[:0], full[-1:])
    assert emission.tokens == [] and emission.rejected == 0
    assert drafts[0] == int(full[-1].masked_fill(torch.arange(full.shape[1]) == MASK, -1e9).argmax())


def test_the_glue_refuses_what_breaks_the_kv_accounting(model):
    s = settings("self-spec")
    glue = StepGlue(s)
    glue.add("a", PROMPTS[1], SamplingParams(max_tokens=8), torch.Generator())
    full = forward(model, [], PROMPTS[1], AttentionSpec(True, ()))
    glue.sample([BatchRow("a", 0, 0, True)], full[:0], full[-1:])
    fake = torch.zeros(s.canvas_length, full.shape[1])
    with pytest.raises(RuntimeError, match="out of step"):  # vLLM's computed count is not the plan's
        glue.sample([BatchRow("a", s.canvas_length, len(PROMPTS[1]) + 1, False)], fake, None)
    # vLLM cut the drafts short (max_model_len): the answer ends with end-of-turn, every row rolled back,
    # and so does any later step vLLM schedules (it stops at end-of-turn: command.py checks)
    pending = glue.requests["a"].planned.tokens[0]
    [(emission, drafts)] = glue.sample([BatchRow("a", 2, len(PROMPTS[1]), False)], fake[:2], None)
    assert (emission.tokens, emission.rejected, drafts) == ([pending, s.end_of_turn_id], 2, None)
    [(emission, drafts)] = glue.sample([BatchRow("a", 2, len(PROMPTS[1]), False)], fake[:2], None)
    assert (emission.tokens, emission.rejected, drafts) == ([s.end_of_turn_id], 2, None)
    # vLLM's warmup/dummy requests: nothing sampled, every row rolled back, no drafts
    [(emission, drafts)] = glue.sample([BatchRow("_warmup_0", 3, 0, False)], fake[:3], None)
    assert (emission.tokens, emission.rejected, drafts) == ([], 3, None)
