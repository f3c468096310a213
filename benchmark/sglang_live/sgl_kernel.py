"""A stand-in `sgl_kernel` for SGLang 0.5.23's CPU engine where no CPU build of SGLang's kernels exists (PyPI's
are CUDA builds; their CPU source needs GCC 15): plain-torch versions of the two ops SGLang imports
unconditionally with SGLANG_USE_CPU_ENGINE=1, every other `*_cpu` name importable and raising if called.
It registers no `torch.ops.sgl_kernel` ops, so SGLang's AMX check stays false and every layer takes its plain
torch path. `build_venv.sh` copies it into `.venv-sglang-live/stubs/` (put that folder on PYTHONPATH); a trial
aid, not part of bdstack (docs/history/results-notebook.md, Session 54)."""

__version__ = "0.0.0+bdstack-cpu-standin"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    # = sglang/srt/mem_cache/allocation.py:assign_req_to_token_pool (triton): row i gets the slice of
    # out_cache_loc after the lengths of rows < i.
    off = 0
    for i in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[i]), int(end_offset[i])
        n = e - s
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    # = sglang/kernels/ops/kvcache/cache_move.py:copy_all_layer_kv_cache_tiled (triton): for every
    # buffer i (raw address data_ptrs[i], row size strides[i] bytes) copy row src_loc[j] to tgt_loc[j].
    import ctypes

    ptrs = [int(p) for p in data_ptrs.tolist()]
    rows = [int(s) for s in strides.tolist()]
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for p, s in zip(ptrs, rows):
        for t, f in pairs:
            ctypes.memmove(p + int(t) * s, p + int(f) * s, s)


# Every other `*_cpu` op SGLang imports at module level on CPU (speculative: build_tree_kernel_efficient_cpu,
# verify_tree_greedy_cpu, fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu, assign_*_cache_locs_cpu,
# rotate_input_ids_cpu, ...): importable, raises if ever called (plain decoding never calls them).
IMPORTED_PLACEHOLDERS = []


def __getattr__(name):
    if name.endswith("_cpu"):
        IMPORTED_PLACEHOLDERS.append(name)

        def placeholder(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented")

        placeholder.__name__ = name
        return placeholder
    raise AttributeError(f"sgl_kernel stand-in has no {name}")
