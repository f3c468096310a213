"""The decode step compiled: the runner's decode forwards through `torch.compile` (inductor), eager otherwise.

An eager decode step on a small model is mostly not its matmuls: on SmolLM2-135M (bf16, a 2-core AMD EPYC
with AVX2) a one-row forward took 57 ms, of which the linears were 24 ms and the rest per-op dispatch,
Python and small ops (norms, rotary, masks, reshapes) that inductor fuses; compiled, 33 ms. So the forwards
that decode (every sequence has a cache: causal steps and self-spec steps) go through the model compiled once
with dynamic shapes (`dynamic=True`: the cache length, the rows and the
batch are symbols, so a growing context does not recompile; torch specialises sizes of 1, so a batch of one
and a batch of many, one row and many, are separate graphs, compiled when first met). Prompts (a whole
prompt's rows, once a request) stay eager, as do hybrid models (their gated-delta layers run sequence by
sequence in Python). A served draft adapter drafts through its drafting twin (`DraftingTwin`: the LoRA term at
every row times a per-row gate tensor), since the served path's per-forward row plan is Python the compiler
cannot hold in one graph.

Floats are traced as constants (`specialize_float`): with `dynamic=True` dynamo otherwise traces the model's
Python floats (norm epsilons, attention scaling) as symbols, which a later inductor pass turns back into
constants by restarting the whole trace; on SmolLM2-135M that restart and the AOTAutograd cache miss it brought
made a start 486 s cold and 232 s from the disk cache, against 313 s and 68 s without it.

The compiled forward computes what the eager one does, in another summation order: logits equal to a
rounding (fp32 within 1e-4 on the test models, greedy tokens the same); tests/test_compiled_step.py holds
it to the eager runner. Inductor keeps its compiled kernels in its on-disk cache (TORCHINDUCTOR_CACHE_DIR,
default under the system temp folder), so a second start skips most of the compile.
"""

from __future__ import annotations

import functools
import shutil
import time

import torch

# The graphs a served decode meets first: one sequence one row (a causal step) and many sequences one row
# each (causal steps of requests decoding together); `warm_up` compiles them before the first request.
WARM_BATCHES = (1, 2)


@functools.cache
def compile_works() -> str | None:
    """Why the decode step cannot be compiled here, or None: inductor on a CPU writes C++ and needs a compiler."""
    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        return "inductor needs a C++ compiler on the CPU and none is on PATH (apt install g++)"
    return None


# Dynamo's settings while a compiled forward runs (and compiles, at its first call or a recompile).
_SETTINGS = torch._dynamo.config.patch(specialize_float=True)


class CompiledForward:
    """A module's forward compiled (`torch.compile` wraps the module without changing it), run under `_SETTINGS`."""

    def __init__(self, module: torch.nn.Module):
        self.compiled = torch.compile(module, dynamic=True)

    def __call__(self, **inputs):
        with _SETTINGS:  # about 7 us a forward
            return self.compiled(**inputs)


class CompiledModels:
    """The compiled forward of each module the runner forwards (the model, and a served draft adapter's base
    twin), made on first use."""

    def __init__(self):
        self._compiled: dict[torch.nn.Module, CompiledForward] = {}  # modules hash by identity

    def __call__(self, module: torch.nn.Module) -> CompiledForward:
        if module not in self._compiled:
            self._compiled[module] = CompiledForward(module)
        return self._compiled[module]


def warm_up(runner, *, drafting: bool = False, context: int = 16, steps: int = 3) -> float:
    """Compile the decode graphs of `WARM_BATCHES` now (a few causal steps over throwaway caches; with `drafting`,
    self-spec steps too: a verify row and a canvas) and return the seconds it took: the server pays it at
    start, not in its first requests."""
    from bdcore.decode.rows import Forward, Rows
    from bdcore.decode.sequence import SequenceCache

    start = time.perf_counter()
    vocab = runner.model.config.vocab_size
    tokens = [(7 * i + 3) % vocab for i in range(context + 2 * steps + 4)]
    kinds = ("causal", "drafting") if drafting else ("causal",)
    for kind, batch in ((k, b) for k in kinds for b in WARM_BATCHES):
        # caches of different lengths, as requests decoding together have (each writes after its own tokens)
        caches = [(SequenceCache(), context - b) for b in range(batch)]
        runner.forward([(cache, Forward(Rows().clean(tokens[:n], 0), n)) for cache, n in caches])
        for step in range(steps):  # the second step on: the graph with the cache length a symbol
            ops = []
            for _, n in caches:
                at = n + step
                rows = Rows().clean(tokens[at : at + 1], at)
                if kind == "drafting":  # a canvas after the verify row, whose length varies as self-spec's
                    rows.canvas(tokens[at + 1 : at + 3 + step], at + 1)
                ops.append(Forward(rows, 1))
            runner.forward([(cache, op) for (cache, _), op in zip(caches, ops)])
    return time.perf_counter() - start
