"""torchrun --nproc_per_node=2 tests/distributed/rl_loss_norm.py OUT: the RL policy loss under FSDP2 with
rollouts of different lengths on each rank has the gradient of the one-rank loss over all rollouts
(tests/test_rl_loss_norm.py runs it). Rank 0 writes the largest gradient difference per case to OUT."""

import copy
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from train.grpo import global_norm, policy_loss

VOCAB, WIDTH = 11, 8


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB))


def rollouts():
    """Six trajectories (token ids, advantage, old-policy offset): rank 0 gets two short answers, rank 1 four
    long ones (dynamic sampling keeps different numbers of groups per rank)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [2, 3, 12, 17, 23, 19]
    return [
        (torch.randint(VOCAB, (n + 1,), generator=gen), float(torch.randn((), generator=gen)), 0.3 * (i % 3 - 1))
        for i, n in enumerate(lengths)
    ]


def logp(net, ids):
    return net(ids[:-1]).log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def loss_of(net, trajs, *, token_level, distributed):
    new = [logp(net, ids) for ids, _, _ in trajs]
    old = [x.detach() + offset for x, (_, _, offset) in zip(new, trajs)]
    advantages = torch.tensor([a for _, a, _ in trajs])
    norm = global_norm(new, token_level=token_level) if distributed else None
    ref = [x.detach() - 0.1 for x in new]
    return policy_loss(
        new,
        old,
        advantages,
        clip_low=0.2,
        clip_high=0.28,
        token_level=token_level,
        ref_logp=ref,
        kl_weight=0.5,
        norm=norm,
    ).loss


def largest_difference(trajs, mine, *, token_level: bool) -> float:
    reference = model()
    loss_of(reference, trajs, token_level=token_level, distributed=False).backward()
    sharded = copy.deepcopy(model())
    fully_shard(sharded)
    loss_of(sharded, mine, token_level=token_level, distributed=True).backward()
    grads = [p.grad.full_tensor() for p in sharded.parameters()]
    return max(float((g - p.grad).abs().max()) for g, p in zip(grads, reference.parameters()))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trajs = rollouts()
    mine = trajs[:2] if rank == 0 else trajs[2:]
    result = {
        "token": largest_difference(trajs, mine, token_level=True),
        "trajectory": largest_difference(trajs, mine, token_level=False),
    }
    # FSDP's modules sit in reference cycles: collect them (and the gloo work their gradients hold) while the
    # process group is alive
    gc.collect()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's teardown at interpreter exit aborts now and then on a loaded machine ("terminate called without an
    # active exception", SIGABRT after destroy_process_group had returned: CI, and 3 of about 70 runs here with
    # 8 ranks on 2 cores); the result is written and every rank is past the barrier, so leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
