"""LoRA conversion, and the draft-only adapter (docs/design.md section 8.13): one definition of where it acts.

A conversion may train LoRA adapters (peft) on the decoder layers' linear projections instead of every
weight, plus the `<|mask|>` embedding row alone (a parameter of its own on the input embedding, swapped in
where the input is `<|mask|>`; peft's trainable tokens would also tie a copy into a tied output layer,
which FSDP2 cannot load, and the output row of `<|mask|>` is never used: it is banned from every output).

A **draft-only** adapter is
switched on per row: its contribution is added only at rows that draft (the training row's noised views,
the engine's canvas rows) and is exactly zero at every other row (prompt, committed and verified
tokens, the clean stream). Those rows therefore run the base weights bit for bit, so the AR head, causal
decoding and self-spec verification are the original model's, and self-spec is lossless against it.

The switch is the adapted projections' own forward (`_gated_lora_forward`): the base projection at every
row, and the low-rank product only at the forward's drafting rows (gathered, multiplied, added back), so a
forward with no drafting row (causal decoding, verification, the trainer's clean pass) costs what the base
model's does, and one with a few (a self-spec step) pays the adapter for those rows only. Every forward of a
model with a draft adapter must say which rows draft (`draft_rows`), so that no caller can forget it
silently.

peft is used as made (`inject_adapter_in_model`, its state-dict helpers and adapter directory format),
so a draft adapter directory is a stock peft LoRA adapter over the stock base checkpoint, plus
`mask_row.safetensors`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ADAPTER_DIR = "draft_adapter"  # a stock peft adapter directory inside a draft-adapter checkpoint
ADAPTER_NAME = "default"
GATE_ATTR = "_bd_draft_gate"
SERVED_ATTR = "_bd_served"  # a served model's prepared drafting path (bdcore/draft_adapter_serving.py)
MASK_ROW = "bd_mask_row"  # the trained <|mask|> input row: a parameter of the input embedding module
MASK_ROW_FILE = "mask_row.safetensors"
MASK_ID_ATTR = "_bd_mask_id"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: str = "all-linear"  # peft target_modules: "all-linear" or comma-separated module names
    draft_only: bool = True

    def lora_config(self, mask_id: int):
        from peft import LoraConfig

        targets = self.targets if self.targets == "all-linear" else [t for t in self.targets.split(",") if t]
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=targets,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DraftGate:
    """The per-row switch of a draft-only adapter. `rows` is a bool [B, T] for the current forward."""

    def __init__(self):
        self._rows: torch.Tensor | None = None
        self.batch_row: int | None = None  # set while a layer runs one batch row alone (hybrid decode)
        self._plans: dict = {}

    @property
    def rows(self) -> torch.Tensor | None:
        return self._rows

    @rows.setter
    def rows(self, value: torch.Tensor | None) -> None:
        self._rows, self._plans = value, {}

    def plan(self, shape: torch.Size) -> tuple[str, torch.Tensor | None, slice | None]:
        """How a LoRA input of `shape` is gated: ("none" | "all" | "some", flat indices of its drafting rows
        ("some", "none"), the drafting rows as a slice where they are one run ("all", "some")). Worked out once
        per forward and input shape: every adapted projection shares it."""
        key = (tuple(shape[:-1]), self.batch_row)
        if key not in self._plans:
            rows = self._rows_for(shape[:-1])
            if not rows.any():
                self._plans[key] = ("none", rows.reshape(-1).nonzero().squeeze(1), None)
            elif rows.all():
                self._plans[key] = ("all", None, slice(0, rows.numel()))
            else:
                index = rows.reshape(-1).nonzero().squeeze(1)
                first, n = int(index[0]), index.numel()
                # one run of rows (a batch of one: its canvases follow its clean rows): a slice, which costs
                # no gather and no scatter
                run = int(index[-1]) - first + 1 == n
                self._plans[key] = ("some", index, slice(first, first + n) if run else None)
        return self._plans[key]

    def _rows_for(self, lead: torch.Size) -> torch.Tensor:
        rows = self._rows
        if rows is None:
            raise RuntimeError(
                "a model with a draft-only adapter ran without saying which rows draft; wrap the forward in "
                "bdcore.draft_adapter.draft_rows(model, rows)"
            )
        if tuple(lead) == tuple(rows.shape):
            return rows
        if self.batch_row is not None and len(lead) == 1:  # one batch row's rows, [Q, F]
            return rows[self.batch_row, : lead[0]]
        if lead.numel() == rows.numel():  # the layer flattened [B, T] to [B * T]
            return rows.reshape(lead)
        raise RuntimeError(f"draft gate of shape {tuple(rows.shape)} does not fit LoRA input rows {tuple(lead)}")


def _gated_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A draft-only adapter's projection: the base layer at every row, plus the LoRA term at drafting rows
    only. Non-drafting rows are the base layer's output itself (no term times zero), drafting rows are what
    peft's own forward computes there (its LoRA is vanilla, without dropout: `LoraSpec`)."""
    served = self.__dict__.get(SERVED_ATTR)
    if served is not None and not args and not kwargs and not torch.is_grad_enabled():
        return served(self, x)  # a served model's own path (bdcore/draft_adapter_serving.py)
    return general_forward(self, x, *args, **kwargs)


