"""A frozen draft adapter's fast path for serving (`prepare_serving`): what a decode step pays for drafting.

A decode step drafts a few rows, where the adapter's cost is a count of calls rather than their size:
SmolLM2-135M has 210 adapted projections, and at a few rows each of its torch calls costs microseconds of
dispatch whatever it computes (through the general path a drafting forward cost about a third more than a base
forward on a CPU).
So a served projection:
- runs its base layer's forward itself (no module call, no hooks: a served model has none);
- keeps the factors of a 16-bit model in fp32 (a CPU's bf16 matmul pays ~15 us a call at a few rows, fp32
  ~3; drafts only, the served tokens stay the base model's);
- keeps B as (scaling * B)^T, contiguous, so one `mm` and one in-place add over the drafting rows finish it
  (a slice where they are one run; gathered and put back where a batch scatters them);
- shares one A product with the projections that read the same input (`_InputGroup`: q/k/v, gate/up);
- drafts with the adapter cut to the singular directions that carry 99% of each term's energy
  (`truncate_adapter`, `DRAFT_ENERGY`): trained terms are far from full rank, and a CPU pays for bytes.

The rows and their meaning are `bdcore.draft_adapter`'s (`DraftGate.plan`): non-drafting rows are the base
projection's output bit for bit, drafting rows peft's LoRA to rounding. Forwards with gradients go through
the adapter's general forward (`_gated_lora_forward` sends them there).
"""

from __future__ import annotations

import copy

import torch

from bdcore.draft_adapter import ADAPTER_NAME, SERVED_ATTR, draft_gate, draft_rows

# The share of each LoRA term's energy a served draft adapter keeps (`truncate_adapter`). SmolLM2-135M's
# 30-minute adapter: 0.99 keeps 13.8 of 32 directions on average, drafts 1.556 tokens per forward on the
# held-out answers against 1.568 uncut, and its 8-row drafting forward costs 1.27x the base's against 1.36x.
DRAFT_ENERGY = 0.99


class _InputGroup:
    """The adapted projections that read the same input (q/k/v, gate/up; `_shared_inputs`): their A factors
    side by side, so that a drafting forward computes one low-rank product for them all. The product is reused
    only for the very tensor and drafting rows it was computed from (inference tensors keep no version
    counter; a layer's input is not written between its projections; the gate's plan hands every projection
    of a forward the same rows object): a member handed another input computes it afresh."""

    def __init__(self, a: torch.Tensor):
        self.a = a  # [in, sum of ranks]
        self._x, self._where, self._h = None, None, None

    def product(self, x: torch.Tensor, where: slice | torch.Tensor) -> torch.Tensor:
        """The A product at the drafting rows `where` of x's flattened rows: one run (a slice) or scattered
        (flat indices: a batch's sequences each draft after their own clean rows)."""
        if self._x is not x or self._where is not where:
            flat = x.reshape(-1, x.shape[-1])
            picked = flat[where] if isinstance(where, slice) else flat.index_select(0, where)
            self._h = torch.mm(picked.to(self.a.dtype), self.a)
            self._x, self._where = x, where  # holding x: no other tensor can take its identity meanwhile
        return self._h


class _ServedProjection:
    """One adapted projection's served forward (`_gated_lora_forward` hands it the call)."""

    def __init__(self, module, group: _InputGroup, columns: slice, b: torch.Tensor):
        self.base = module.base_layer  # its own forward: a packed one (`bdcore.decode.packed_linear`) where packed
        self.group, self.columns, self.b = group, columns, b

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        result = self.base.forward(x)
        kind, index, run = draft_gate(module).plan(x.shape)
        if kind == "none":
            return result
        delta = torch.mm(self.group.product(x, run if run is not None else index)[:, self.columns], self.b)
        flat = result.view(-1, result.shape[-1])
        if run is not None:  # one run of rows: added in place, no gather and no scatter
            flat[run].add_(delta)
            return result
        # A batch's scattered drafting rows (each sequence's canvases follow its own clean rows): gathered,
        # added to in the result's dtype as the run is, put back. The general path here (the full LoRA in
        # the model's dtype, an out-of-place scatter) doubled a batch of 2's forward.
        rows = flat.index_select(0, index)
        rows.add_(delta)
        flat.index_copy_(0, index, rows)
        return result


