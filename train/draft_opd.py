"""Draft-OPD: on-policy training of self-spec drafts (the objective of arXiv 2605.29343, on our rows).

The student answers training prompts with the served self-spec decoder (`train/rollout.py`), which records
each verify of a draft chain (`DraftVerdict`). Those drafts came from a canvas of masks at the pending
token's place, seeing the committed answer before it; the training forward revisits exactly that canvas,
one noised view per verify (`train/trajectory.py`'s rows). The verifier's distribution at each drafted
position is the clean stream's row at that position over the committed answer, detached: with a draft
adapter the frozen base model the drafts are served against, otherwise the student's own AR head. Up to
and including the first rejected slot the committed answer *is* the draft chain before that slot, so that
row is exactly the distribution that judged the draft.

The loss, per verify: the forward KL(verifier || drafter) at every accepted slot (learn the verifier's
whole distribution where the chain held), the reverse KL(drafter || verifier) at the first rejected slot
(take the drafter's mass off what the verifier would not accept), nothing after it (the verifier never
judged those drafts). Its mean over the slots, the rejected ones weighted by `reject_weight`. With a
separate frozen teacher (`teacher_logp`), `ar_weight` times the KL(teacher || student) on the clean
stream's AR rows keeps a fine-tuned AR head on the teacher, as in diffusion OPD.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bdcore.decode.modes import CommitStep, DraftVerdict
from train.rollout import Rollout, collective_device
from train.rows import Sample
from train.trajectory import trajectory_rows

WALK_ROWS = 4096  # rows of one scoring forward of the walk (as the drafting metric's)


@dataclass
class DraftOPDParts:
    loss: torch.Tensor
    kl: torch.Tensor  # mean forward KL(verifier || drafter) over the accepted slots
    reverse_kl: torch.Tensor  # mean reverse KL(drafter || verifier) over the first rejected slots
    ar_kl: torch.Tensor  # mean KL(teacher || student) on the AR rows (0 without a teacher)
    accepted_slots: int
    rejected_slots: int


def verify_states(ro: Rollout, mask_id: int) -> tuple[list[CommitStep], list[bool]]:
    """Each recorded verify as the state a training forward revisits: its canvas of masks at `start`, scored
    at the accepted slots and the first rejected one (slot s predicts position start + s) inside the answer.
    Also, per scored slot in order, whether it is a rejected one."""
    P, n = len(ro.prompt_ids), len(ro.response)
    states, rejected = [], []
    for v in ro.verdicts:
        if v.canvas == 0:  # drafted by a seeded canvas (SGLang's split step), never by a rollout's engine
            raise ValueError("a seeded drafting canvas holds the pending token: not a state of masks to revisit")
        last = min(v.accepted + 1, v.verified)  # the first rejected slot, when one was rejected
        slots = [s for s in range(1, last + 1) if v.start + s < P + n]
        if slots:
            tokens = [ro.response[v.start + s - P] for s in slots]
            states.append(CommitStep(v.start, [mask_id] * v.canvas, slots, tokens, [0.0] * len(slots)))
            rejected += [s > v.accepted for s in slots]
    return states, rejected


def walk_verdicts(accepted: list[int], start: int, end: int, draft_len: int) -> list[DraftVerdict]:
    """The verifies greedy linear self-spec (`DecodeConfig(mode="self-spec")`: one canvas after the last clean
    row) makes along an answer at positions [start, end), replayed from the accepted prefix at every anchor
    (`bdcore.decode.policy.draft_quality.score_sample`): the prefill's canvas of N masks at the first answer position,
    then a verify at each anchor a; all N - 1 accepted leaves fresh drafts at a + N, a rejection a cold step
    whose canvas sits one place past the correction. The drafts themselves are not kept (empty)."""
    N, a, warm, out = draft_len, start, True, []
    while a < end - 1:
        if warm:
            k = accepted[a - start]
            out.append(DraftVerdict(a, N if a == start else N - 1, [], N - 1, k))
            warm = k == N - 1
            a += k + 1
        else:
            a, warm = a + 1, True
    return out


def walked_rollouts(runner, samples: list[Sample], *, mask_id: int, draft_len: int) -> list[Rollout]:
    """Self-spec rollouts without decoding: each sample's last answer, taken as what greedy self-spec
    commits, and the verifies it makes along it (`walk_verdicts`), from one scoring forward per sample. Exact
    where the answer is the verifier's own greedy answer (self-distilled data, a draft adapter's base); on
    other answers the same decoder's behaviour along that path. `runner`: a `ModelRunner` of the student."""
    from bdcore.decode.policy.draft_quality import canvas_forwards, score_sample

    out, forwards = [], 0
    for sample in samples:
        start, end = sample.spans[-1]
        ids = list(sample.input_ids[:end])
        scored = score_sample(runner, ids, start, mask_id=mask_id, draft_len=draft_len, max_rows=WALK_ROWS)
        forwards += len(canvas_forwards(ids, start, mask_id=mask_id, draft_len=draft_len, max_rows=WALK_ROWS))
        verdicts = walk_verdicts(scored.accepted, start, end, draft_len)
        out.append(Rollout(ids[:start], ids[start : end - 1], ids[end - 1], verdicts=verdicts))
    _lockstep(runner, forwards, mask_id)
    return out


