"""The model classes the plugin registers: vLLM's stock causal class plus our `ModelState` (imports vLLM).

vLLM 0.33's model runner v2 asks a model for its own ModelState (`get_model_state_cls()`,
`vllm/v1/worker/gpu/model_states/__init__.py`). Ours reads the decode settings from
`--additional-config` and re-checks the checkpoint (a hand-written command gets the same refusals as
serve.py's). The step glue (scheduling `sampler.RequestDecoder`'s rows as vLLM's draft tokens,
`masks.ranges_for` into `build_attn_metadata(causal=..., mm_req_doc_ranges=...)`, the sampler's output
as `SamplerOutput`) is not written yet: it needs a GPU to be tested, so the state refuses to start
rather than serve unverified decoding (README.md, "What still needs a GPU").
"""

from __future__ import annotations

from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from inference.vllm_backend.checkpoint import refusal
from inference.vllm_backend.plugin import PluginError
from inference.vllm_backend.settings import VllmDecodeSettings

NOT_YET = (
    "bdstack's vLLM ModelState (diffusion / self-spec step glue) is not implemented yet: the plugin's sampler and "
    "masks are verified on CPU only (inference/vllm_backend/README.md); serve diffusion/self-spec with --backend "
    "native or sglang, or causal with --backend vllm"
)


class BdstackModelState(DefaultModelState):
    def __init__(self, vllm_config, model, encoder_cache, device):
        self.settings = VllmDecodeSettings.from_additional_config(vllm_config.additional_config)
        why = refusal(vllm_config.model_config.model, self.settings.mode)
        if why:
            raise PluginError(why)
        raise PluginError(NOT_YET)


class BdstackQwen3ForBlockDiffusion(Qwen3ForCausalLM):
    @staticmethod
    def get_model_state_cls():
        return BdstackModelState
