"""CUDA twins of the CPU-tested paths: what runs only on a GPU must equal what the CPU tests pin.

Skipped without CUDA (CPU CI runs the CPU twins). On CUDA the trainer builds its model with flex
attention where the architecture supports it (`train.model.attention_backend`: Qwen3 and Llama yes,
Qwen3.5 hybrids no, they keep SDPA with the dense mask), and `TwoStreamLM.attention_mask` hands flex
the rule as a block-sparse `BlockMask`; the engine always runs SDPA with the dense boolean rule
(`bdcore/loading.py`, `bdcore/decode/runner.py`); the gated-delta op runs its PyTorch path on the
GPU. Each test runs those CUDA paths on the tiny models of `tests/tiny.py` and holds them to the CPU
twin (fp32, TF32 off, so only summation order differs) or, in bf16, to a finite loss near the fp32
one. The helpers come from the CPU tests, so both twins check the same thing.
"""

import math
import random

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from tests.conftest import read_metrics, run_train
from tests.test_gated_delta import CASES as GATED_DELTA_CASES
from tests.test_gated_delta import _batch as gated_delta_batch
from tests.test_gated_delta import _inputs as gated_delta_inputs
from tests.test_invariant_2_noised_blocks import single_stream_reference
from tests.test_invariant_3_engine_denoise import check_engine_canvas_logits
from tests.test_invariant_4_self_spec import (
    _prompts,
    check_greedy_self_spec_equals_causal,
    check_state_after_k_accepted,
)
from tests.tiny import (
    FILLER_ID,
    MASK_ID,
    random_sample,
    tiny_checkpoint,
    tiny_config,
    tiny_hybrid_config,
    tiny_hybrid_model,
    tiny_model,
)
from tests.train_args import train_args
from train.config import BlockDiffusionConfig
from train.hybrid import build_layout
from train.model import TwoStreamLM, attention_backend
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch
from train.two_stream_gated_delta import two_stream_gated_delta

DEVICE = "cuda"
IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)
# fp32 on two devices: same math, other kernels and summation order.
TOL = dict(atol=1e-4, rtol=1e-4)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA twins need a CUDA device; without one the CPU twins (tests/test_invariant_*.py, "
    "tests/test_gated_delta.py) cover these paths",
)


