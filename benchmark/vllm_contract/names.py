"""vLLM 0.33.0 names the plugin relies on, read from the wheel's source (modules CPU cannot import).

Each entry: (file under vllm/, what must be defined or stated there). Function signatures are read with
`ast`; the Triton mask rule `masks.triton_visible` restates is pinned by its source lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

# (file, function or Class.method) -> parameters it must take
PARAMETERS = {
    ("v1/worker/gpu/attn_utils.py", "build_attn_metadata"): ("causal", "mm_req_doc_ranges", "positions"),
    ("model_executor/models/registry.py", "_ModelRegistry.register_model"): ("model_arch", "model_cls"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.__init__"): (
        "vllm_config",
        "model",
        "encoder_cache",
        "device",
    ),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.prepare_attn"): ("input_batch", "slot_mappings"),
    ("v1/worker/gpu/model_states/interface.py", "ModelState.custom_sampler"): ("sampler",),
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
    "v1/attention/backends/triton_attn.py": ("mm_ranges = common_attn_metadata.mm_req_doc_ranges",),
    "plugins/__init__.py": ('DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"',),
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
            r.check(line in text, f"{file}: no line {line!r}")
