"""Process group, device, FSDP2 sharding and shard-by-shard model materialisation.

Kept apart from the model code (torchtitan style): the model wrapper knows nothing of ranks.
One process without torchrun still gets a (world size 1) process group, so CPU, one GPU and many
GPUs run the same code path.
"""

from __future__ import annotations

import copy
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistInfo:
    """Join torchrun's group (nccl on CUDA, gloo on CPU), or make a one-process group."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def materialize_sharded(
    build_meta, full_state_dict: dict | None, buffers: dict | None, info: DistInfo, shard, weights_of=lambda m: m
) -> torch.nn.Module:
    """Build the model on the meta device on every rank, shard it, then fill the shards.

    Only rank 0 holds the full weights (on CPU); `set_model_state_dict(broadcast_from_rank0=True)`
    streams them to each rank's shard, so no rank ever holds a full copy on its accelerator.
    Non-persistent buffers (e.g. rotary inv_freq) are not in a state dict: rank 0 sends them too.
    `weights_of(root)` is the submodule whose state dict `full_state_dict` is (the HF model inside a wrapper).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.device("meta"):
        model = build_meta()
    shard(model)
    model.to_empty(device=info.device)
    payload = [buffers]
    dist.broadcast_object_list(payload, src=0, device=info.device if info.device.type == "cuda" else None)
    named = dict(weights_of(model).named_buffers())
    with torch.no_grad():
        for name, value in payload[0].items():
            named[name].copy_(value.to(info.device))
    set_model_state_dict(
        weights_of(model),
        full_state_dict if info.is_main else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    return model


def non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, module in model.named_modules():
        for buf_name in getattr(module, "_non_persistent_buffers_set", ()):
            buf = getattr(module, buf_name, None)
            if buf is not None:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf.detach().cpu().clone()
    return out


def fsdp_shard(root: torch.nn.Module, layers, param_dtype: torch.dtype | None) -> None:
    """`fully_shard` per decoder layer, then the root; bf16 compute, fp32 gradient reduction.

    The root is the module whose forward the trainer calls (the two-stream wrapper), so FSDP
    gathers the embeddings, final norm and output head around that whole forward.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(root, mp_policy=mp)


def deepcopy_config(config):
    """`from_config` mutates the config it is given; always hand it a copy."""
    return copy.deepcopy(config)
