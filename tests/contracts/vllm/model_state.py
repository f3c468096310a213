"""The plugin's ModelState shell (`inference/vllm_backend/model.py`) run on CPU inside vLLM 0.33.0's own code.

Imports the real module (vLLM's GPU worker modules import on CPU), then drives `BdstackModelState` and
`BdstackSampler` over a fake two-request batch whose fields are checked to be the real `InputBatch`'s:
`add_request` with vLLM's `NewRequestData` and `SamplingParams`; the sampler's `SamplerOutput` (vLLM's
class) and the drafts it writes into `req_states.draft_tokens`, against `sampler.RequestDecoder` driven
directly; `prepare_attn`'s call of `build_attn_metadata` (recorded, and bound to the real function's
signature) with each request's ranges. Not run: a forward (no GPU model stack), vLLM's scheduler loop.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import torch

VOCAB = 64
SETTINGS = {"mask_id": 63, "end_of_turn_id": 1, "filler_id": 2}
MODES = (("self-spec", 3), ("diffusion", 4))
PROMPTS = {"a": [5, 9, 13, 7], "b": [40, 41, 8, 20, 21, 22]}


def fake_batch(rows: list[tuple[str, int, int, int, bool]], width: int):
    """(req_id, slot, computed, scheduled, prefilling) per request -> InputBatch-shaped fields."""
    n = len(rows)
    scheduled = np.array([r[3] for r in rows], dtype=np.int32)
    logits = np.array([0 if r[4] else width for r in rows])
    q = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    computed = np.array([r[2] for r in rows], dtype=np.int32)
    prefill_len = np.array([len(PROMPTS[r[0]]) for r in rows], dtype=np.int32)
    return SimpleNamespace(
        req_ids=[r[0] for r in rows],
        num_reqs=n,
        num_reqs_after_padding=n,
        num_tokens=int(q[-1]),
        num_tokens_after_padding=int(q[-1]),
        idx_mapping_np=np.array([r[1] for r in rows], dtype=np.int64),
        cu_num_logits_np=np.concatenate([[0], np.cumsum(logits)]).astype(np.int32),
        num_scheduled_tokens=scheduled,
        num_computed_tokens_np=computed,
        num_computed_prefill_tokens_np=np.minimum(computed, prefill_len),
        prefill_len_np=prefill_len,
        is_prefilling_np=np.array([r[4] for r in rows]),
        query_start_loc=torch.from_numpy(q),
        query_start_loc_np=q,
        seq_lens=torch.from_numpy(computed + scheduled),
        seq_lens_cpu_upper_bound=torch.from_numpy(computed + scheduled),
        positions=torch.zeros(int(q[-1]), dtype=torch.int64),
    )


def check_model_state(r) -> None:
    for mode, size in MODES:
        check_mode(r, mode, size)


def check_mode(r, mode: str, size: int) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu import attn_utils
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    import inference.vllm_backend.model as m
    from bdcore.decode.sampling import SamplingParams as OurParams
    from inference.vllm_backend.sampler import RequestDecoder
    from inference.vllm_backend.settings import VllmDecodeSettings
    from inference.vllm_backend.steps import StepGlue

    def check(ok: bool, what: str) -> None:
        r.check(ok, f"{mode}: {what}")

    settings = VllmDecodeSettings(mode, size, **SETTINGS)
    width = settings.canvas_length
    real = {f.name for f in dataclasses.fields(InputBatch)}
    fields = set(vars(fake_batch([("a", 0, 0, 4, True)], width)))
    check(fields <= real, f"the fake batch's fields are InputBatch's (not: {sorted(fields - real)})")

    state = m.BdstackModelState.__new__(m.BdstackModelState)  # __init__ needs a checkpoint and a VllmConfig
    state.settings, state.glue, state.device = settings, StepGlue(settings), torch.device("cpu")
    state.draft = None  # no draft adapter (lora.py drives one)
    state.rope_state = state.prompt_embeds_state = None  # DefaultModelState's, for a text model
    state.model = SimpleNamespace(bdstack_prefill_rows=None, bdstack_prefill_logits=None)
    for req_id, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=12, extra_args={"bdstack": {"temperature": 0.0}})
        state.add_request(0, NewRequestData(req_id, prompt, [], params, None, ([],), 0, None))
    check(set(state.glue.requests) == set(PROMPTS), "add_request: a CanvasRequest per NewRequestData")

    draft_table = torch.zeros(4, width, dtype=torch.int64)  # vLLM's req_states.draft_tokens
    base = SimpleNamespace(sampling_states=None, req_states=SimpleNamespace(draft_tokens=draft_table))
    base.add_request = base.apply_staged_writes = lambda *a: None
    sampler, none = state.custom_sampler(base)
    check(none is None and isinstance(sampler, m.BdstackSampler), "custom_sampler: (ours, no rejection sampler)")

    direct = {k: RequestDecoder(settings, p, OurParams(max_tokens=12), torch.Generator()) for k, p in PROMPTS.items()}
    gen = torch.Generator().manual_seed(0)

    # step 1: both prompts prefill (no logit rows); the model computed their last rows' logits
    batch = fake_batch([("a", 2, 0, 4, True), ("b", 3, 0, 6, True)], width)
    default_inputs = m.DefaultModelState.prepare_inputs
    m.DefaultModelState.prepare_inputs = lambda self, b, s: {}  # a rope-free text model's (needs no GPU buffer)
    try:
        state.prepare_inputs(batch, None)
    finally:
        m.DefaultModelState.prepare_inputs = default_inputs
    rows = state.model.bdstack_prefill_rows
    check(rows is not None and rows.tolist() == [3, 9], f"prepare_inputs: last prompt rows [3, 9] (got {rows})")
    last = torch.randn(2, VOCAB, generator=gen)
    state.model.bdstack_prefill_logits = last
    out = sampler(torch.zeros(0, VOCAB), batch)
    check(isinstance(out, SamplerOutput), "the sampler returns vLLM's SamplerOutput")
    check(out.num_sampled.tolist() == [0, 0] and out.num_rejected.tolist() == [0, 0], "a prefill samples nothing")
    for i, (k, slot) in enumerate((("a", 2), ("b", 3))):
        d = direct[k]
        step = d.next_step()
        full = last[i : i + 1].clone()
        full[:, settings.mask_id] = float("-inf")
        d.take(full.expand(len(step.tokens), -1))
        want = d.next_step().tokens
        got = draft_table[slot].tolist()
        check(got == want + [settings.mask_id] * (width - len(want)), f"{k}: drafts {got} = RequestDecoder's {want}")

    # step 2: both run the planned forward; the recorded build_attn_metadata call carries their ranges
    batch = fake_batch([("a", 2, 4, width, False), ("b", 3, 6, width, False)], width)
    calls = []
    real_build = attn_utils.build_attn_metadata
    m.build_attn_metadata = lambda **kw: calls.append(kw) or {}
    try:
        state.prepare_attn(batch, None, (), torch.zeros(0), [[]], None)
    finally:
        m.build_attn_metadata = real_build
    kw = calls[0] if calls else {}
    try:
        inspect.signature(real_build).bind(**kw)
        bound = True
    except TypeError:
        bound = False
    check(bound, "prepare_attn's build_attn_metadata call binds to vLLM's signature")
    want_ranges = {i: list(direct[k].next_step().attention.ranges) for i, k in enumerate("ab")}
    want_ranges = {i: v for i, v in want_ranges.items() if v} or None
    check(kw.get("mm_req_doc_ranges") == want_ranges, f"ranges {kw.get('mm_req_doc_ranges')} = {want_ranges}")
    check(kw.get("causal") is True, "every request causal (the ranges open the canvas)")

    logits = torch.randn(2 * width, VOCAB, generator=gen)
    out = sampler(logits, batch)
    for i, (k, start) in enumerate((("a", 4), ("b", 6))):
        d = direct[k]
        step = d.next_step()
        rows_logits = logits[i * width : i * width + len(step.tokens)].clone()
        rows_logits[:, settings.mask_id] = float("-inf")
        result = d.take(rows_logits)
        kept = result.computed - start
        n = int(out.num_sampled[i])
        check(
            d.finished or out.sampled_token_ids[i, :n].tolist() == step.tokens[:kept],
            f"{k}: vLLM keeps rows {step.tokens[:kept]} as output (got {out.sampled_token_ids[i, :n].tolist()})",
        )
        check(d.finished or int(out.num_rejected[i]) == width - kept, f"{k}: num_rejected = {width} - {kept}")
