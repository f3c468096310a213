"""What upstream SGLang 0.5.23's own dLLM code does with unshifted canvases, on CPU (no GPU, no install).

Backs the single-stream section of docs/design.md (8.14). Imports the wheel's own
`srt/dllm/algorithm/{base,low_confidence}.py` and `srt/dllm/mixin/req.py` from an unzipped wheel, stubbing
only the modules they import for annotations (logits_processor, forward_batch_info, model_runner,
server_args, utils.is_npu, dllm.config):

    pip download --no-deps sglang==0.5.23 -d /tmp/w && unzip -q /tmp/w/sglang-0.5.23-*.whl -d /tmp/w/src
    PYTHONPATH=. .venv/bin/python -m tests.contracts.sglang.unshifted_check /tmp/w/src/sglang

1. LowConfidence.run (base._run_sync) with a fake model runner whose logits are unshifted
   (row j predicts slot j) == a re-implementation with bdcore.decode.rules.commit_slots
   (greedy), forward for forward; the last forward's input holds no mask (the KV-persisting one).
2. Block placement from the real ReqDllmMixin: non-separate (LowConfidence) path vs
   separate-context path, for prompt lengths that are and are not multiples of B.
"""

import sys
import types
from array import array
from types import SimpleNamespace

import torch

SRC = sys.argv[1] if len(sys.argv) > 1 else "sglang"  # the unzipped wheel's sglang/ directory


def mod(name, path=None, **names):
    m = types.ModuleType(name)
    m.__dict__.update(names)
    if path:
        m.__path__ = [path]
    sys.modules[name] = m
    return m


class DllmConfig:  # the real one imports ModelConfig/ServerArgs; same fields
    def __init__(self, **kw):
        self.__dict__.update(kw)


mod("sglang", SRC)
mod("sglang.srt", SRC + "/srt")
mod("sglang.srt.dllm", SRC + "/srt/dllm")
mod("sglang.srt.dllm.mixin", SRC + "/srt/dllm/mixin")
mod("sglang.srt.dllm.config", DllmConfig=DllmConfig)
mod("sglang.srt.layers")
mod("sglang.srt.layers.logits_processor", LogitsProcessorOutput=object)
mod("sglang.srt.model_executor")
mod("sglang.srt.model_executor.forward_batch_info", ForwardBatch=object)
mod("sglang.srt.model_executor.model_runner", ModelRunner=object)
mod("sglang.srt.server_args", ServerArgs=object)
mod("sglang.srt.utils", is_npu=lambda: False)

import logging  # noqa: E402

logging.disable(logging.WARNING)  # gemma4_renoise cannot import here; the table logs and skips it
from sglang.srt.dllm.algorithm import algo_name_to_cls  # noqa: E402  (the real table)
from sglang.srt.dllm.mixin.req import ReqDllmMixin  # noqa: E402

from bdcore.decode.rules import commit_slots  # noqa: E402

MASK, V, B, THR = 99, 100, 8, 0.9


