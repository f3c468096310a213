"""The model class the plugin registers and its vLLM 0.33 ModelState: a thin shell around `steps.StepGlue`.

vLLM 0.33's model runner v2 asks a model for its own ModelState (`get_model_state_cls()`,
`vllm/v1/worker/gpu/model_states/__init__.py`) and lets the state replace the sampler
(`custom_sampler`). Everything that decides (which rows a forward has, what is kept, what is output) is
`steps.py`, hence `sampler.RequestDecoder` and bdcore's decoders; this file only moves vLLM's tensors in
and out (README.md, "The step contract", cites every vLLM line relied on):

- `add_request` / `remove_request`: a `steps.CanvasRequest` per request, from its prompt, max_tokens and
  `extra_args["bdstack"]`;
- `prepare_inputs`: the rows whose logits the model computes itself (each completing prompt's last row: a
  diffusion prefill has no logit rows), read by `BdstackQwen3ForBlockDiffusion.forward`;
- `prepare_attn`: `build_attn_metadata` with every request causal plus its planned forward's
  bidirectional ranges as `mm_req_doc_ranges` (batch index -> ranges; the Triton backend reads them);
- the sampler (`BdstackSampler`): the glue's output as vLLM's `SamplerOutput` (`num_sampled`,
  `num_rejected`), and the next forward's rows written into `req_states.draft_tokens`, which vLLM
  schedules as the next step's drafts;
- a checkpoint with a draft adapter: `prepare_inputs` maps vLLM's LoRA to the canvas rows of each forward
  (`draft_lora.DraftLoRA`, from `StepGlue.adapter_rows`), and the model swaps in the trained `<|mask|>` row
  (`draft_adapter.py`).
Imports vLLM's GPU worker modules, which import on CPU too: the contract check runs this shell there
(`tests/contracts/vllm/model_state.py`).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from bdcore.draft_adapter import attach_mask_row
from inference.vllm_backend.checkpoint import check_servable
from inference.vllm_backend.draft_adapter import load_mask_row
from inference.vllm_backend.draft_lora import DraftLoRA
from inference.vllm_backend.plugin import PluginError
from inference.vllm_backend.sampler import request_params
from inference.vllm_backend.settings import VllmDecodeSettings
from inference.vllm_backend.steps import BatchRow, StepGlue


def batch_rows(input_batch) -> list[BatchRow]:
    """vLLM's InputBatch (model runner v2) as the glue's rows, in batch order."""
    n = input_batch.num_reqs
    num_logits = np.diff(input_batch.cu_num_logits_np[: n + 1])
    done = (
        input_batch.num_computed_prefill_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
        >= input_batch.prefill_len_np[:n]
    )
    return [
        BatchRow(
            input_batch.req_ids[i],
            int(num_logits[i]),
            int(input_batch.num_computed_tokens_np[i]),
            bool(input_batch.is_prefilling_np[i] and done[i]),
        )
        for i in range(n)
    ]


def refuse_unsupported(vllm_config) -> None:
    """What the glue's accounting does not hold under (serve.py's command never sets these)."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise PluginError("bdstack's vLLM plugin runs without pipeline parallelism (the sampler needs the logits)")
    if vllm_config.scheduler_config.async_scheduling:
        raise PluginError("bdstack's vLLM plugin needs --no-async-scheduling (each step checks the computed tokens)")
    if vllm_config.cache_config.enable_prefix_caching:
        raise PluginError("bdstack's vLLM plugin needs --no-enable-prefix-caching (canvas KV is rolled back)")