def general_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`_gated_lora_forward` for every forward (training, rollouts of a live adapter) but a served one's."""
    result = self.base_layer(x, *args, **kwargs)
    kind, index, run = draft_gate(self).plan(x.shape)
    grad = torch.is_grad_enabled()
    if kind == "none" and not grad:
        return result
    lora_a, lora_b = self.lora_A[ADAPTER_NAME], self.lora_B[ADAPTER_NAME]
    scale = self.scaling[ADAPTER_NAME]
    x = self._cast_input_dtype(x, lora_a.weight.dtype)
    if kind == "all":
        return (result + lora_b(lora_a(x)) * scale).to(result.dtype)
    flat, x = result.reshape(-1, result.shape[-1]), x.reshape(-1, x.shape[-1])
    # "some", or "none" under grad: the empty product keeps the adapter's gradients defined (zeros), as
    # data-parallel reduction expects of every trainable parameter
    delta = lora_b(lora_a(x.index_select(0, index))) * scale
    return flat.index_add(0, index, delta.to(flat.dtype)).view_as(result)


_GATED_CLASSES: dict[type, type] = {}


def _gate_lora_layer(module) -> None:
    """Give one peft LoRA linear layer the gated forward (a subclass, so that copies and FSDP keep it)."""
    from peft.tuners.lora.layer import Linear

    if not isinstance(module, Linear):
        raise NotImplementedError(f"a draft-only adapter on {type(module).__name__}: only linear projections")
    cls = type(module)
    if cls in _GATED_CLASSES.values():
        return
    if cls not in _GATED_CLASSES:  # a named module-level class, so that a pickled model finds it
        name = f"DraftGated{cls.__name__}"
        gated = type(name, (cls,), {"forward": _gated_lora_forward, "__module__": __name__})
        _GATED_CLASSES[cls] = globals()[name] = gated
    module.__class__ = _GATED_CLASSES[cls]