def toy_logits(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Unshifted toy model: row j's argmax is a function of its absolute position; its confidence grows
    with the number of non-mask tokens in the block (so several steps are needed)."""
    bs = ids.numel() // B
    out = torch.empty(ids.numel(), V)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, V, generator=g)
    for i in range(bs):
        blk = ids[i * B : (i + 1) * B]
        known = int((blk != MASK).sum())
        for j in range(B):
            p = int(positions[i * B + j])
            row = base[p].clone()
            row[(7 * p + 3) % (V - 1)] += 1.0 + 1.2 * known + 0.3 * ((p * 5) % 7)
            out[i * B + j] = row
    return out


class FakeRunner:
    def __init__(self, positions):
        self.positions, self.inputs = positions, []

    def forward(self, fb, pp_proxy_tensors=None):
        self.inputs.append(fb.input_ids.clone())
        full = toy_logits(fb.input_ids, self.positions)
        return SimpleNamespace(logits_output=SimpleNamespace(full_logits=full), can_run_graph=False)


def expected(canvas0: torch.Tensor, positions, prompt_lens):
    """bdcore rules, greedy, unshifted: commit_slots on each request's masked slots; after the block is
    decided one more forward over its final tokens (the KV write)."""
    ids, inputs = canvas0.clone(), []
    bs = ids.numel() // B
    while True:
        inputs.append(ids.clone())
        logits = toy_logits(ids, positions).view(bs, B, V)
        any_masked = False
        for i in range(bs):
            row = ids[i * B : (i + 1) * B]
            masked = row == MASK
            masked[: prompt_lens[i]] = False
            if not masked.any():
                continue
            any_masked = True
            probs = logits[i].softmax(-1)
            conf, tok = probs.max(-1)
            commit = commit_slots(conf, masked, threshold=THR, last_step=False)
            row[commit] = tok[commit]
        if not any_masked:
            return ids, inputs


def check_low_confidence():
    algo = algo_name_to_cls["LowConfidence"](
        DllmConfig(block_size=B, mask_id=MASK, first_done_first_out_mode=False, algorithm_config={"threshold": THR})
    )
    # two requests in one DLLM_EXTEND batch: one canvas of B masks (prompt length a multiple of B),
    # one holding a prompt tail of 3 tokens (prompt length = 3 mod B), blocks at offsets 16 and 40
    prompt_tail = [11, 12, 13]
    canvas0 = torch.tensor([MASK] * B + prompt_tail + [MASK] * (B - 3))
    positions = torch.tensor(list(range(16, 16 + B)) + list(range(40, 40 + B)))
    fb = SimpleNamespace(batch_size=2, input_ids=canvas0.clone(), dllm_prompt_mask=None)
    runner = FakeRunner(positions)
    _, tokens, accept, states, _ = algo.run(runner, fb)
    want_ids, want_inputs = expected(canvas0, positions, [0, 3])
    assert [t.tolist() for t in tokens] == [want_ids[:B].tolist(), want_ids[B + 3 :].tolist()], tokens
    assert len(runner.inputs) == len(want_inputs), (len(runner.inputs), len(want_inputs))
    for got, want in zip(runner.inputs, want_inputs):
        assert torch.equal(got, want)
    assert not (runner.inputs[-1] == MASK).any(), "last forward must be over final tokens"
    assert (runner.inputs[-2] == MASK).any()
    print(
        f"LowConfidence == bdcore commit_slots (greedy, unshifted): {len(runner.inputs)} forwards "
        f"({len(runner.inputs) - 1} denoise + 1 over the final tokens); emitted {[len(t) for t in tokens]} tokens; "
        f"per-forward masks left {[int((x == MASK).sum()) for x in runner.inputs]}"
    )


class FakeReq(ReqDllmMixin):
    """Just the fields ReqDllmMixin reads (schedule_batch.Req keeps the same names)."""

    def __init__(self, prompt, cfg):
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.prefix_len = 0
        self.full_untruncated_fill_ids = array("q")
        self.dllm_initialized = False
        self.init_diffusion_llm(cfg)

    @property
    def seqlen(self):  # schedule_batch.py:1490
        return len(self.origin_input_ids) + len(self.output_ids)

    def refresh_fill_ids(self):
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids


def placement(prompt_len: int, separate: bool, rounds: int = 4):
    """Where each canvas sits. Non-separate: every DLLM_EXTEND forward extends B tokens per request
    (schedule_policy.py:1032-1035) and positions run block_offset..+B (forward_batch_info.py:1190-1193)."""
    cfg = DllmConfig(block_size=B, mask_id=MASK, requires_separate_context_encoding=separate)
    req = FakeReq(list(range(1, prompt_len + 1)), cfg)
    canvases = []
    for _ in range(20):
        req._init_fill_ids_for_dllm()
        req._update_block_offset_for_dllm()
        req.determine_dllm_phase()
        if separate:
            if req.is_dllm_prefill():  # context pass: EXTEND over prefix..block_offset
                req.prefix_len = req.dllm_block_offset
                continue
            start, n_prompt = req.dllm_block_offset, 0
        else:
            chunk = req.full_untruncated_fill_ids[req.prefix_len : req.prefix_len + B]
            start = req.dllm_block_offset
            n_prompt = sum(1 for t in chunk if t != MASK)
            if n_prompt == B:  # a prompt-only chunk: run() returns no tokens (base.py:122-123)
                req.prefix_len += B
                continue
        new = [200 + len(req.output_ids) + k for k in range(B - n_prompt)]
        canvases.append((start, n_prompt, len(new)))
        req.output_ids.extend(new)
        req.prefix_len = start if separate else req.prefix_len + B
        if len(canvases) == rounds:
            return canvases


def check_placement():
    for L in (16, 19, 5):
        for separate in (False, True):
            c = placement(L, separate)
            kind = "separate-context (Gemma4Renoise-style)" if separate else "LowConfidence/JointThreshold"
            print(f"L={L:2d} B={B} {kind:40s} canvases (start, prompt slots, new slots): {c}")
    assert placement(19, False)[0] == (16, 3, 5)  # aligned: prompt tail shares the first block
    assert placement(19, True)[0] == (19, 0, B)  # right after the prompt
    assert placement(16, False)[0] == (16, 0, B)


if __name__ == "__main__":
    print("algorithm table:", sorted(algo_name_to_cls))
    check_low_confidence()
    check_placement()
    print("OK")