class BdstackModelState(DefaultModelState):
    num_new_sampled_tokens_per_step: int = 0  # vLLM's diffusion layout: every scheduled row is a draft

    def __init__(self, vllm_config, model, encoder_cache, device):
        self.settings = VllmDecodeSettings.from_additional_config(vllm_config.additional_config)
        check_servable(vllm_config.model_config.model, self.settings)  # CannotServe: the reason and the fix
        refuse_unsupported(vllm_config)
        if vllm_config.num_speculative_tokens != self.settings.canvas_length:
            raise PluginError(
                f"--diffusion-config canvas_length is {vllm_config.num_speculative_tokens}, the plugin's forwards are "
                f"{self.settings.canvas_length} rows: use the command serve.py --backend vllm builds"
            )
        super().__init__(vllm_config, model, encoder_cache, device)
        self.glue = StepGlue(self.settings)
        adapter = self.settings.draft_adapter
        self.draft = None if adapter is None else DraftLoRA(vllm_config, model, device, draft_dir(vllm_config, adapter))

    def get_supported_generation_tasks(self):
        return ("generate",)

    def add_request(self, req_index, new_req_data) -> None:
        if self.draft is not None and getattr(new_req_data, "lora_request", None) is not None:
            raise PluginError(
                f"request {new_req_data.req_id} names a LoRA; this server routes the checkpoint's draft adapter to "
                "canvas rows itself, and a request's own LoRA would act at every row: serve that LoRA elsewhere"
            )
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        ours = request_params(params.extra_args if params else None, params.max_tokens if params else 1)
        generator = torch.Generator(device=self.device).manual_seed(zlib.crc32(new_req_data.req_id.encode()))
        self.glue.add(new_req_data.req_id, new_req_data.prompt_token_ids, ours, generator)

    def remove_request(self, req_id) -> None:
        super().remove_request(req_id)
        self.glue.remove(req_id)

    def prepare_inputs(self, input_batch, req_states):
        n = input_batch.num_reqs
        rows = batch_rows(input_batch)
        found = self.glue.prefill_rows(rows, input_batch.query_start_loc_np[1 : n + 1].tolist())
        self.model.bdstack_prefill_rows = torch.tensor(found, device=self.device) if found else None
        # after the runner's own LoRA mapping (per request), ours per token; vLLM's warmup and dummy batches
        # (no request of ours) keep the runner's
        if self.draft is not None and any(r.req_id in self.glue.requests for r in rows):
            self.draft.route(self.glue.adapter_rows(rows, input_batch.num_scheduled_tokens[:n].tolist()), n)
        return super().prepare_inputs(input_batch, req_states)

    def custom_sampler(self, sampler):
        return BdstackSampler(sampler, self.glue, self.model, self.device), None

    def prepare_attn(
        self,
        input_batch,
        cudagraph_mode,
        block_tables,
        slot_mappings,
        attn_groups,
        kv_cache_config,
        for_capture=False,
        ubatch_idx: int = 0,
    ):
        full = cudagraph_mode == CUDAGraphMode.FULL  # never under --enforce-eager; kept as vLLM's states do
        num_reqs = input_batch.num_reqs_after_padding if full else input_batch.num_reqs
        num_tokens = input_batch.num_tokens_after_padding if full else input_batch.num_tokens
        ranges = None if for_capture else self.glue.attention_ranges(batch_rows(input_batch))
        upper = input_batch.seq_lens_cpu_upper_bound
        return build_attn_metadata(
            attn_groups=attn_groups,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc_gpu=input_batch.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=torch.from_numpy(input_batch.query_start_loc_np[: num_reqs + 1]),
            max_query_len=int(input_batch.num_scheduled_tokens.max()),
            seq_lens=input_batch.seq_lens,
            max_seq_len=self.max_model_len if for_capture else int(upper[:num_reqs].max()),
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            kv_cache_config=kv_cache_config,
            seq_lens_cpu_upper_bound=upper,
            positions=input_batch.positions,
            is_prefilling=torch.from_numpy(input_batch.is_prefilling_np),
            mm_req_doc_ranges=ranges or None,
            for_cudagraph_capture=for_capture,
            causal=True,
            req_idx=input_batch.idx_mapping_np,
            ubatch_idx=ubatch_idx,
        )


class BdstackSampler:
    """vLLM's sampler slot (`ModelState.custom_sampler`): the glue's emissions as a `SamplerOutput`."""

    def __init__(self, sampler, glue: StepGlue, model, device):
        self.base = sampler  # per-request sampling states stay vLLM's (the runner reads them)
        self.sampling_states = sampler.sampling_states
        self.req_states = sampler.req_states
        self.penalties_state = SimpleNamespace(output_bin_counts=None)  # no penalties: post_update skips them
        self.glue, self.model, self.device = glue, model, device

    def add_request(self, req_idx, sampling_params) -> None:
        self.base.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        self.base.apply_staged_writes()

    def __call__(self, logits, input_batch, draft_logits=None) -> SamplerOutput:
        rows = batch_rows(input_batch)
        prefill_logits = getattr(self.model, "bdstack_prefill_logits", None)
        self.model.bdstack_prefill_logits = None
        results = self.glue.sample(rows, logits, prefill_logits)
        width = max([1] + [len(e.tokens) for e, _ in results])
        sampled = torch.zeros(len(rows), width, dtype=torch.int32)
        counts = torch.zeros(2, len(rows), dtype=torch.int32)
        slots, drafts = [], []
        for i, (emission, next_drafts) in enumerate(results):
            sampled[i, : len(emission.tokens)] = torch.tensor(emission.tokens, dtype=torch.int32)
            counts[0, i], counts[1, i] = len(emission.tokens), emission.rejected
            if next_drafts is not None:
                slots.append(int(input_batch.idx_mapping_np[i]))
                drafts.append(next_drafts)
        if slots:  # vLLM schedules these as each request's next drafts (combine_sampled_and_draft_tokens)
            table = torch.tensor(drafts, dtype=self.req_states.draft_tokens.dtype)
            self.req_states.draft_tokens[torch.tensor(slots), : table.shape[1]] = table.to(self.device)
        counts = counts.to(self.device)
        return SamplerOutput(
            sampled_token_ids=sampled.to(self.device),
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=counts[0],
            num_rejected=counts[1],
        )


def draft_dir(vllm_config, adapter: str) -> Path:
    """The checkpoint's draft adapter directory (`adapter`: the sidecar's name for it, relative to the model)."""
    return Path(vllm_config.model_config.model) / adapter


class BdstackQwen3ForBlockDiffusion(Qwen3ForCausalLM):
    """vLLM's Qwen3ForCausalLM, plus the logits of the rows vLLM gives none (a completing prompt's last), and a
    draft adapter's trained `<|mask|>` input row where the checkpoint has one (its LoRA is vLLM's)."""

    bdstack_prefill_rows: torch.Tensor | None = None  # set by BdstackModelState.prepare_inputs
    bdstack_prefill_logits: torch.Tensor | None = None  # read by BdstackSampler

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = VllmDecodeSettings.from_additional_config(vllm_config.additional_config)
        if settings.draft_adapter is not None:
            embed = self.model.embed_tokens
            row = load_mask_row(draft_dir(vllm_config, settings.draft_adapter), embed.embedding_dim)
            attach_mask_row(embed, row.to(embed.weight.device, embed.weight.dtype), settings.mask_id)

    @staticmethod
    def get_model_state_cls():
        return BdstackModelState

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        rows, self.bdstack_prefill_rows = self.bdstack_prefill_rows, None
        if rows is not None:
            self.bdstack_prefill_logits = self.compute_logits(hidden[rows])
        return hidden