@pytest.fixture(autouse=True)
def _no_tf32():
    """TF32 rounds fp32 matmuls and convolutions to 10-bit mantissas; the twins compare at fp32 tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _make(arch: str, attn: str = "sdpa"):
    return tiny_hybrid_model(attn=attn) if arch == "qwen3_5" else tiny_model(arch, attn=attn)


def _cuda_attn(arch: str) -> str:
    """The attention backend the trainer picks for this architecture on CUDA."""
    return attention_backend(tiny_hybrid_config() if arch == "qwen3_5" else tiny_config(arch), cuda=True)


def test_trainer_picks_flex_attention_on_cuda_where_supported():
    assert _cuda_attn("qwen3") == _cuda_attn("llama") == "flex_attention"
    assert _cuda_attn("qwen3_5") == "sdpa"  # transformers has no flex attention for Qwen3.5


def _packed_batch(cfg: BlockDiffusionConfig, seed: int = 3):
    rng = random.Random(seed)
    rows = [[random_sample(rng, turns=2, max_prompt=20, max_resp=24) for _ in range(3)] for _ in range(2)]
    return rows, build_batch(rows, cfg, IDS, noise_generator(seed, 0, 0))


@pytest.mark.parametrize(
    "arch,clean_causal,wbc",
    [("qwen3", True, False), ("qwen3", True, True), ("llama", False, True), ("qwen3_5", True, False)],
)
def test_cuda_training_forward_and_backward_equal_cpu(arch, clean_causal, wbc):
    """The trainer's CUDA path (flex attention + BlockMask; dense-mask SDPA for hybrids, whose gated-delta
    op runs on the GPU too) == the CPU path (SDPA + dense mask): logits at every real row, the loss,
    and every parameter's gradient."""
    cfg = BlockDiffusionConfig(
        bd_size=4, ar_loss_weight=0.3 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    _, batch = _packed_batch(cfg)
    ref_model, gpu_model = _make(arch), _make(arch, _cuda_attn(arch)).to(DEVICE)
    ref = TwoStreamLM(ref_model, cfg, cpu_block_sparse=False)
    gpu = TwoStreamLM(gpu_model, cfg)
    gpu_batch = batch.to(DEVICE)
    mask = gpu.attention_mask(gpu_batch)
    if arch == "qwen3_5":
        assert mask.dtype == torch.bool and mask.device.type == DEVICE
    else:
        assert isinstance(mask, BlockMask), "the CUDA twin must run the BlockMask path"
    real = batch.meta.stream >= 0
    with torch.no_grad():
        want = ref.logits(batch)[real]
        got = gpu.logits(gpu_batch)[real.to(DEVICE)]
    torch.testing.assert_close(got.cpu(), want, **TOL)

    ref_loss, gpu_loss = ref(batch).loss, gpu(gpu_batch).loss
    torch.testing.assert_close(gpu_loss.detach().cpu(), ref_loss.detach(), **TOL)
    ref_loss.backward()
    gpu_loss.backward()
    for (name, a), b in zip(ref_model.named_parameters(), gpu_model.parameters()):
        assert b.grad is not None and a.grad is not None, name
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("arch,clean_causal,wbc", [("qwen3", True, False), ("llama", False, True)])
def test_flex_rows_equal_single_stream_forwards_on_cuda(arch, clean_causal, wbc):
    """Invariants 1 and 2 on the CUDA path: the flex two-stream forward's clean rows == a plain forward
    of the document (clean_causal), and its noised block rows == [clean prefix, noised block]."""
    cfg = BlockDiffusionConfig(
        bd_size=4, ar_loss_weight=0.3 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    rows, batch = _packed_batch(cfg, seed=5)
    base, flex_model = _make(arch).to(DEVICE), _make(arch, "flex_attention").to(DEVICE)
    batch = batch.to(DEVICE)
    m = batch.meta
    checked = 0
    with torch.no_grad():
        logits = TwoStreamLM(flex_model, cfg).logits(batch)
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                if clean_causal:
                    sel = (m.doc[r] == d) & (m.stream[r] == 0)
                    plain = base(input_ids=torch.tensor([list(sample.input_ids)], device=DEVICE)).logits[0]
                    torch.testing.assert_close(logits[r, sel], plain, **TOL)
                for view in range(1, cfg.views + 1):
                    sel = (m.doc[r] == d) & (m.stream[r] == view)
                    for blk in m.blk[r, sel].unique().tolist():
                        rows_b = (sel & (m.blk[r] == blk)).nonzero().flatten()
                        start = int(m.bstart[r, rows_b[0]])
                        block_ids = batch.input_ids[r, rows_b].tolist()
                        want = single_stream_reference(base, sample, start, block_ids, 4, clean_causal, wbc)
                        torch.testing.assert_close(logits[r, rows_b], want, **TOL)
                        checked += 1
    assert checked >= 2 * 3 * 2


@pytest.mark.parametrize("bd,views,cc,wbc,turns,pack,chunk", GATED_DELTA_CASES)
def test_two_stream_gated_delta_on_cuda_equals_cpu(bd, views, cc, wbc, turns, pack, chunk):
    """The chunked two-stream gated delta on the GPU == on the CPU (where the recurrence pins it):
    outputs and the gradients of all five inputs."""
    cfg = BlockDiffusionConfig(
        bd_size=bd, views=views, ar_loss_weight=0.2 if cc else 0.0, clean_causal=cc, within_block_causal=wbc
    )
    batch = gated_delta_batch(bd * 7 + turns, cfg, turns, pack)
    layout = build_layout(batch.meta, cfg, conv_width=4, chunk=chunk)
    N = batch.input_ids.numel()
    cpu_in = gated_delta_inputs(N)
    gpu_in = [x.detach().to(DEVICE).requires_grad_() for x in gated_delta_inputs(N)]
    want = two_stream_gated_delta(*cpu_in, layout)
    got = two_stream_gated_delta(*gpu_in, layout.to(DEVICE))
    assert got.device.type == DEVICE
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * probe).sum().backward()
    (got * probe.to(DEVICE)).sum().backward()
    for a, b in zip(cpu_in, gpu_in):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    "arch,clean_causal,wbc",
    [("qwen3", True, False), ("llama", True, True), ("qwen3", False, False), ("qwen3_5", True, False)],
)
def test_engine_on_cuda_denoise_logits_equal_flex_training_logits(arch, clean_causal, wbc):
    """Invariant 3 across the two CUDA paths: the engine (SDPA, dense rule, KV cache) == the trainer's
    forward (flex attention and BlockMask where supported), both on the GPU."""
    check_engine_canvas_logits(arch, clean_causal, wbc, device=DEVICE, train_attn=_cuda_attn(arch), **TOL)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def checkpoint_dir(request, tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp(f"cuda_{request.param}"), arch=request.param, bd_size=4)


