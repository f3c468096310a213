"""A checkpoint's draft adapter as SGLang 0.5.23's LoRA machinery takes it (SGLang-free: serve.py checks it here
in our environment, and the plugin routes it with `token_segments` in SGLang's).

SGLang's loader reads the adapter directory the trainer writes as it is: `LoRAConfig` reads `adapter_config.json`,
`LoRAAdapter` every `*.safetensors` file, keeping the weights of decoder layers (`layers.N.`) and of targeted
embeddings only, so `mask_row.safetensors` (`bd_mask_row`) is dropped there and the plugin swaps the row in itself
(`draft_lora.py`). It stacks q/k/v into `qkv_proj` (k may be missing, v may not) and gate/up into `gate_up_proj`
(up may be missing), and scales every term by `lora_alpha / r`, ignoring peft's per-module patterns, rsLoRA and
DoRA. `check_adapter` refuses, by name, what it would load otherwise than trained.
"""

from __future__ import annotations

from pathlib import Path

from bdcore.draft_adapter_files import DraftAdapterError, adapter_config, target_modules

LORA_BACKEND = "triton"  # of SGLang 0.5.23's LoRA backends, the one with explicit token segments (and UNO's)
LORA_SLOTS = 2  # SGLang's pool counts the base model as a slot: base rows and adapter rows

# The peft projection names SGLang's dense decoder layers wrap (Qwen3, Llama: qkv_proj, o_proj, gate_up_proj,
# down_proj), and what a stacked one needs of its parts (`LoRAAdapter.normalize_qkv_proj`, `normalize_gate_up_proj`).
SGLANG_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STACK_NEEDS = {"qkv_proj": ("q_proj", "v_proj"), "gate_up_proj": ("gate_proj",)}
STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
STACKED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def check_adapter(adapter_dir: str | Path) -> dict:
    """The adapter's peft config, if SGLang 0.5.23 loads it as trained; `DraftAdapterError` says why not."""
    config = adapter_config(adapter_dir)
    targets = target_modules(config)
    other = sorted(set(targets) - set(SGLANG_TARGETS))
    if other:
        raise DraftAdapterError(
            f"the draft adapter adapts {other}; SGLang's LoRA wraps a dense decoder's {list(SGLANG_TARGETS)} only, "
            "so those terms would be dropped: serve it with --backend native"
        )
    for stack, needs in STACK_NEEDS.items():
        parts = [t for t in targets if STACKED.get(t) == stack]
        if parts and not set(needs) <= set(parts):
            raise DraftAdapterError(
                f"the draft adapter adapts {parts} without {sorted(set(needs) - set(parts))}; SGLang stacks them into "
                f"{stack} and needs those: serve it with --backend native, or train with them"
            )
    for key, what in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas")):
        if config.get(key):
            raise DraftAdapterError(f"the draft adapter has {what} ({key}); SGLang scales every term by lora_alpha / r")
    for key in ("use_rslora", "use_dora"):
        if config.get(key):
            raise DraftAdapterError(f"the draft adapter sets {key}; SGLang's LoRA serves plain LoRA only")
    return config


def token_segments(drafting: list[bool], lora_id: str) -> tuple[list[str | None], list[int]]:
    """`LoRAManager.prepare_lora_token_segments`' arguments for one forward: runs of rows in the forward's token
    order, the adapter (`lora_id`) where `drafting`, the base model (None) elsewhere."""
    ids: list[str | None] = []
    lens: list[int] = []
    for d in drafting:
        want = lora_id if d else None
        if ids and ids[-1] == want:
            lens[-1] += 1
        else:
            ids.append(want)
            lens.append(1)
    return ids, lens


def adapter_dir(model_path: str, adapter: str) -> Path:
    """The checkpoint's adapter directory (`adapter`: the sidecar's name for it); a hub id fetches its files."""
    path = Path(model_path)
    if path.is_dir():
        return path / adapter
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, allow_patterns=[f"{adapter}/*"])) / adapter
