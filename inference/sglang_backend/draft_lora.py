"""The draft adapter through SGLang 0.5.23's own LoRA machinery, routed per token: canvas rows take it, others none.

SGLang's dLLM path turns `--enable-lora` off (`arg_groups/dllm_hook.py`: "LoRA is not supported by diffusion LLM
inference"), so the model runner has no LoRA manager of its own and no request carries a LoRA. The plugin builds
one the way SGLang's UNO speculative decoding does for its draft LoRA (`speculative/uno_lora.py`): a
`LoRAManager` over the served model with two pool slots (the base model and the adapter), the adapter pinned, both
made resident at once. Its loader reads the checkpoint's peft directory (`LoRAConfig`, `LoRAAdapter`), its
`init_lora_modules` wraps the adapted projections with SGLang's LoRA layers, and its Triton backend runs the terms.

Per forward the algorithms name the rows that draft (`Rows.drafting` of each request's planned forward: the
native runner's gate); `route` hands them to `LoRAManager.prepare_lora_token_segments` as runs of rows (the
adapter or None), which installs the backend's batch info for that forward only, and `reset` clears it after
(`reset_lora_batch`: no batch info, so every LoRA layer takes its base path, as in context passes). The LoRA
arithmetic is SGLang's; nothing here multiplies a weight.

The trained `<|mask|>` row is not a LoRA term (SGLang's loader drops `mask_row.safetensors`): it is swapped in on
the served model's input embedding at every row whose input is `<|mask|>`, the native engine's rule
(`bdcore.draft_adapter.attach_mask_row`), exact, as the vLLM plugin does. Hooked on `VocabParallelEmbedding`, whose
forward all-reduces its vocabulary shards first, so every tensor-parallel rank swaps in the same full row.
"""

from __future__ import annotations

from pathlib import Path

from bdcore.draft_adapter import attach_mask_row
from bdcore.draft_adapter_files import load_mask_row
from inference.backend_settings import DRAFT_LORA_NAME, DraftRouter
from inference.sglang_backend.draft_adapter import LORA_BACKEND, LORA_SLOTS, check_adapter, token_segments


class DraftLoRA(DraftRouter):
    """The adapter's id in a LoRA manager, and the routing of each forward."""

    def __init__(self, manager, lora_id: str):
        self.manager, self.lora_id = manager, lora_id

    @classmethod
    def load(cls, model_runner, directory: Path, mask_id: int) -> DraftLoRA:
        """Load the adapter at `directory` into a LoRA manager of its own over `model_runner`'s model, and attach
        its trained `<|mask|>` row. Runs once, before the first forward of the served model."""
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.lora.lora_registry import LoRARef

        check_adapter(directory)  # what serve.py checked, for a settings file written by hand
        path = str(directory)
        ref = LoRARef(
            lora_id=LoRARef.deterministic_id(DRAFT_LORA_NAME, path),
            lora_name=DRAFT_LORA_NAME,
            lora_path=path,
            pinned=True,
        )
        manager = LoRAManager(
            base_model=model_runner.model,
            base_hf_config=model_runner.model_config.hf_config,
            max_loras_per_batch=LORA_SLOTS,
            load_config=model_runner.load_config,
            dtype=model_runner.dtype,
            server_args=model_runner.server_args,
            lora_backend=LORA_BACKEND,
            max_lora_rank=None,  # the adapter's own, read by the loader
            target_modules=None,
            lora_paths=[ref],
        )
        manager.fetch_new_loras({None, ref.lora_id})  # both slots resident for every forward after this
        embed = model_runner.model.get_input_embeddings()
        row = load_mask_row(directory, embed.embedding_dim)
        attach_mask_row(embed, row.to(embed.weight.device, embed.weight.dtype), mask_id)
        return cls(manager, ref.lora_id)

    def route(self, drafting: list[bool], num_reqs: int | None = None) -> None:
        """The next forward runs the adapter at its `drafting` rows (every token of the forward, batch order);
        SGLang's token segments need no count of requests."""
        ids, lens = token_segments(drafting, self.lora_id)
        self.manager.prepare_lora_token_segments(lora_ids=ids, segment_lens=lens)

    def reset(self) -> None:
        """Every row after this runs the base weights."""
        self.manager.reset_lora_batch()
