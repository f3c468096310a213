"""SGLang names our plugin and algorithms use at run time, read from the wheel's source (no import).

These live in modules the contract environment cannot import on CPU (GPU model execution), or in the
launcher's entry module; `check.py` verifies each name is defined where we assume it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

# sglang/srt/dllm/config.py: DllmConfig.__init__'s parameters, in order (the plugin builds it; the tests'
# stand-in copies this signature, and check.py holds it against the wheel).
DLLM_CONFIG_PARAMS = [
    "algorithm",
    "algorithm_config",
    "block_size",
    "mask_id",
    "max_running_requests",
    "first_done_first_out_mode",
    "requires_separate_context_encoding",
    "capture_input_preparation",
    "delete_token_id",
    "split_token_id",
]

# (file under sglang/, class or "Class.method" or None for module level) -> names it must define
SOURCE_NAMES: dict[tuple[str, str | None], tuple[str, ...]] = {
    # algorithms.py: the batch a run() receives, and what model_runner.forward returns
    ("srt/model_executor/forward_batch_info.py", "ForwardBatch"): (
        "forward_mode",
        "input_ids",
        "batch_size",
        "rids",
        "seq_lens",
        "sampling_info",
        "req_pool_indices",
    ),
    ("srt/model_executor/forward_batch_info.py", "ForwardMode"): ("EXTEND", "DLLM_EXTEND", "is_dllm_extend"),
    ("srt/model_executor/model_runner.py", "ModelRunner.forward"): ("forward_batch", "pp_proxy_tensors"),
    ("srt/model_executor/model_runner.py", "ModelRunner"): (
        "model",
        "req_to_token_pool",
        # draft_lora.DraftLoRA.load builds a LoRAManager from these, as ModelRunner.init_lora_manager does
        "model_config",
        "load_config",
        "dtype",
        "server_args",
    ),
    ("srt/configs/model_config.py", "ModelConfig"): ("model_path", "hf_config"),
    ("srt/model_executor/model_runner.py", "ModelRunnerOutput"): ("logits_output", "can_run_graph"),
    ("srt/layers/logits_processor.py", "LogitsProcessorOutput"): ("next_token_logits", "full_logits"),
    ("srt/layers/logits_processor.py", "LogitsProcessor"): ("return_full_logits",),
    ("srt/sampling/sampling_batch_info.py", "SamplingBatchInfo"): ("temperatures", "top_ps", "top_ks"),
    # plugin.py: the attention switch, and the premise that makes it per forward (defect 2 of issue 12)
    ("srt/layers/radix_attention.py", "RadixAttention"): ("attn_type",),
    ("srt/layers/radix_attention.py", "AttentionType"): ("DECODER", "DECODER_BIDIRECTIONAL"),
    ("srt/layers/attention/triton_backend.py", "TritonAttnBackend"): (
        "allow_bidirectional_attention_in_extend",
        "forward_extend",
    ),
    # plugin.mamba_state_guard
    ("srt/mem_cache/memory_pool.py", "HybridReqToTokenPool"): (
        "mamba_pool",
        "get_mamba_indices",
        "translate_mamba_indices",
    ),
    ("srt/mem_cache/memory_pool.py", "MambaPool"): ("mamba_cache",),
    ("srt/mem_cache/memory_pool.py", "State"): ("conv", "temporal"),
    # plugin.unsupported_request (SGLang's validate_request receives a Req)
    ("srt/managers/schedule_batch.py", "Req"): (
        "sampling_params",
        "return_logprob",
        "logprob",
        "custom_logit_processor",
    ),
    ("srt/managers/schedule_batch.py", "ReqLogprob"): ("top_logprobs_num", "token_ids_logprob"),
    ("srt/sampling/sampling_params.py", "SamplingParams"): (
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "min_p",
        "sampling_seed",
        "logit_bias",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
    ),
    # draft_lora.py: our own LoRA manager (lora.py runs the two routing methods themselves), the mask row's embedding
    ("srt/lora/lora_manager.py", "LoRAManager.__init__"): (
        "base_model",
        "base_hf_config",
        "max_loras_per_batch",
        "load_config",
        "dtype",
        "server_args",
        "lora_backend",
        "max_lora_rank",
        "target_modules",
        "lora_paths",
    ),
    ("srt/lora/lora_manager.py", "LoRAManager"): ("fetch_new_loras", "prepare_lora_token_segments", "reset_lora_batch"),
    ("srt/lora/lora_registry.py", "LoRARef"): ("lora_id", "lora_name", "lora_path", "pinned", "deterministic_id"),
    ("srt/models/qwen3.py", "Qwen3ForCausalLM"): ("get_input_embeddings",),
    ("srt/models/llama.py", "LlamaForCausalLM"): ("get_input_embeddings",),
    # (its `weight` is registered by the quant method's create_weights, not in the class body)
    ("srt/layers/vocab_parallel_embedding.py", "VocabParallelEmbedding"): ("embedding_dim", "forward"),
    # launch.py
    ("launch_server.py", None): ("run_server", "load_plugins", "prepare_server_args", "kill_process_tree"),
}


def class_names(path: Path, target: str | None) -> set[str]:
    """What `target` defines in `path`: a class's body names and `self.X` assignments, a method's
    parameters, or (None) the module's top-level definitions and imports."""
    tree = ast.parse(Path(path).read_text())
    if target is None:
        return _body_names(tree.body)
    cls_name, _, method = target.partition(".")
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name == cls_name):
            continue
        if method:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                    args = item.args
                    found |= {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
            continue
        found |= _body_names(node.body)
        for sub in ast.walk(node):
            targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found


def _body_names(body) -> set[str]:
    names: set[str] = set()
    for item in body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in item.names}
    return names
