"""Self-spec on a live vLLM whose model runner cannot host our drafting rows (the CPU build): vLLM decodes and
verifies with the checkpoint's causal model, and this proposer drafts with its draft adapter.

vLLM builds the class named by `--speculative-config '{"method": "custom_class", "model":
"inference.vllm_backend.proposer.SelfSpecProposer", "num_speculative_tokens": K}'` in its worker with its
config, and after every step calls `propose` with each batch row's tokens; the drafts it returns are verified
by vLLM's own forward and rejection sampler, so the answer is vLLM's causal model's (greedy: token for token).
The proposer runs our decode runner (`bdcore.decode.runner`) on its own copy of the checkpoint, served as the
native engine serves it (`bdcore.loading`: the adapter cut and its served path), with its own KV caches: one
forward a step over every drafting row's new tokens and a seeded canvas ([the last token, `<|mask|>` x K], as
the split step of an engine without mixed forwards drafts: `Layout.seeded`), whose rows draft the K tokens
after the last. It cannot share vLLM's forward or KV, so a step costs vLLM's verify plus our drafting forward:
what it buys is the engine, not speed (docs/serving.md).

A batch row's cache is matched to the row's tokens at every call (the longest common prefix stays cached, the
rest is dropped), so a request that vLLM moved to another row, or a new one in a finished one's row, is
drafted correctly, at the price of a prefill of its context. Stdlib and bdcore only at import: vLLM's objects
are read by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.config import DecodeConfig
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import SequenceCache


@dataclass
class _RowState:
    """One batch row's drafting cache and the tokens it holds (positions 0..len-1)."""

    cache: SequenceCache = field(default_factory=SequenceCache)
    tokens: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SelfSpecDrafter:
    """Drafts of `k` tokens per row from a runner over a self-spec checkpoint (greedy: the drafting rows'
    argmax, `<|mask|>` banned by the runner; `fill`: what the canvas's undecided slots hold). vLLM-free:
    `SelfSpecProposer` adapts it to vLLM's call."""

    def __init__(self, runner: ModelRunner, fill: CanvasFill, k: int):
        if k < 1:
            raise ValueError(f"num_speculative_tokens {k}: self-spec drafts at least one token")
        self.runner, self.fill, self.k = runner, fill, k
        self.rows: dict[int, _RowState] = {}

    def draft(self, contexts: dict[int, list[int]]) -> dict[int, list[int]]:
        """The drafts after each batch row's context (every token so far, the last one included)."""
        batch, order = [], []
        for row, tokens in contexts.items():
            state = self.rows.setdefault(row, _RowState())
            kept = common_prefix(state.tokens, tokens[:-1])
            if kept:
                state.cache.crop(kept)
            else:
                state.cache = SequenceCache()  # a new request in this row (or the same moved): from its prompt
            new, last, at = tokens[kept:-1], tokens[-1], len(tokens) - 1
            rows = Rows()
            if new:
                rows.clean(new, kept)
            rows.canvas([last] + self.fill(self.k), at)  # seeded: canvas row j drafts position at + 1 + j
            state.tokens = tokens[:-1]
            batch.append((state.cache, Forward(rows, len(new))))
            order.append((row, len(new)))
        logits = self.runner.forward(batch) if batch else []
        return {row: lg[n : n + self.k].argmax(-1).tolist() for (row, n), lg in zip(order, logits)}

    def forget(self, live: set[int]) -> None:
        """Drop the caches of batch rows no longer in use."""
        for row in [r for r in self.rows if r not in live]:
            del self.rows[row]


class SelfSpecProposer:
    """vLLM's custom speculative proposer (`custom_class`): our drafts for vLLM's verify."""

    def __init__(self, vllm_config):
        from bdcore.loading import DTYPES, load_checkpoint
        from bdcore.serving_gate import resolve

        model_config, k = vllm_config.model_config, vllm_config.speculative_config.num_speculative_tokens
        if k < 1:  # before the checkpoint loads (the gate would name our draft_len, k + 1)
            raise ValueError(f"num_speculative_tokens {k}: self-spec drafts at least one token")
        dtype = next((name for name, d in DTYPES.items() if d == model_config.dtype), None)
        if dtype is None:
            raise ValueError(f"self-spec drafts in bf16, fp16 or fp32; vLLM runs {model_config.dtype}")
        loaded = load_checkpoint(model_config.model, device="cpu", dtype=dtype)
        caps = loaded.capabilities
        resolve(caps, DecodeConfig(mode="self-spec", draft_len=k + 1), "native")  # what the checkpoint can serve
        runner = ModelRunner.for_checkpoint(loaded.model, caps)
        runner.serving_only = True
        self.drafter = SelfSpecDrafter(runner, CanvasFill.for_checkpoint(caps), k)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner hands a drafter its target model; ours drafts on its own copy."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs) -> list[list[int]]:
        """Per batch row, the drafts after its tokens (`token_ids_cpu[i, :num_tokens_no_spec[i]]`, the step's
        sampled tokens included); none for a row that sampled nothing this step (a prefill still in chunks)."""
        contexts = {
            i: token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist()
            for i, sampled in enumerate(sampled_token_ids)
            if len(sampled)
        }
        drafts = self.drafter.draft(contexts)
        self.drafter.forget(set(range(len(sampled_token_ids))))
        return [drafts.get(i, []) for i in range(len(sampled_token_ids))]
