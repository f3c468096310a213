"""Sampling parameters and the logits -> probabilities -> token path shared by every decode mode."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    # Report each answer token's log-probability and this many alternatives (None: off); what the number
    # means per mode is in inference/MODEL_CONTRACT.md ("Log-probabilities").
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must lie in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0 (None: off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams, banned: int | None) -> torch.Tensor:
    """Next-token distribution per row after banning `<|mask|>`, temperature, top-k and top-p.

    Greedy decoding gets the one-hot of the argmax, so acceptance rules treat both cases alike.
    """
    logits = logits.float().clone()
    if banned is not None:
        logits[..., banned] = float("-inf")
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def ban(logits: torch.Tensor, banned: int | None) -> torch.Tensor:
    """Logits as an fp32 copy with `banned` (`<|mask|>`) at -inf: what the native runner hands the decoders,
    and what the SGLang and vLLM adapters make of their engines' logits, so that a greedy commit's confidence
    (the plain softmax) is the same everywhere."""
    logits = logits.to(torch.float32, copy=True)
    if banned is not None:
        logits[..., banned] = float("-inf")
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from `probs` [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat.cpu(), 1, generator=generator).squeeze(-1)
    return tokens.reshape(probs.shape[:-1]).to(probs.device)


def pick(
    logits: torch.Tensor, params: SamplingParams, banned: int | None, generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens and their distributions for rows of logits: one draw per row, or when greedy the argmax and
    no distribution (None): greedy acceptance compares tokens, and building the one-hot rows of
    `probabilities` cost more than the argmax itself (~9 ms for a 15-row self-spec step over a 49k vocabulary
    on a 2-core CPU, a sixth of the forward)."""
    if params.greedy:
        return greedy_tokens(logits, banned), None
    probs = probabilities(logits, params, banned)
    return draw(probs, generator), probs


def greedy_tokens(logits: torch.Tensor, banned: int | None) -> torch.Tensor:
    """The argmax per row, never `banned` (the argmax of `probabilities`' one-hot, without building it)."""
    tokens = logits.argmax(-1)
    if banned is not None and bool((tokens == banned).any()):  # rare: the engine's runner has banned it already
        logits = logits.float().clone()
        logits[..., banned] = float("-inf")
        tokens = logits.argmax(-1)
    return tokens
