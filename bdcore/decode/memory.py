"""What a request will allocate, known before it allocates anything: a floor, and the memory there is.

A sidecar's block size and a config's context length are only numbers in files: a block of 10**9 with a context
of 2 * 10**9 passes every check of the settings against the checkpoint, and its first canvas is a MemoryError
(or, under an address-space limit, an engine that grows until something kills it). So the engine's entry
points (the server per request, serve.py at start for each mode a request may pick) compare what a request must
hold with what the process can still get, and refuse in words before the first byte.

The figure is a floor, never a guess from above: the KV cache of every token the request may hold, and the
largest forward's logits (fp32), hidden states and attention-mask row. Temporaries of the forward, the
allocator's slack and the other requests in flight come on top, so a request under it may still not fit; one
over it cannot. A floor refuses no request that could have been served.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from bdcore.decode.config import ResolvedDecode

GIB = 1 << 30


@dataclass(frozen=True)
class RequestFloor:
    """Bytes a served request holds at least, per token of its context and per row of its largest forward."""

    kv_per_token: int  # keys and values of every attention layer
    per_row: int  # fp32 logits and the hidden state a forward row carries
    mask_per_key: int  # the attention mask's entry for one (row, key) pair

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> RequestFloor:
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        layer_types = getattr(text, "layer_types", None)  # hybrids: only full-attention layers keep a KV cache
        attention_layers = sum(t == "full_attention" for t in layer_types) if layer_types else text.num_hidden_layers
        size = torch.empty((), dtype=dtype).element_size()
        return cls(
            kv_per_token=2 * attention_layers * kv_heads * head_dim * size,
            per_row=4 * text.vocab_size + size * text.hidden_size,
            mask_per_key=1,
        )

    def bytes(self, context: int, rows: int) -> int:
        """A request whose context reaches `context` tokens and whose largest forward carries `rows` rows."""
        return context * self.kv_per_token + rows * (self.per_row + context * self.mask_per_key)


def largest_forward_rows(decode: ResolvedDecode, prompt: int) -> int:
    """The rows of a request's largest forward, at least: its prompt's prefill, or a step of its mode."""
    if decode.mode == "diffusion":
        step = decode.block
    elif decode.mode == "self-spec":
        step = decode.draft_len * decode.draft_len if decode.canvases == "all" else decode.draft_len
        if decode.tree_shape is not None:
            step = max(step, decode.tree_shape.nodes + 1)
    else:
        step = 1
    return max(prompt, step)


def request_bytes(floor: RequestFloor, decode: ResolvedDecode, prompt: int, max_tokens: int) -> int:
    """The floor of a request with `prompt` tokens that may reply `max_tokens`: a canvas may reach a block past
    the reply's last token."""
    reach = decode.block if decode.mode == "diffusion" else decode.draft_len if decode.mode == "self-spec" else 1
    return floor.bytes(prompt + max_tokens + reach, largest_forward_rows(decode, prompt))


def available_bytes() -> int | None:
    """What this process can still allocate: the least of the machine's available memory, the room left under
    its address-space limit (`ulimit -v`, `prlimit --as`) and its cgroup's memory limit; None where none of
    them can be read (a platform without /proc)."""
    room = []
    meminfo = _read_kib("/proc/meminfo", "MemAvailable:")
    if meminfo is not None:
        room.append(meminfo)
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        used = _read_kib("/proc/self/status", "VmSize:")
        room.append(max(0, limit - (used or 0)))
    cgroup = _cgroup_room()
    if cgroup is not None:
        room.append(cgroup)
    return min(room) if room else None


def describe(n: int) -> str:
    return f"{n / GIB:.3g} GiB"


def _read_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """cgroup v2's memory.max less memory.current, where this process's cgroup sets a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None