def _lockstep(runner, forwards: int, mask_id: int) -> None:
    """Sharded ranks gather parameters in every forward, so each runs as many as the busiest: one-row
    stand-in forwards make up the difference (as `train.rollout.rollout` does)."""
    import torch.distributed as dist

    from bdcore.decode.rows import Forward, Rows
    from bdcore.decode.sequence import SequenceCache

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    most = torch.tensor([forwards], device=collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    for _ in range(int(most.item()) - forwards):
        runner.forward([(SequenceCache(), Forward(Rows().clean([mask_id], 0), 0))])


def _kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row; tokens where p has no mass contribute nothing. The difference is masked before the
    product: both sides are -inf at `<|mask|>`, and a nan there would reach the gradient of p."""
    p = p_logp.exp()
    return (p * torch.where(p > 0, p_logp - q_logp, torch.zeros_like(p))).sum(-1)


def draft_opd_loss(
    lm,
    rollouts: list[Rollout],
    *,
    mask_id: int,
    filler_id: int,
    reject_weight: float = 1.0,
    teacher_logp: list[torch.Tensor] | None = None,
    ar_weight: float = 0.0,
) -> DraftOPDParts:
    """The Draft-OPD objective on self-spec rollouts (`Rollout.verdicts`); `lm` is the trainer's `TwoStreamLM`
    with a causal clean stream. `teacher_logp`: per rollout a frozen teacher's [len(response), V] log-probs
    for the AR term (None: no AR term)."""
    if not lm.cfg.clean_causal:
        raise ValueError("Draft-OPD needs a causal clean stream: a block-causal clean row sees the token it verifies")
    states, rejected = [], []
    for ro in rollouts:
        steps, flags = verify_states(ro, mask_id)
        states.append(replace(ro, steps=steps))
        rejected += flags
    scored = trajectory_rows(states, block=lm.cfg.bd_size, filler_id=filler_id)
    device = next(lm.parameters()).device
    batch = scored.batch.to(device)
    T = batch.input_ids.shape[1]
    lengths = [len(ro.response) for ro in rollouts]
    # the clean row predicting answer token i of rollout r sits at position P - 1 + i of row r
    clean_row = [
        [r * T + len(ro.prompt_ids) - 1 + i for i in range(n)] for r, (ro, n) in enumerate(zip(rollouts, lengths))
    ]
    owner, index = scored.owner.tolist(), scored.index.tolist()
    verifier_rows = [clean_row[o][i] for o, i in zip(owner, index)]
    with_ar = teacher_logp is not None and ar_weight > 0
    ar_rows = [x for rows in clean_row for x in rows] if with_ar else []
    n = len(owner)
    rows = torch.tensor(scored.rows.tolist() + verifier_rows + ar_rows, dtype=torch.long, device=device)
    logits = lm(batch, rows=rows)
    logits[:, mask_id] = float("-inf")  # neither side ever emits <|mask|>
    logp = logits.log_softmax(-1)
    drafter, verifier = logp[:n], logp[n : 2 * n].detach()
    rejected = torch.tensor(rejected, dtype=torch.bool, device=device)
    forward = _kl(verifier, drafter)
    reverse = _kl(drafter, verifier)
    zero = logp.new_zeros(())
    n_rej = int(rejected.sum())
    n_acc = n - n_rej
    total = forward[~rejected].sum() + reject_weight * reverse[rejected].sum()
    loss = total / max(1, n)
    ar_kl = zero
    if with_ar:
        student_ar = logp[2 * n :]
        target = torch.cat(teacher_logp).to(device)
        ar_kl = _kl(target, student_ar[:, : target.shape[-1]]).mean()
        loss = loss + ar_weight * ar_kl
    return DraftOPDParts(
        loss,
        (forward[~rejected].mean() if n_acc else zero).detach(),
        (reverse[rejected].mean() if n_rej else zero).detach(),
        ar_kl.detach(),
        n_acc,
        n_rej,
    )
