"""GRPO with DAPO's options, over block-diffusion trajectories (`train.py --recipe rl`).

Every prompt is rolled out `group_size` times; a rollout's advantage is its reward minus its group's mean,
divided by the group's standard deviation (GRPO; `scale=False` keeps the plain difference). Dynamic
sampling (DAPO) drops groups whose rewards are all equal: their advantages are zero and they would only
dilute the batch. The policy loss is the clipped surrogate per committed token,

    -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A),   ratio = exp(logp_new - logp_old),

where a token's log-probability is `train.trajectory.trajectory_logprobs` (the student's probability of the
token in the state it was committed from) for the new policy and the old one alike, so on the first
update of a rollout batch the ratio is exactly 1. DAPO's clip-higher is `clip_high > clip_low`; its
token-level normalisation averages over every token of the batch (`token_level=True`), GRPO's averages
each trajectory's tokens first, then the trajectories; under data parallelism the batch is every rank's
(`global_norm`), as the SFT losses are normalised. An optional KL to a frozen reference policy (the
k3 estimator, per token) is added with `kl_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """[G * n] rewards, consecutive groups of `group_size` -> advantages of the same shape."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True, unbiased=False) + eps)
    return adv.flatten().float()


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G * n] bool: the rollouts of groups whose rewards are not all equal (DAPO's dynamic sampling)."""
    r = rewards.view(-1, group_size)
    varied = (r != r[:, :1]).any(1)
    return varied.repeat_interleave(group_size)


def select_rollouts(rewards: torch.Tensor, group_size: int, *, dynamic: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Which rollouts a batch scores, their advantages, and how many groups were kept. With `dynamic`
    (DAPO's dynamic sampling) only groups whose rewards differ; if none does, the first group (all of its
    advantages zero), so that every rank still runs the same forwards."""
    advantages = group_advantages(rewards, group_size)
    keep = varied_groups(rewards, group_size) if dynamic else torch.ones(rewards.numel(), dtype=torch.bool)
    groups_kept = int(keep.sum()) // group_size
    if not keep.any():
        keep[:group_size] = True
    return keep, advantages[keep], groups_kept


def global_norm(new_logp: list[torch.Tensor], *, token_level: bool) -> float:
    """`policy_loss`'s `norm` under data parallelism: the tokens (token-level) or trajectories of every rank's
    batch, divided by the world size. Each rank's loss is then its share of the global mean, and the
    average of gradients over ranks (FSDP's reduce) is the gradient of that mean: a rank with short answers
    does not weigh its tokens more. Collective when a process group is up."""
    local = sum(x.numel() for x in new_logp) if token_level else len(new_logp)
    if not (dist.is_available() and dist.is_initialized()):
        return float(local)
    device = new_logp[0].device if new_logp else torch.device("cpu")
    total = torch.tensor([float(local)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    policy: torch.Tensor  # the surrogate term (detached)
    kl: torch.Tensor  # mean k3 KL to the reference (detached; 0 without one)
    clip_fraction: float  # share of tokens whose ratio was clipped against their advantage's sign
    ratio_mean: float
    tokens: int


def policy_loss(
    new_logp: list[torch.Tensor],
    old_logp: list[torch.Tensor],
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_level: bool,
    ref_logp: list[torch.Tensor] | None = None,
    kl_weight: float = 0.0,
    norm: float | None = None,
) -> PolicyLoss:
    """The clipped surrogate (plus `kl_weight` x KL to the reference) over trajectories; `new_logp` carries
    the gradient, `old_logp` and `ref_logp` must not (they are detached here all the same). `norm`: what
    the mean divides by (`global_norm`: the whole batch's tokens or trajectories over all ranks, per rank);
    None: this call's own count."""
    if not new_logp:
        raise ValueError("no trajectories to score")
    surrogate, kls, clipped, ratios = [], [], 0, []
    use_kl = ref_logp is not None and kl_weight > 0
    for i, (new, old) in enumerate(zip(new_logp, old_logp)):
        ratio = torch.exp(new - old.detach())
        adv = advantages[i].to(new.device)
        bounded = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        surrogate.append(-torch.minimum(ratio * adv, bounded * adv))
        if use_kl:
            delta = ref_logp[i].detach() - new
            kls.append(torch.exp(delta) - delta - 1.0)
        clipped += int(((ratio * adv) > (bounded * adv)).sum())
        ratios.append(ratio.detach())
    n = sum(t.numel() for t in surrogate)
    if norm is None:
        norm = n if token_level else len(surrogate)

    def mean(terms: list[torch.Tensor]) -> torch.Tensor:
        if token_level:  # DAPO: every token of the batch weighs the same
            return torch.cat(terms).sum() / max(norm, 1e-12)
        per_trajectory = torch.stack([t.mean() if t.numel() else t.sum() for t in terms])  # GRPO
        return per_trajectory.sum() / max(norm, 1e-12)

    policy = mean(surrogate)
    kl = mean(kls) if use_kl else torch.zeros((), device=policy.device)
    loss = policy + kl_weight * kl if use_kl else policy
    ratio_mean = float(torch.cat(ratios).mean()) if n else 1.0
    return PolicyLoss(loss, policy.detach(), kl.detach(), clipped / max(1, n), ratio_mean, n)