def prepare_serving(model) -> None:
    """Give every adapted projection of a frozen draft-adapter model its served path (see the module doc). The
    trained weights are left as they are, so the adapter still saves and merges as peft's; call it again after
    they change. Directions whose A row or B column is zero (`truncate_adapter`'s cut) are left out."""
    adapted = [
        m
        for m in model.modules()
        if hasattr(m, "lora_A")
        and ADAPTER_NAME in m.lora_A
        and draft_gate(m) is not None
        and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)
        and m.lora_B[ADAPTER_NAME].bias is None
    ]
    for members in _shared_inputs(model, adapted):
        dtype = members[0].lora_A[ADAPTER_NAME].weight.dtype
        dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        factors = []
        for m in members:
            a, b = m.lora_A[ADAPTER_NAME].weight.detach(), m.lora_B[ADAPTER_NAME].weight.detach()
            live = (a != 0).any(1) & (b != 0).any(0)  # a direction with a zero factor adds exactly nothing
            factors.append((a[live].to(dtype), (b[:, live].to(dtype) * m.scaling[ADAPTER_NAME]).t().contiguous()))
        group = _InputGroup(torch.cat([a for a, _ in factors]).t().contiguous())
        start = 0
        for m, (a, b) in zip(members, factors):
            served = _ServedProjection(m, group, slice(start, start + a.shape[0]), b)
            object.__setattr__(m, SERVED_ATTR, served)  # not a submodule: no state-dict entry
            start += a.shape[0]


class _DraftingProjection(torch.nn.Module):
    """An adapted projection in a drafting twin (`DraftingTwin`): the base layer at every row plus the served
    LoRA term times the row's gate (1 at drafting rows, 0 elsewhere). It computes the term at every row of the
    forward, which costs nothing that matters at a decode step's few rows, so the forward holds no
    data-dependent branch or index and compiles into one graph; a non-drafting row adds an exact zero, so it
    is the base projection's output (to the compiled forward's own rounding, as a compiled causal step is)."""

    def __init__(self, served: _ServedProjection, gate: torch.Tensor):
        super().__init__()
        self.base = served.base
        a = served.group.a[:, served.columns].contiguous()
        self.register_buffer("a", a, persistent=False)  # [in, r]
        self.register_buffer("b", served.b, persistent=False)  # [r, out], scaled
        self.register_buffer("gate", gate, persistent=False)  # one tensor shared by every projection of the twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        flat = x.reshape(-1, x.shape[-1])
        delta = torch.mm(torch.mm(flat.to(self.a.dtype), self.a), self.b) * self.gate[: flat.shape[0]]
        return torch.add(result, delta.view_as(result)).to(result.dtype)  # added in the factors' dtype, as served


class DraftingTwin:
    """A served draft-adapter model's module tree for compiled drafting forwards: each adapted projection's place
    taken by a `_DraftingProjection` over its served factors, every other module shared with the model (as
    `base_twin`). Which rows draft is a tensor the twin's projections read (`gate`, written by `set_rows`
    before each forward), not the Python-side plan of the served path, so the compiler sees one graph whatever
    rows draft. A forward of more rows than the gate holds runs the model itself (`set_rows` says False)."""

    ROWS = 4096  # rows (batch x rows) a drafting forward may have; a decode step's are tens

    def __init__(self, model):
        projections = [m for m in model.modules() if m.__dict__.get(SERVED_ATTR) is not None]
        if not projections:
            raise ValueError("a drafting twin needs a served draft adapter: call prepare_serving(model) first")
        first = projections[0].__dict__[SERVED_ATTR]
        self.gate = torch.zeros(self.ROWS, 1, dtype=first.b.dtype, device=first.b.device)
        self.module = _tree_with(model, lambda m: _DraftingProjection(m.__dict__[SERVED_ATTR], self.gate))

    def set_rows(self, rows: torch.Tensor) -> bool:
        """Gate the next forward's rows (bool [B, Q]); False where it has more rows than the gate holds."""
        n = rows.numel()
        if n > self.ROWS:
            return False
        self.gate[:n, 0] = rows.reshape(-1)
        return True


