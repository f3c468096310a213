"""The stand-in for SGLang's kernels on its CPU engine (`benchmark/sglang_live/sgl_kernel.py`, `make sglang-cpu`):
its two ops against their rules read directly, and every other kernel importable but refusing to run."""

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "benchmark" / "sglang_live" / "sgl_kernel.py"


@pytest.fixture(scope="module")
def kernel():
    spec = importlib.util.spec_from_file_location("standin_sgl_kernel", PATH)  # not as `sgl_kernel`: no shadowing
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool_writes_each_requests_slots_in_turn(kernel):
    """Request i's new token slots are the run of out_cache_loc after the runs of the requests before it, written
    to its row of req_to_token from start_offset[i] to end_offset[i]."""
    req_to_token = torch.zeros(3, 10, dtype=torch.int32)
    out = torch.tensor([7, 8, 9, 5, 6])
    kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([4, 2]), out, 10
    )
    want = torch.zeros(3, 10, dtype=torch.int32)
    want[2, 1:4] = torch.tensor([7, 8, 9])
    want[0, 0:2] = torch.tensor([5, 6])
    assert torch.equal(req_to_token, want)


def test_copy_all_layer_kv_cache_copies_rows_in_every_buffer(kernel):
    """Row src_loc[j] of every buffer (given by address and row size in bytes) is copied to row tgt_loc[j]."""
    buffers = [torch.arange(12, dtype=torch.float32).reshape(6, 2), torch.arange(18, dtype=torch.int16).reshape(6, 3)]
    want = [b.clone() for b in buffers]
    for w in want:
        w[[0, 3]] = w[[5, 1]]
    ptrs = torch.tensor([b.data_ptr() for b in buffers])
    rows = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    kernel.copy_all_layer_kv_cache_cpu(ptrs, rows, torch.tensor([0, 3]), torch.tensor([5, 1]))
    assert all(torch.equal(b, w) for b, w in zip(buffers, want))


def test_other_kernels_import_but_refuse_to_run(kernel):
    from_import = kernel.verify_tree_greedy_cpu  # what `from sgl_kernel import ...` does at SGLang's import
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        from_import()
    with pytest.raises(AttributeError):
        getattr(kernel, "not_a_cpu_kernel")  # noqa: B009
