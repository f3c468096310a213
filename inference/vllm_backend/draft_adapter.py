"""A checkpoint's draft-only adapter as vLLM 0.33 takes it (vLLM-free: the command side and the plugin share it).

The adapter directory the trainer writes (`bdcore.draft_adapter.save_adapter`) is a stock peft LoRA adapter
(`adapter_config.json`, `adapter_model.safetensors`) plus `mask_row.safetensors`, the trained `<|mask|>` input
row. vLLM loads the first part as it is, through its own LoRA loader (`--enable-lora`; `draft_lora.py` asks for
it and routes it per token). The mask row is not a LoRA term: the plugin's model swaps it in on its input
embedding, at every row whose input is `<|mask|>`, with the rule the native engine uses
(`bdcore.draft_adapter.attach_mask_row`). vLLM's embedding LoRA could carry it only as a base-row-plus-delta
sum at adapter rows, which rounds in 16-bit weights; the swap is exact and needs no exported copy.

What the command asks of vLLM (`lora_flags`): one LoRA slot, the smallest rank vLLM accepts that holds the
adapter's, and LoRA layers on the adapted projections only (`--lora-target-modules`), so the embedding and the
output head stay vLLM's plain layers (a wrapped head would take a per-request LoRA mapping the plugin's
prefill logits do not follow). The adapter is served as trained: the native engine's cut to 99% of each
term's energy (`bdcore.draft_adapter_serving.truncate_adapter`) saves CPU time and is not applied here.
"""

from __future__ import annotations

from pathlib import Path

from bdcore.draft_adapter_files import DraftAdapterError, adapter_config, load_mask_row, target_modules

__all__ = ["DraftAdapterError", "adapter_config", "load_mask_row", "target_modules", "lora_flags", "max_lora_rank"]

# The adapter's LoRA name is `inference.backend_settings.DRAFT_LORA_NAME`, shared with the SGLang backend.
# vLLM's warmup LoRAs take ids 1..max_loras (LoRAModelRunnerMixin.maybe_setup_dummy_loras); ours stays apart.
DRAFT_LORA_ID = 4242
# vLLM 0.33's accepted --max-lora-rank values (config/lora.py `MaxLoRARanks`; the contract check pins them).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(config: dict) -> int:
    """The smallest `--max-lora-rank` vLLM 0.33 accepts that holds every term of the adapter."""
    rank = max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])
    fitting = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if not fitting:
        largest = VLLM_MAX_LORA_RANKS[-1]
        raise DraftAdapterError(f"the draft adapter's rank {rank} exceeds vLLM 0.33's largest LoRA rank, {largest}")
    return fitting[0]


def lora_flags(adapter_dir: str | Path) -> list[str]:
    """vLLM's LoRA flags for serving the draft adapter at `adapter_dir` (see the module doc)."""
    config = adapter_config(adapter_dir)
    rank = max_lora_rank(config)
    targets = target_modules(config)
    return ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(rank), "--lora-target-modules", *targets]
