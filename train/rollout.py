"""Student rollouts for on-policy training: the serving engine's decoding, recorded.

Each prompt is decoded by the same decoders (`bdcore.decode.modes`), runner and decode loop
(`bdcore.decode.driver`) as `serve.py --mode diffusion` (or causal, or self-spec), batched, KV-cached,
under no-grad, with the model in eval mode, on the student's capabilities (`student_capabilities`).
In diffusion mode every forward's commits are recorded as `CommitStep`s (the canvas the forward saw,
which slots it committed, with what log-probability), so a training forward can later revisit the exact
states the student visited. Causal and self-spec answers are distributed as the AR head's own (self-spec
is lossless), so each of their tokens is recorded as committed from the AR row before it, with the AR
log-probability the decoder scored it with: the same trajectory function then gives the AR log-prob.
A self-spec rollout also records each verify of its drafts (`DraftVerdict`: where the drafting canvas sat,
what it drafted, how many the AR head accepted), the states on-policy draft training revisits.

Several ranks (FSDP2): every forward all-gathers parameters, so every rank must run the same number of
forwards. Rollouts therefore run in lockstep: after each forward the ranks agree whether any of them
still decodes, and a rank whose rollouts are done runs a one-row stand-in forward until all are. This
keeps the sharded model as it is (no unsharding of a model that may not fit one device), at the cost of
idle forwards on the ranks that finish first.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.config import DecodeConfig
from bdcore.decode.driver import DecodeDriver, DecodeLoop
from bdcore.decode.modes import CommitStep, DiffusionDecoder, DraftVerdict, SelfSpecDecoder, make_decoder
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import AnswerTokens, DecodeStats, Sequence, SequenceCache
from bdcore.serving_gate import resolve


@dataclass
class Rollout:
    prompt_ids: list[int]
    tokens: list[int]  # the answer, without its stop token
    stop_token: int | None  # the token that ended it (None: cut at max_tokens)
    steps: list[CommitStep] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    verdicts: list[DraftVerdict] = field(default_factory=list)  # self-spec: every chain verify, in order

    @property
    def response(self) -> list[int]:
        """The answer as a training row holds it: with its stop token."""
        return self.tokens + ([self.stop_token] if self.stop_token is not None else [])


def _ar_steps(prompt_len: int, answer: AnswerTokens) -> list[CommitStep]:
    """Each answer token (and the stop token) of a causal or self-spec answer as committed from the AR row
    before it, with the AR log-probability the decoder scored it with."""
    scored = answer.logprobs + ([answer.stop_logprob] if answer.stop_token is not None else [])
    return [CommitStep(prompt_len + i, None, [0], [x.token], [x.logprob]) for i, x in enumerate(scored)]


def any_rank_active(active: bool) -> bool:
    """True while some rank still decodes (one all-reduce; a single process answers for itself)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return active
    flag = torch.tensor([1 if active else 0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def collective_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


@torch.no_grad()
def rollout(
    model,
    prompts: list[list[int]],
    *,
    caps: Capabilities,
    decode: DecodeConfig,
    params: SamplingParams,
    seed: int = 0,
    sync: Callable[[bool], bool] = any_rank_active,
) -> list[Rollout]:
    """Decode every prompt with the model (`decode.mode`) as a checkpoint with capabilities `caps` (its
    block, mask and stop tokens, attention) and record its commits; one batched forward per step over the
    prompts still decoding. Sampling seeds are `seed + index`."""
    ar_mode = decode.mode != "diffusion"
    if ar_mode:  # the decoder scores each emitted token with the AR head (what `logprobs` serves)
        params = dataclasses.replace(params, logprobs=0)
    was_training = model.training
    model.eval()
    try:
        runner = ModelRunner.for_checkpoint(model, caps)
        loop = DecodeLoop(DecodeDriver(runner))
        resolved = resolve(caps, decode, "native")  # the native engine's decoders, as the server runs them
        decoders, sinks = [], []
        for i, prompt in enumerate(prompts):
            sink = AnswerTokens(caps.stop_ids, params.max_tokens, DecodeStats())
            gen = torch.Generator().manual_seed(seed + i)
            decoder = make_decoder(resolved, Sequence.for_checkpoint(caps, prompt, params, gen, sink))
            if not ar_mode:
                assert isinstance(decoder, DiffusionDecoder)
                decoder.trace = []
            elif isinstance(decoder, SelfSpecDecoder):
                decoder.trace = []
            loop.admit(decoder, decoder)
            decoders.append(decoder)
            sinks.append(sink)
        stand_in = SequenceCache()
        while sync(busy := any(not d.finished for _, d in loop.active)):
            if busy:
                loop.step()
            else:  # lockstep: this rank is done, others are not
                runner.forward([(stand_in, Forward(Rows().clean([caps.mask_id], 0), 0))])
        return [
            Rollout(
                list(p),
                s.tokens,
                s.stop_token,
                _ar_steps(len(p), s) if ar_mode else d.trace,
                s.stats,
                d.trace if isinstance(d, SelfSpecDecoder) else [],
            )
            for p, s, d in zip(prompts, sinks, decoders)
        ]
    finally:
        model.train(was_training)


@contextlib.contextmanager
def decoding(lm):
    """The trainer's student (`TwoStreamLM`, possibly FSDP-sharded) as the server runs it, for the body of
    the block: the HF model with plain SDPA and the decode masks (the trainer may have switched it to its
    block-sparse or flex attention), gated-delta layers in decode form, and the FSDP root's parameters
    (embeddings, final norm, head) gathered, in a one-rank run every layer's too (`_layers_to_hold`).
    Rollouts and the drafting metric both decode through it."""
    from bdcore.gated_delta import is_hybrid
    from train.hybrid import patch_gated_delta_layers

    model = lm.model
    impl = model.config._attn_implementation
    fsdp_root = hasattr(lm, "unshard")
    model.config._attn_implementation = "sdpa"
    held = _layers_to_hold(lm) if fsdp_root else []
    if fsdp_root:
        # FSDP2 names its root at the first forward; a decode calls the decoder layers before the root
        # ever runs, so name the root first (a no-op once a training forward has run).
        lm._get_fsdp_state()._lazy_init()
        lm.unshard()
    for layer in held:
        layer.set_reshard_after_forward(False, recurse=False)
        layer.unshard()
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
        model.config._attn_implementation = impl
        if is_hybrid(model.config):  # back to the two-stream forward the training rows need
            patch_gated_delta_layers(model)
        for layer in held:  # back to fsdp_shard's setting (train/parallel.py)
            layer.set_reshard_after_forward(True, recurse=False)
            layer.reshard()
        if fsdp_root:
            lm.reshard()


def _layers_to_hold(lm) -> list:
    """The FSDP-sharded layers to keep gathered for a whole decode: all of them in a one-rank run, where the
    gathered copy costs no device more than one compute-dtype copy of the model, and each forward would
    otherwise gather and cast every layer's weights again (on a CPU most of a rollout's time); none with
    several ranks, whose shards are there because the whole model may not fit one device."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return []
    return [m for m in lm.modules() if isinstance(m, FSDPModule) and m is not lm]


def student_capabilities(cfg, *, mask_id: int, stop_ids: frozenset[int]) -> Capabilities:
    """What the student (its `BlockDiffusionConfig`) decodes as: the capabilities of the checkpoint it would save
    now, built from that checkpoint's sidecar by the one constructor, with the tokenizer's stop tokens."""
    return Capabilities.from_sidecar(cfg.sidecar(mask_id), stop_ids=stop_ids)


def student_rollouts(
    lm,
    prompts: list[list[int]],
    *,
    mask_id: int,
    stop_ids: frozenset[int],
    decode: DecodeConfig,
    params: SamplingParams,
    seed: int,
) -> list[Rollout]:
    """The trainer's student decodes as the server does (`decoding`). On-policy distillation and RL both
    roll out through it."""
    caps = student_capabilities(lm.cfg, mask_id=mask_id, stop_ids=stop_ids)
    with decoding(lm) as model:
        return rollout(model, prompts, caps=caps, decode=decode, params=params, seed=seed)
