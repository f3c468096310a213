"""SGLang requests as the shared decoders see them: one `bdcore.decode.modes` decoder per request id.

SGLang keeps each request's prompt, output and KV; a dLLM algorithm sees, per forward, the requests' ids,
lengths and batched sampling settings (`forward_batch.{rids, seq_lens, sampling_info}`). A `Request` is the
decoder `make_decoder` builds for the settings `bdcore.serving_gate.resolve` fills in, over a `Sequence`
whose cache is SGLang's (`EngineOwnedCache`: the decoder says how long it is and where to crop it). The
decoder plans each forward (`plan`) and takes its logits (`take`): commits, acceptance, the step budget and
the sampler are `bdcore.decode` itself. What the decoder emits goes to a `RoundTokens` sink and back to
SGLang at the end of the round; SGLang applies max_new_tokens and its stop set to it.

SGLang tells an algorithm neither when a request ends short of a stop token (max_new_tokens, an abort) nor
the prompt itself: `RequestTable` forgets the least recently seen requests past a bound, and a decoder is
built from the prompt's length alone (`range(length)` stands for its tokens, which the decoder never sends
anywhere: SGLang's own context pass encodes the prompt).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from bdcore.decode.config import ResolvedDecode
from bdcore.decode.modes import Decoder, make_decoder
from bdcore.decode.rows import Forward
from bdcore.decode.rules import first_stop
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import DecodeStats, EngineOwnedCache, Sequence
from inference.sglang_backend.settings import DecodeSettings

# SGLang turns temperature 0 into top_k = 1; top_k = -1 or 1 << 30 means the whole vocabulary.
_GREEDY_TOP_K = 1
MAX_TRACKED_REQUESTS = 16384


def request_params(sampling_info, index: int, vocab_size: int) -> SamplingParams:
    """One request's sampling parameters from SGLang's batched `SamplingBatchInfo` (greedy when absent)."""
    if sampling_info is None:
        return SamplingParams()
    top_k = int(sampling_info.top_ks[index])
    if top_k == _GREEDY_TOP_K:
        return SamplingParams()
    temperature = float(sampling_info.temperatures.reshape(-1)[index])
    top_p = float(sampling_info.top_ps[index])
    return SamplingParams(
        temperature=temperature,
        top_k=0 if top_k <= 0 or top_k >= vocab_size else top_k,
        top_p=min(max(top_p, 1e-6), 1.0),
    )


def request_generator(rid: str) -> torch.Generator:
    """A CPU generator seeded from the request id: every tensor-parallel rank draws the same tokens."""
    return torch.Generator().manual_seed(request_seed(rid))


def request_seed(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


class RoundTokens:
    """A request's token sink: what its decoder emitted since SGLang last took the round's tokens, up to and
    including the first stop token. The answer, its length limit and its stop set are SGLang's."""

    def __init__(self, settings: DecodeSettings):
        self.stop_ids = settings.stop_ids
        self.filler_id, self.end_of_turn_id = settings.filler_id, settings.end_of_turn_id
        self.stats = DecodeStats()
        self.tokens: list[int] = []

    def push(self, tokens: list[int], logprobs=None) -> bool:
        stop = first_stop(tokens, self.stop_ids)
        kept = tokens if stop is None else tokens[: stop + 1]
        self.stats.generated += len(kept)
        self.tokens += kept
        return stop is not None

    def take(self) -> list[int]:
        """The round's tokens for SGLang. A filler ends the output like end-of-turn and is reported as
        end-of-turn, the stop token SGLang knows from the generation config."""
        out, self.tokens = self.tokens, []
        if out and out[-1] == self.filler_id:
            out[-1] = self.end_of_turn_id
        return out


class Request:
    """One request's decoder and the forward it planned. `for_context`: that forward is SGLang's next context
    pass (committed tokens, causal, kept); otherwise the algorithm runs it in the next canvas pass."""

    def __init__(self, decoder: Decoder, sink: RoundTokens):
        self.decoder, self.sink = decoder, sink
        self.planned: Forward | None = None
        self.for_context = False
        self.rounds = 0  # canvas passes seen

    @property
    def cached(self) -> int:
        """Tokens the decoder counts as committed: SGLang's KV, once its next context pass has run."""
        return self.decoder.seq.cache.length

    def plan(self, *, for_context: bool) -> Forward:
        self.planned, self.for_context = self.decoder.next_forward(), for_context
        return self.planned

    def take(self, logits: torch.Tensor) -> None:
        """The planned forward's logits [its rows, V], `<|mask|>` banned."""
        self.decoder.seq.cache.length += self.planned.keep
        self.planned, self.for_context = None, False
        self.decoder.take(logits)

    def context_end(self) -> int:
        """Where SGLang's context pass must end for its last row to be the planned forward's last."""
        return self.cached + len(self.planned.rows.tokens)


class RequestTable:
    """Request id -> `Request`, the least recently seen forgotten past `MAX_TRACKED_REQUESTS`."""

    def __init__(self, decode: ResolvedDecode, settings: DecodeSettings, start):
        self.decode, self.settings = decode, settings
        self.start = start  # plans a new request's first forward (the prompt's context pass)
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def new(self, rid: str, prompt_length: int, params: SamplingParams) -> Request:
        """A request whose prompt (of `prompt_length` tokens) SGLang's context pass has just encoded. Its
        generator is made from its id, so a request started again draws what it drew the first time."""
        s, sink = self.settings, RoundTokens(self.settings)
        generator, cache = request_generator(rid), EngineOwnedCache()
        seq = Sequence(range(prompt_length), params, generator, sink, s.mask_id, s.stop_ids, cache=cache)
        req = self._requests[rid] = Request(make_decoder(self.decode, seq), sink)
        self._requests.move_to_end(rid)
        while len(self._requests) > MAX_TRACKED_REQUESTS:
            self._requests.popitem(last=False)
        self.start(req)
        return req

    def get(self, rid: str) -> Request | None:
        req = self._requests.get(rid)
        if req is not None:
            self._requests.move_to_end(rid)
        return req

    def forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
