"""On-policy distillation (OPD) from the frozen AR teacher.

One OPD step: the student decodes prompts in diffusion mode as the server would (`train/rollout.py`),
recording every commit and the canvas it came from; the frozen teacher reads [prompt, answer] causally
once, and its next-token distribution at each answer position is the target; the student's training
forward (`train/trajectory.py`: one view per revisited canvas) gives its distribution for each slot in
the state it was committed from. The loss is the forward KL(teacher || student) at the slots committed
in the chosen states (by default one realized step per block, drawn at random), or with `slots="masked"`
at every slot each chosen state still masked (the student's distribution for a slot it commits later,
against the teacher's for the token that slot finally holds: the same dense signal a masked-diffusion
SFT row gives, on states the student visits, with soft targets), plus `ar_weight` times
the same KL on the clean stream's AR rows over the whole answer (keeps the AR head, which verifies
self-spec drafts, on the teacher). The rollout and the teacher run under no-grad: gradients reach the
student only through its training forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from train.rollout import Rollout
from train.rows import Sample
from train.trajectory import ScoredRows, trajectory_rows


@dataclass
class OPDParts:
    loss: torch.Tensor
    kl: torch.Tensor  # mean KL(teacher || student) over the revisited slots
    ar_kl: torch.Tensor  # mean KL on the clean stream's AR rows over the answers
    kl_tokens: int
    ar_tokens: int
    teacher_logp: list[torch.Tensor]  # the targets used, per rollout [len(response), V]


def prompt_of(sample: Sample) -> list[int]:
    """The context of a sample's last supervised turn: what the student answers in a rollout."""
    return list(sample.input_ids[: sample.spans[-1][0]])


def choose_states(ro: Rollout, per_block: int, generator: torch.Generator) -> Rollout:
    """Keep `per_block` of each block's canvas states, drawn at random (0: keep all); seeds stay (they are
    scored on the clean stream)."""
    if per_block <= 0:
        return ro
    by_block: dict[int, list[int]] = {}
    for i, step in enumerate(ro.steps):
        if step.canvas is not None:
            by_block.setdefault(step.start, []).append(i)
    keep = {i for i, step in enumerate(ro.steps) if step.canvas is None}
    for steps in by_block.values():
        order = torch.randperm(len(steps), generator=generator).tolist()
        keep |= {steps[j] for j in order[:per_block]}
    return replace(ro, steps=[s for i, s in enumerate(ro.steps) if i in keep])


@torch.no_grad()
def teacher_logprobs(teacher, rollouts: list[Rollout], *, mask_id: int) -> list[torch.Tensor]:
    """Per rollout, the teacher's next-token log-distribution at each answer position [len(response), V_t]
    (row j predicts answer token j), from one causal forward over [prompt, answer]."""
    device = next(teacher.parameters()).device
    out = []
    for ro in rollouts:
        ids = torch.tensor([ro.prompt_ids + ro.response], device=device)
        logits = teacher(input_ids=ids).logits[0].float()
        if mask_id < logits.shape[-1]:  # the student never emits <|mask|>; neither does its target
            logits[:, mask_id] = float("-inf")
        P = len(ro.prompt_ids)
        out.append(logits[P - 1 : P - 1 + len(ro.response)].log_softmax(-1))
    return out


def _kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row over the teacher's vocabulary (the student's may be longer)."""
    s = student_logp[:, : teacher_logp.shape[-1]]
    p = teacher_logp.exp()
    terms = torch.where(p > 0, p * (teacher_logp - s), torch.zeros_like(p))
    return terms.sum(-1)


SLOTS = ("committed", "masked")


def masked_slots(rollouts: list[Rollout], scored: ScoredRows, mask_id: int) -> tuple[torch.Tensor, ...]:
    """Every slot a recorded canvas still masked (the seed slot, predicted by an AR row, aside) inside the
    answer: (row scoring it, rollout, place in that rollout's response)."""
    rows, owner, index = [], [], []
    firsts = iter(scored.canvas_first)
    for r, ro in enumerate(rollouts):
        P, n = len(ro.prompt_ids), len(ro.response)
        for step in ro.steps:
            if step.canvas is None:
                continue
            first = next(firsts)
            for s in range(1, len(step.canvas)):
                if step.canvas[s] == mask_id and step.start + s - P < n:
                    rows.append(first + s), owner.append(r), index.append(step.start + s - P)
    return tuple(torch.tensor(x, dtype=torch.long) for x in (rows, owner, index))


def opd_loss(
    lm,
    rollouts: list[Rollout],
    teacher_logp: list[torch.Tensor] | None,
    *,
    mask_id: int,
    filler_id: int,
    ar_weight: float,
    slots: str = "committed",
) -> OPDParts:
    """The OPD objective on rollouts whose `steps` are the states to revisit (see `choose_states`).
    `teacher_logp` None: the student's own clean stream is the teacher (a draft-only adapter, whose clean
    stream is the frozen base model): the AR rows of this same forward, detached, give the targets."""
    if slots not in SLOTS:
        raise ValueError(f"slots must be one of {SLOTS}, got {slots!r}")
    scored = trajectory_rows(rollouts, block=lm.cfg.bd_size, filler_id=filler_id)
    device = next(lm.parameters()).device
    batch = scored.batch.to(device)
    T = batch.input_ids.shape[1]
    if slots == "masked":
        canvas_rows, canvas_owner, canvas_index = masked_slots(rollouts, scored, mask_id)
    else:
        canvas_rows = scored.rows[scored.from_canvas]
        canvas_owner, canvas_index = scored.owner[scored.from_canvas], scored.index[scored.from_canvas]
    ar_rows, ar_owner, ar_pos = [], [], []
    for r, ro in enumerate(rollouts):
        P = len(ro.prompt_ids)
        ar_rows += [r * T + P - 1 + j for j in range(len(ro.response))]
        ar_owner += [r] * len(ro.response)
        ar_pos += list(range(len(ro.response)))
    rows = torch.cat([canvas_rows, torch.tensor(ar_rows, dtype=torch.long)]).to(device)
    logits = lm(batch, rows=rows)
    logits[:, mask_id] = float("-inf")
    student = logits.log_softmax(-1)
    n_kl = int(canvas_rows.numel())
    if teacher_logp is None:
        teacher_logp = list(student[n_kl:].detach().split([len(ro.response) for ro in rollouts]))
    owner = torch.cat([canvas_owner, torch.tensor(ar_owner, dtype=torch.long)])
    index = torch.cat([canvas_index, torch.tensor(ar_pos, dtype=torch.long)])
    target = torch.stack([teacher_logp[o][i] for o, i in zip(owner.tolist(), index.tolist())]) if len(owner) else None
    kls = _kl(target.to(device), student) if target is not None else student.new_zeros(0)
    kl, ar_kl = kls[:n_kl], kls[n_kl:]
    kl_mean = kl.mean() if n_kl else kls.new_zeros(())
    ar_mean = ar_kl.mean() if ar_kl.numel() else kls.new_zeros(())
    loss = kl_mean + ar_weight * ar_mean
    return OPDParts(loss, kl_mean.detach(), ar_mean.detach(), n_kl, int(ar_kl.numel()), teacher_logp)
