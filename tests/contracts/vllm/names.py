"""vLLM names the plugin relies on, read from the wheel's source (modules CPU cannot import): 0.33.0's, and
0.32.0's (the CPU build) where they moved.

Each entry: (file under vllm/, what must be defined or stated there, or in which order); a tuple among a file's
statements lists the forms a statement takes in the releases checked, one of which must be there. Function
signatures are read with `ast`; the Triton mask rule `masks.triton_visible` restates is pinned by its source lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

# (file, function or Class.method) -> parameters it must take
PARAMETERS = {
    ("model_executor/models/registry.py", "_ModelRegistry.register_model"): ("model_arch", "model_cls"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.__init__"): (
        "vllm_config",
        "model",
        "encoder_cache",
        "device",
    ),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.prepare_attn"): ("input_batch", "slot_mappings"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.custom_sampler"): ("sampler",),
    # the step glue (model.py; README "The step contract")
    ("v1/worker/gpu/attn_utils.py", "build_attn_metadata"): (
        "attn_groups",
        "num_reqs",
        "num_tokens",
        "query_start_loc_gpu",
        "query_start_loc_cpu",
        "max_query_len",
        "seq_lens",
        "max_seq_len",
        "block_tables",
        "slot_mappings",
        "kv_cache_config",
        "seq_lens_cpu_upper_bound",
        "positions",
        "is_prefilling",
        "mm_req_doc_ranges",
        "for_cudagraph_capture",
        "causal",
        "req_idx",
        "ubatch_idx",
    ),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.prepare_inputs"): ("input_batch", "req_states"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.add_request"): ("req_index", "new_req_data"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.remove_request"): ("req_id",),
    ("v1/worker/gpu/model_states/default.py", "DefaultModelState.prepare_inputs"): ("input_batch", "req_states"),
    ("v1/worker/gpu/sample/sampler.py", "Sampler.add_request"): ("req_idx", "sampling_params"),
    ("v1/worker/gpu/sample/sampler.py", "Sampler.apply_staged_writes"): (),
    ("model_executor/models/qwen3.py", "Qwen3ForCausalLM.forward"): (
        "input_ids",
        "positions",
        "intermediate_tensors",
        "inputs_embeds",
    ),
    ("model_executor/models/qwen3.py", "Qwen3ForCausalLM.compute_logits"): ("hidden_states",),
    # the draft adapter's route (draft_lora.py, lora.py)
    ("lora/worker_manager.py", "WorkerLoRAManager.__init__"): ("vllm_config", "device", "embedding_modules"),
    ("lora/worker_manager.py", "WorkerLoRAManager.set_active_adapters"): ("requests", "mapping"),
    ("lora/model_manager.py", "LoRAModelManager.set_adapter_mapping"): ("mapping",),
}
# (file) -> source lines that must be present verbatim (stripped)
STATEMENTS = {
    "v1/worker/gpu/model_states/__init__.py": ('if hasattr(model, "get_model_state_cls"):',),
    "v1/worker/gpu/model_states/default.py": ("class DefaultModelState(ModelState):",),
    "model_executor/models/qwen3.py": ("class Qwen3ForCausalLM(",),
    "config/model.py": ('return getattr(self.hf_config, "canvas_length", None) is not None',),
    "v1/attention/ops/triton_attention_helpers.py": (
        "seq_mask = seq_offset[None, :] <= query_abs_pos",
        "is_valid = range_start < range_end",
        "(query_abs_pos >= range_start) & (query_abs_pos <= range_end) & is_valid",
        "seq_mask |= mm_mask",
    ),
    "plugins/__init__.py": ('DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"',),
    # The step contract (README.md): a diffusion model's scheduler keeps len(sampled) of the drafts ...
    "v1/core/sched/scheduler.py": (
        "or vllm_config.model_config.is_diffusion",
        "num_sampled = self.num_sampled_tokens_per_step",
        "num_accepted = max(len(generated_token_ids) - num_sampled, 0)",
        "num_rejected = num_draft_tokens - num_accepted",
        "request.num_computed_tokens -= num_rejected",
        "request.num_tokens_with_spec",
    ),
    # ... the worker keeps query_len - num_rejected; sampled tokens are appended as output ...
    "v1/worker/gpu/input_batch.py": (
        "computed_delta = query_len - num_rejected",
        "logits_start = query_end - num_logits",
        "num_draft_tokens = num_logits - NUM_NEW_SAMPLED_TOKENS",
        "input_ids_ptr + query_end - num_draft_tokens + block,",
        "draft_tokens_ptr + req_state_idx * draft_tokens_stride + block,",
    ),
    # ... the runner: our sampler in place of vLLM's, every draft row a logit row, drafts from req_states ...
    "v1/worker/gpu/model_runner.py": (
        "custom = self.model_state.custom_sampler(self.sampler)",
        "self.sampler, self.rejection_sampler = custom",
        "sampler_output = self.sampler(logits, input_batch)",
        "num_logits = num_draft_tokens_per_req + num_bonus_tokens",
        "num_bonus_tokens = self.model_state.num_new_sampled_tokens_per_step",
        "**self.model_state.prepare_inputs(input_batch, self.req_states),",
        (  # the step's drafts, read from req_states for the scheduler: 0.33, 0.32
            "draft_tokens = self.req_states.draft_tokens[input_batch.idx_mapping]",
            "self.req_states.draft_tokens[input_batch.idx_mapping, :num_spec_tokens],",
        ),
        "output_bin_counts = self.sampler.penalties_state.output_bin_counts",
        "attn_metadata = self.model_state.prepare_attn(",
        "sample_hidden_states = hidden_states[input_batch.logits_indices]",
    ),
    # ... the engine hands the sampler's drafts to the scheduler after each synchronous step ...
    "v1/engine/core.py": (
        "self.use_spec_decode or vllm_config.model_config.is_diffusion",
        "if self.check_for_draft_tokens and not self.async_scheduling and model_executed:",
        "self.scheduler.update_draft_token_ids(draft_token_ids)",
    ),
    # ... the spec width is the diffusion canvas; mm ranges are keyed by batch index
    "config/vllm.py": ("return self.diffusion_config.canvas_length",),
    "v1/attention/backends/utils.py": ("mm_prefix_range.get(i, [(0, 0)]) or [(0, 0)] for i in range(num_seqs)",),
    "v1/worker/gpu/sample/output.py": (
        "sampled_token_ids: torch.Tensor",
        "num_sampled: torch.Tensor",
        "num_rejected: torch.Tensor",
    ),
    "v1/attention/backends/triton_attn.py": (
        "mm_ranges = common_attn_metadata.mm_req_doc_ranges",
        "mm_prefix_range=mm_prefix_range_tensor,",
    ),
    # The draft adapter (draft_lora.py): our worker manager over the runner's model manager, which the model
    # (the ModelState's) carries; the mapping goes to the punica wrapper with the slot table; on the GPU the
    # kernels group tokens by LoRA id, so one request's rows may alternate between adapter and none
    "lora/worker_manager.py": (
        "class LRUCacheWorkerLoRAManager(WorkerLoRAManager):",
        "self._adapter_manager = lora_manager",
        "for lora in loras_map.values():",
    ),
    "lora/model_manager.py": (
        "self.model.lora_manager = self",
        "punica_wrapper.update_metadata(",
        "self.lora_index_to_id,",
        "self.lora_slots + 1,",
    ),
    "lora/punica_wrapper/punica_gpu.py": ("self.token_mapping_meta.prepare_tensors(self.token_lora_indices)",),
    "lora/ops/triton_ops/lora_kernel_metadata.py": ("_, token_indices_sorted_by_lora_ids = torch.sort(",),
    "model_executor/models/qwen2.py": (
        "self.embed_tokens = VocabParallelEmbedding(",
        "return self.embed_tokens(input_ids)",
    ),
}
# (file) -> pairs of lines (stripped) the first of which comes first: the runner loads the LoRA model before it
# builds the ModelState (which so gets the LoRA-wrapped model), and sets its own LoRA mapping before it asks
# the ModelState for its inputs (where the plugin sets the per-token one, which so stands for the forward)
ORDER = {
    "v1/worker/gpu/model_runner.py": (
        ("self.model = self.load_lora_model(", "self.model_state = init_model_state("),
        ("self._set_active_loras(*lora_inputs)", "**self.model_state.prepare_inputs(input_batch, self.req_states),"),
    ),
}


def parameters(path: Path, target: str) -> set[str]:
    cls, _, fn = target.rpartition(".")
    for node in ast.walk(ast.parse(path.read_text())):
        scope = node.body if isinstance(node, ast.ClassDef) and node.name == cls else None
        if not cls and isinstance(node, ast.Module):
            scope = node.body
        for item in scope or ():
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == fn:
                a = item.args
                return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    return set()


def check_source_names(r, root: Path) -> None:
    for (file, target), wanted in PARAMETERS.items():
        found = parameters(root / file, target)
        r.check(set(wanted) <= found, f"{file}: {target} lacks {sorted(set(wanted) - found)}")
    for file, lines in STATEMENTS.items():
        text = {line.strip() for line in (root / file).read_text().splitlines()}
        for line in lines:
            forms = line if isinstance(line, tuple) else (line,)
            r.check(any(form in text for form in forms), f"{file}: no line {' or '.join(map(repr, forms))}")
    for file, pairs in ORDER.items():
        lines = [line.strip() for line in (root / file).read_text().splitlines()]
        for first, then in pairs:
            at = [lines.index(x) if x in lines else -1 for x in (first, then)]
            r.check(0 <= at[0] < at[1], f"{file}: {first!r} before {then!r} (lines {at})")