class _SwapMaskRow:
    """Forward hook of the input embedding: rows whose input is `<|mask|>` take the trained row."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id

    def __call__(self, module, args, out):
        row = getattr(module, MASK_ROW)
        return torch.where((args[0] == self.mask_id)[..., None], row.to(out.dtype), out)


def attach_mask_row(embed: torch.nn.Module, row: torch.Tensor, mask_id: int) -> None:
    """Serve a frozen trained `<|mask|>` row on an input embedding module that has none (the vLLM plugin's
    embedding): the same swap as a trained adapter's (`_SwapMaskRow`), the row a buffer outside the state
    dict (the module's own weights load as they are)."""
    embed.register_buffer(MASK_ROW, row.detach().clone(), persistent=False)
    embed.register_forward_hook(_SwapMaskRow(mask_id))


def add_lora(model, spec: LoraSpec, mask_id: int):
    """Inject the LoRA adapters and the trainable `<|mask|>` row into `model` in place; only they train.
    A draft-only adapter also gets its gate. Returns the model."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(spec.lora_config(mask_id), model, adapter_name=ADAPTER_NAME)
    embed = model.get_input_embeddings()
    embed.register_parameter(MASK_ROW, torch.nn.Parameter(embed.weight.detach()[mask_id].clone()))
    embed.register_forward_hook(_SwapMaskRow(mask_id))
    object.__setattr__(embed, MASK_ID_ATTR, mask_id)
    if spec.draft_only:
        gate = DraftGate()
        for module in model.modules():  # the model and every layer can find it
            object.__setattr__(module, GATE_ATTR, gate)
            if hasattr(module, "lora_A") and ADAPTER_NAME in module.lora_A:
                _gate_lora_layer(module)
    return model


def draft_gate(module) -> DraftGate | None:
    return getattr(module, GATE_ATTR, None)


@contextmanager
def _gate_set(module, field: str, value):
    gate = draft_gate(module)
    if gate is None:  # no draft adapter: nothing to switch
        yield
        return
    previous = getattr(gate, field)
    setattr(gate, field, value)
    try:
        yield
    finally:
        setattr(gate, field, previous)


def draft_rows(model, rows: torch.Tensor):
    """Run forwards of `model` with the draft adapter on at `rows` (bool [B, T]) only; a no-op for a model
    without a draft adapter."""
    return _gate_set(model, "rows", rows)


def recompute_context(model):
    """`context_fn` for non-reentrant activation checkpointing (`torch.utils.checkpoint`): a layer that
    backward recomputes runs with the gate its forward ran with. The `draft_rows` context has exited by
    then; without this the recomputed adapter would not know which rows draft."""
    gate = draft_gate(model)

    def context_fn():
        if gate is None:
            return nullcontext(), nullcontext()
        return nullcontext(), _gate_as(gate, gate.rows, gate.batch_row)  # read now, at the forward

    return context_fn


@contextmanager
def _gate_as(gate: DraftGate, rows, batch_row):
    previous = gate.rows, gate.batch_row
    gate.rows, gate.batch_row = rows, batch_row
    try:
        yield
    finally:
        gate.rows, gate.batch_row = previous


def one_batch_row(module, b: int):
    """A layer that runs batch row `b` alone (the hybrid decode path) gates its projections by that row."""
    return _gate_set(module, "batch_row", b)


def has_lora(model) -> bool:
    return hasattr(model, "peft_config")


def _mask_row_key(model) -> str:
    return f"{_key_of(model, model.get_input_embeddings())}.{MASK_ROW}"


def base_state_dict(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's own weights from the state dict of a model with LoRA injected (peft keeps them as
    `<module>.base_layer.weight`)."""
    return {k.replace(".base_layer", ""): v for k, v in full.items() if "lora_" not in k and MASK_ROW not in k}


def merged_state_dict(model, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain LoRA conversion as stock weights: every adapted projection's weight plus its LoRA delta, the
    `<|mask|>` row from the trainable tokens (what peft's merge would give; the deltas come from peft)."""
    merged = base_state_dict(full)
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A") and ADAPTER_NAME in module.lora_A:
            a, b = full[f"{name}.lora_A.{ADAPTER_NAME}.weight"], full[f"{name}.lora_B.{ADAPTER_NAME}.weight"]
            scale = module.scaling[ADAPTER_NAME]
            key = f"{name}.weight"
            merged[key] = (merged[key].float() + (b.float() @ a.float()) * scale).to(merged[key].dtype)
    row_key = _mask_row_key(model)
    key = row_key[: -len(MASK_ROW)] + "weight"
    embed, out = model.get_input_embeddings(), model.get_output_embeddings()
    weight = merged[key].clone()
    weight[getattr(embed, MASK_ID_ATTR)] = full[row_key].to(weight.dtype)
    merged[key] = weight
    if out is not None and out.weight is embed.weight:  # tied: the output row of <|mask|> (banned) moves too
        merged[_key_of(model, out) + ".weight"] = weight
    return merged


def _key_of(model, target) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def save_adapter(model, full: dict[str, torch.Tensor], directory: Path) -> None:
    """The adapter (LoRA weights and the `<|mask|>` row) as a stock peft adapter directory."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER_NAME)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(directory / "adapter_model.safetensors"))
    row = full[_mask_row_key(model)].contiguous()
    mask_id = getattr(model.get_input_embeddings(), MASK_ID_ATTR)
    save_file({MASK_ROW: row}, str(directory / MASK_ROW_FILE), metadata={"mask_id": str(mask_id)})
    model.peft_config[ADAPTER_NAME].save_pretrained(str(directory))


def saved_spec(directory: Path) -> LoraSpec:
    """The `LoraSpec` a saved draft adapter was trained with (its adapter_config.json)."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(str(directory))
    # The adapter is rebuilt from r and lora_alpha alone (`LoraSpec`, what the trainer writes): a config asking
    # peft for another scale or term would be served as plain LoRA, silently unlike what was trained.
    for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern"):
        if getattr(config, key, None):
            raise ValueError(
                f"{directory / 'adapter_config.json'} sets {key}; the native engine serves the plain LoRA bdstack "
                "trains (one r and lora_alpha, each term scaled by lora_alpha / r): retrain without it"
            )
    return LoraSpec(rank=config.r, alpha=config.lora_alpha, targets=_targets(config), draft_only=True)


def load_adapter_weights(model, directory: Path) -> None:
    """Load a saved draft adapter's weights and `<|mask|>` row into the adapter `add_lora` gave `model` (of the
    saved adapter's `LoraSpec`)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(directory / "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    if set(saved) != set(expected) or any(saved[k].shape != expected[k].shape for k in saved):
        odd = sorted(set(saved) ^ set(expected))[:3] or [k for k in saved if saved[k].shape != expected[k].shape][:3]
        raise ValueError(
            f"{directory}: the adapter does not fit the base model ({odd}); it was trained on another base"
        )
    set_peft_model_state_dict(model, saved)
    row = load_file(str(directory / MASK_ROW_FILE))[MASK_ROW]
    embed = model.get_input_embeddings()
    if row.shape != getattr(embed, MASK_ROW).shape:
        raise ValueError(f"{directory / MASK_ROW_FILE}: a row of {tuple(row.shape)} for an embedding of {embed}")
    with torch.no_grad():
        getattr(embed, MASK_ROW).copy_(row)


def load_draft_adapter(model, directory: Path, mask_id: int):
    """Inject a saved draft adapter into a base model (its gate included) and load its weights."""
    add_lora(model, saved_spec(directory), mask_id)
    load_adapter_weights(model, directory)
    return model.requires_grad_(False)


def _targets(config) -> str:
    t = config.target_modules
    return t if isinstance(t, str) else ",".join(sorted(t))