def test_engine_on_cuda_greedy_self_spec_equals_causal_and_cpu(checkpoint_dir):
    """Invariant 4 on the GPU (fp32), and every greedy mode decodes the same tokens as on the CPU."""
    gpu = load_checkpoint(checkpoint_dir, device=DEVICE, dtype="fp32")
    assert next(gpu.model.parameters()).device.type == DEVICE
    check_greedy_self_spec_equals_causal(gpu, draft_len=4)
    check_state_after_k_accepted(gpu, **TOL)
    cpu = load_checkpoint(checkpoint_dir, device="cpu", dtype="fp32")
    params = SamplingParams(max_tokens=20)
    for mode in ("causal", "diffusion", "self-spec"):
        on_gpu, on_cpu = Engine(gpu, DecodeConfig(mode=mode)), Engine(cpu, DecodeConfig(mode=mode))
        for ids in _prompts(cpu.tokenizer, 4, seed=1):
            a, b = on_gpu.generate(ids, params), on_cpu.generate(ids, params)
            assert a.tokens == b.tokens, mode
            assert a.stats.forwards == b.stats.forwards, mode


def test_engine_on_cuda_bf16_decodes_every_mode(checkpoint_dir):
    """The serving default on a GPU (dtype auto = bf16) runs every mode; sampled decoding too."""
    loaded = load_checkpoint(checkpoint_dir, device=DEVICE)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    for mode in ("causal", "diffusion", "self-spec"):
        engine = Engine(loaded, DecodeConfig(mode=mode))
        for ids in _prompts(loaded.tokenizer, 3, seed=2):
            for params in (SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=0.8, seed=0)):
                out = engine.generate(ids, params)
                assert out.stats.generated >= 1 and loaded.mask_id not in out.tokens, mode
                assert out.finish_reason in ("stop", "length")
                if mode == "causal":
                    assert out.stats.tokens_per_forward == 1.0
                else:  # every verify step emits a token; a diffusion block of B takes at most B - 1 forwards
                    assert out.stats.tokens_per_forward >= 1.0, mode


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_bf16_two_stream_training_step_on_cuda(arch):
    """One optimizer step of the CUDA training path in bf16 (its attention backend, chunked CE):
    finite loss near the fp32 CPU loss, finite gradients, parameters move."""
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.3)
    _, batch = _packed_batch(cfg, seed=7)
    with torch.no_grad():
        ref_loss = float(TwoStreamLM(_make(arch), cfg, cpu_block_sparse=False)(batch).loss)
    model = _make(arch, _cuda_attn(arch)).to(DEVICE, torch.bfloat16).train()
    lm = TwoStreamLM(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = lm(batch.to(DEVICE)).loss
    value = loss.item()
    assert math.isfinite(value)
    assert abs(value - ref_loss) < 0.05 * ref_loss, (value, ref_loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    opt.step()
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kit", ["demo_kit", "hybrid_kit"])
def test_trainer_bf16_on_one_gpu_trains_and_saves(kit, request, tmp_path):
    """train.py as users run it on one GPU: nccl group, FSDP2 with bf16 compute, the CUDA attention
    backend (flex attention; SDPA for the hybrid); the loss is finite and the checkpoint serves on the GPU."""
    demo_kit = request.getfixturevalue(kit)
    run = tmp_path / "run"
    run_train(train_args(demo_kit, run, pack=True, dtype="bf16", lr="1e-3", max_steps=2, log_every=1))
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2]
    for rec in metrics.values():
        assert math.isfinite(rec["loss"]) and rec["loss"] > 0 and rec["diff_tokens"] > 0
    loaded = load_checkpoint(run / "final", device=DEVICE)
    ids = _prompts(loaded.tokenizer, 1)[0]
    out = Engine(loaded, DecodeConfig(mode="self-spec")).generate(ids, SamplingParams(max_tokens=8))
    assert out.stats.generated >= 1 and out.finish_reason in ("stop", "length")
