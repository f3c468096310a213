"""One request being decoded: what it asked for, where its tokens go, and its cache.

A `Sequence` is the whole state of a request between forwards (as nano-vllm's): the decoder of its
mode keeps its canvas and counters in plain fields, the runner keeps its keys/values (and gated-delta
states) in `cache`, and emitted tokens go to `out`, which decides when the answer is finished.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.gated_delta_layers import DecodePlan, LayerState, restore, roll_back
from bdcore.decode.rules import first_stop
from bdcore.decode.sampling import SamplingParams, pick

if TYPE_CHECKING:
    from bdcore.capabilities import Capabilities


@dataclass
class DecodeStats:
    """Tokens per forward counts every forward that produced the output, the prefill included, and every
    token the model produced for the answer, its stop token included."""

    generated: int = 0
    forwards: int = 0
    accepted: Counter = field(default_factory=Counter)  # self-spec: drafts accepted per step (cold: 0)
    drafted: Counter = field(default_factory=Counter)  # self-spec: forwards by tokens they drafted (0: causal)
    tree_verifies: int = 0  # self-spec: verify steps that checked a draft tree
    off_spine: int = 0  # of those, the ones whose accepted path took a side candidate (a cold step follows)

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.forwards if self.forwards else 0.0

    @property
    def verify_steps(self) -> int:
        """Self-spec's draft-verify cycles: the forwards that verified drafts, and the cold ones that drafted
        after a plain AR token (0 drafts accepted)."""
        return sum(self.accepted.values())

    @property
    def accepted_drafts(self) -> int:
        return sum(k * n for k, n in self.accepted.items())

    @property
    def acceptance_length(self) -> float:
        """The field's acceptance length (EAGLE's tau, SGLang's accept length): tokens committed per draft-verify
        cycle, the verifier's own token included, so 1.0 means no draft ever accepted; 0.0 without cycles."""
        steps = self.verify_steps
        return 1 + self.accepted_drafts / steps if steps else 0.0

    def to_dict(self) -> dict:
        return {
            "generated_tokens": self.generated,
            "forwards": self.forwards,
            "tokens_per_forward": self.tokens_per_forward,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted.items())},
            "draft_len_histogram": {str(k): v for k, v in sorted(self.drafted.items())},
            "verify_steps": self.verify_steps,
            "acceptance_length": self.acceptance_length,
            "tree_verifies": self.tree_verifies,
            "off_spine": self.off_spine,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """An answer token's log-probability in the row that produced it (temperature 1, `<|mask|>` banned) and
    the `top` most likely tokens of that row, as (token, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenSink(Protocol):
    """Where a sequence's emitted tokens go (the engine's text output, or any other consumer)."""

    stats: DecodeStats

    def push(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """Take tokens the model produced (and, when asked for, their log-probabilities); True once the
        answer is finished (stop token, length, ...)."""
        ...


class AnswerTokens:
    """The answer's tokens: a stop token (end-of-turn, eos, filler) ends it and counts as generated but is
    not part of it; so does reaching `max_tokens`. One definition for the server's text output and the
    trainer's rollouts, so both stop where the other does."""

    def __init__(self, stop_ids: frozenset[int], max_tokens: int, stats: DecodeStats):
        self.stop_ids, self.max_tokens, self.stats = stop_ids, max_tokens, stats
        self.tokens: list[int] = []
        self.stop_token: int | None = None  # the stop token that ended the answer
        self.finish: str | None = None  # "stop" | "length"
        self.logprobs: list[TokenLogprob] = []  # one per answer token, when the decoder scores them
        self.stop_logprob: TokenLogprob | None = None  # the stop token's (a rollout's trajectory scores it)

    def push(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        stop = first_stop(new, self.stop_ids)
        room = self.max_tokens - len(self.tokens)
        if stop is not None and stop < room:
            self.stats.generated += stop + 1
            kept = stop
            self.stop_token, self.finish = new[stop], "stop"
        elif len(new) >= room:
            self.stats.generated += room
            kept = room
            self.finish = "length"
        else:
            self.stats.generated += len(new)
            kept = len(new)
        self.tokens += new[:kept]
        if logprobs is not None:
            self.logprobs += logprobs[:kept]
            if self.finish == "stop":  # this push stopped the answer (none follows a finished one)
                self.stop_logprob = logprobs[kept]
        return self.finish is not None


def room_for(total: int) -> int:
    """Tokens of room for a cache that must hold `total`: a quarter (at least 64 tokens) more, so growing is
    one copy amortised over the steps that follow, and at most a quarter more memory than the cache (doubling
    would hold twice a long context's KV on a GPU)."""
    return total + max(total // 4, 64)


@dataclass
class SequenceCache:
    """A sequence's committed keys/values per attention layer and its gated-delta layers' states."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per attention layer [kv_heads, L, d]
    values: list[torch.Tensor] = field(default_factory=list)
    states: dict[int, LayerState] = field(default_factory=dict)  # gated-delta layer -> committed state
    plan: DecodePlan | None = None  # the last forward's plan (hybrids), for a rollback
    plan_base: int = 0  # cached length when that forward started
    # Buffers with room past the cached tokens, keys' then values' ([kv_heads, room, d] per attention layer),
    # of which `keys`/`values` are the first `length` tokens: a forward writes its new rows into them in place
    # (`reserve`). Appending by concatenation copied every cached token at every step, for every sequence:
    # at 8 requests in flight that was a third of a small model's decode step on a CPU.
    room: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def reserve(self, total: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Buffers (keys', values') with room for `total` tokens, whose first `length` are the cached ones;
        `keys`/`values` are kept as views of them. A cache without room moves into new buffers of
        `room_for(total)` tokens. Needs a cache with keys."""
        half = len(self.keys)
        if not self.in_room() or self.room[0].shape[1] < total:
            n, cached = self.length, (*self.keys, *self.values)
            room = room_for(total)
            self.room = [t.new_empty(t.shape[0], room, t.shape[2]) for t in cached]
            for buffer, t in zip(self.room, cached):
                buffer[:, :n] = t
            self.keep(n)
        return self.room[:half], self.room[half:]

    def keep(self, length: int) -> None:
        """The first `length` tokens of the buffers `reserve` gave are the cache (new rows written in place)."""
        half = len(self.room) // 2
        self.keys = [b[:, :length] for b in self.room[:half]]
        self.values = [b[:, :length] for b in self.room[half:]]

    def in_room(self) -> bool:
        """`keys`/`values` are still views of `room` (a runner may hand a cache tensors of its own; every
        change to a cache changes all its layers alike, so the first layer's keys and values tell)."""
        if not self.room or not self.keys or len(self.room) != 2 * len(self.keys):
            return False
        pairs = ((self.keys[0], self.room[0]), (self.values[0], self.room[len(self.keys)]))
        return all(t.data_ptr() == b.data_ptr() and t.stride() == b.stride() for t, b in pairs)

    def crop(self, length: int) -> None:
        """Drop cached tokens past `length` (self-spec rollback of rejected drafts). Gated-delta layers
        restore the state snapshotted after exactly that many tokens in the last forward."""
        if length >= self.length:
            return
        if self.plan is not None:
            roll_back(self.plan, self.plan_base, length, self.states)
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]

    def keep_path(self, base: int, rows: list[int]) -> None:
        """After a draft tree's verify (which started at cached length `base` and cached every tree row): keep
        the tokens before `base` and the forward's rows `rows` (the accepted path, root first), dropping the
        other branches' keys/values. Gated-delta layers restore the state after the path's last row."""
        if rows == list(range(len(rows))):  # along the argmax chain: a prefix of the rows, as a linear crop
            if self.plan is not None:
                restore(self.plan, len(rows), self.states)
            self.keys = [k[:, : base + len(rows)] for k in self.keys]
            self.values = [v[:, : base + len(rows)] for v in self.values]
            return
        if self.plan is not None:
            restore(self.plan, rows[-1] + 1, self.states)
        # The path's rows move down over the dropped branches' in place (gathered first): copying the whole cache
        # instead would cost more than the step on a long context.
        end = base + len(rows)
        index = torch.tensor([base + r for r in rows], device=self.keys[0].device)
        with torch.inference_mode(self.keys[0].is_inference()):  # the engine's caches are inference tensors
            for t in (*self.keys, *self.values):
                t[:, base:end] = t.index_select(1, index)
        self.keys = [k[:, :end] for k in self.keys]
        self.values = [v[:, :end] for v in self.values]


class EngineOwnedCache:
    """A sequence's cache where the serving engine owns the keys/values (vLLM, SGLang): the decoder only says
    how long the cache is and where to crop it, and the engine's adapter applies that to its own KV."""

    def __init__(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep_path(self, base: int, rows: list[int]) -> None:
        """A draft tree's kept path; the engines that own their KV serve linear verifies only (serving gate)."""
        if rows != list(range(len(rows))):
            raise ValueError("an engine-owned cache keeps a prefix of a forward's rows; draft trees are native-only")
        self.crop(base + len(rows))


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    out: TokenSink
    mask_id: int | None  # banned from every pick
    stop_ids: frozenset[int]
    block_causal: bool = False  # the checkpoint's clean stream is block-causal (clean_causal off)
    shift: bool = True  # False: an unshifted (single-stream) checkpoint, whose canvas row j predicts slot j
    cache: SequenceCache | EngineOwnedCache = field(default_factory=SequenceCache)
    canvas_fill: CanvasFill | None = None  # what self-spec's drafting slots hold (None: <|mask|>)

    @classmethod
    def for_checkpoint(cls, caps: Capabilities, prompt_ids, params, generator, out) -> Sequence:
        """A request on a checkpoint with capabilities `caps`: its mask ban, stop tokens and clean-stream attention."""
        return cls(
            list(prompt_ids),
            params,
            generator,
            out,
            caps.mask_id,
            caps.stop_ids,
            block_causal=not caps.clean_causal,
            shift=caps.shift,
            canvas_fill=CanvasFill.for_checkpoint(caps, seed=generator.initial_seed() if generator is not None else 0),
        )

    def fill(self, n: int) -> list[int]:
        """The ids of n drafting slots: the checkpoint's fill (`bdcore.decode.canvas_fill`)."""
        return self.canvas_fill(n) if self.canvas_fill is not None else [self.mask_id] * n

    @property
    def stats(self) -> DecodeStats:
        return self.out.stats

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their sampling distributions for rows of logits."""
        return pick(logits, self.params, self.mask_id, self.generator)

    def token(self, logits: torch.Tensor) -> int:
        return int(self.pick(logits)[0][0])

    def score(self, rows_logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """Each token's log-probability in its row of logits (row i scores tokens[i]; temperature 1, the
        runner has banned `<|mask|>`) with the row's top alternatives; None unless the request asked."""
        k = self.params.logprobs
        if k is None:
            return None
        logp = rows_logits.float().log_softmax(-1)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        return [
            TokenLogprob(t, float(logp[i, t]), tuple(zip(top_i[i].tolist(), top_v[i].tolist())))
            for i, t in enumerate(tokens)
        ]