def _tree_with(model, replace):
    """`model`'s module tree with each adapted projection (a served one, or with `replace` None any LoRA one)
    replaced by `replace(module)`, or by its base layer where `replace` is None; every other module a shallow
    copy sharing its parameters, buffers and hooks."""

    def twin(module):
        if hasattr(module, "lora_A") and ADAPTER_NAME in module.lora_A and hasattr(module, "base_layer"):
            if replace is None:
                return module.base_layer
            if module.__dict__.get(SERVED_ATTR) is not None:
                return replace(module)
        clone = copy.copy(module)  # shares the parameter, buffer and hook dicts
        clone._modules = {name: None if child is None else twin(child) for name, child in module._modules.items()}
        return clone

    return twin(model)


def is_served(model) -> bool:
    """Whether `prepare_serving` gave `model`'s adapted projections their served path."""
    return any(m.__dict__.get(SERVED_ATTR) is not None for m in model.modules())


def base_twin(model):
    """`model`'s module tree with each adapted projection's place taken by its base layer, sharing every
    parameter, buffer and hook (only the tree is new): a forward in which no row drafts (a causal step, a
    verify-only step) runs the base model's own modules, without the adapter's dispatch at each of its
    projections (about 7% of a small model's decode step on a CPU). It computes what the
    gated model computes there bit for bit: its non-drafting rows are the base projection's output. Methods
    bound to a module instance (the gated-delta layers' decode forward) still name the original: bind them
    to the twin's modules again."""

    return _tree_with(model, None)


def truncate_adapter(model, energy: float) -> dict[str, int]:
    """Cut every adapted projection's LoRA term to the fewest singular directions that keep `energy` of its
    squared Frobenius norm (B @ A = U S V^T; A, B <- sqrt(S) V^T, U sqrt(S) over the kept directions, the rest
    zero, so peft's shapes and files stay as they were). A trained adapter's terms are far from full
    rank (SmolLM2-135M, rank 32: 8 directions keep 95-99% of the energy), and on a CPU a drafting forward pays
    for its factors' bytes. Returns each projection's kept rank. 1.0 keeps the adapter as it is."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy {energy}: a share of the LoRA term's energy in (0, 1]")
    kept = {}
    for name, m in model.named_modules():
        if not (hasattr(m, "lora_A") and ADAPTER_NAME in m.lora_A) or energy == 1.0:
            continue
        a, b = m.lora_A[ADAPTER_NAME].weight, m.lora_B[ADAPTER_NAME].weight
        term = b.detach().double() @ a.detach().double()
        # the loaders refuse non-finite adapter files (`check_draft_adapter`); a model trained in-process may hold one
        if not torch.isfinite(term).all():
            raise ValueError(f"{name}: the LoRA term holds non-finite values; a draft adapter must be finite to serve")
        u, s, vh = torch.linalg.svd(term, full_matrices=False)
        share = (s**2).cumsum(0) / (s**2).sum().clamp_min(1e-300)
        r = min(int((share < energy).sum()) + 1, a.shape[0])
        root = s[:r].sqrt()
        with torch.no_grad():
            a.zero_()[:r] = (root[:, None] * vh[:r]).to(a.dtype)
            b.zero_()[:, :r] = (u[:, :r] * root).to(b.dtype)
        kept[name] = r
    return kept


def _shared_inputs(model, adapted: list) -> list[list]:
    """`adapted` split into the projections that read one tensor in a forward of two tokens (q/k/v; gate/up),
    found by watching one: which projections share an input is the model's code, not their names. A projection
    the probe does not reach (an expert no token was routed to) is a group alone."""
    seen: dict[int, list] = {}
    inputs = []  # kept alive, so that no two inputs share an id

    def watch(module, args):
        inputs.append(args[0])
        seen.setdefault(id(args[0]), []).append(module)

    hooks = [m.register_forward_pre_hook(watch) for m in adapted]
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.inference_mode(), draft_rows(model, torch.zeros_like(ids, dtype=torch.bool)):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    groups = [g for g in seen.values() if len({m.in_features for m in g}) == 1]
    reached = {id(m) for g in groups for m in g}
    return groups + [[m] for m in adapted if id(m) not in reached]
