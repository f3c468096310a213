"""The draft adapter through vLLM 0.33's own LoRA machinery, routed per token: canvas rows take it, others none.

vLLM maps LoRAs per request: each step the model runner activates the requests' adapters and hands its
LoRA manager a `LoRAMapping` whose `index_mapping` names one adapter id per scheduled token (0: none;
`LoRAModelRunnerMixin._set_active_loras`, from `LoraState.make_lora_inputs`, which repeats each request's id
over its tokens). The punica wrapper turns that mapping into the per-token indices its kernels read
(`convert_mapping`: id -> slot, 0 -> -1, no LoRA). A draft-only adapter needs finer routing than a request:
one forward of one request holds clean rows (base weights) and canvas rows (adapter). So the plugin's
ModelState sets the mapping itself, after the runner's (`model_runner.py`: `_set_active_loras` comes before
`model_state.prepare_inputs`, which calls `route`), with its own adapter request:

- the adapter is loaded by vLLM's worker LoRA manager (`LRUCacheWorkerLoRAManager.add_adapter`: the peft
  directory read by `PEFTHelper` and `LoRAModel.from_local_checkpoint`, validated, put in a slot) over the
  runner's LoRA model manager (`model.lora_manager`, the one that owns the model's LoRA layers);
- the mapping's token ids come from `steps.StepGlue.adapter_rows`: the adapter at the planned forward's
  canvas rows (`Rows.drafting`, the native runner's gate), none at prefill rows, clean rows and padding.

The LoRA arithmetic is vLLM's (punica kernels on its LoRA layers); nothing here multiplies a weight.
"""

from __future__ import annotations

from pathlib import Path

from vllm.lora.layers import LoRAMapping
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

from inference.backend_settings import DRAFT_LORA_NAME, DraftRouter
from inference.vllm_backend.draft_adapter import DRAFT_LORA_ID
from inference.vllm_backend.plugin import PluginError


class DraftLoRA(DraftRouter):
    """The draft adapter's vLLM LoRA request, and the per-token mapping of each forward."""

    def __init__(self, vllm_config, model, device, adapter_dir: str | Path):
        manager = getattr(model, "lora_manager", None)
        if vllm_config.lora_config is None or manager is None:
            raise PluginError(
                "the checkpoint has a draft adapter and vLLM runs without LoRA: serve it with the command serve.py "
                "--backend vllm builds (--enable-lora --max-loras 1 --max-lora-rank R --lora-target-modules ...)"
            )
        self.worker = LRUCacheWorkerLoRAManager(vllm_config, device, model.embedding_modules)
        # vLLM's own loader over the runner's model manager: one set of LoRA layers, one slot table
        self.worker._adapter_manager = manager
        self.request = LoRARequest(DRAFT_LORA_NAME, DRAFT_LORA_ID, str(adapter_dir))

    def route(self, drafting: list[bool], num_reqs: int | None = None) -> LoRAMapping:
        """Activate the adapter (loading it the first time) and map it to the `drafting` tokens of this forward
        (all scheduled tokens, batch order); every other token runs the base weights. The prompt mapping (one
        entry per request, read only by an adapted output head, which the command never asks for) is none."""
        if num_reqs is None:
            raise TypeError("route needs num_reqs on vLLM: its LoRA mapping has an entry per request")
        mapping = LoRAMapping(tuple(DRAFT_LORA_ID if d else 0 for d in drafting), (0,) * num_reqs, is_prefill=True)
        self.worker.set_active_adapters({self.request}, mapping)
        return mapping

    def reset(self) -> None:
        """Nothing to clear: vLLM's runner maps each step afresh (`_set_active_loras`, the requests' own: none)
        before `route` replaces that mapping for the step's forward."""
