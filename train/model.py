"""Runs a stock Hugging Face causal LM over two-stream rows and returns the block-diffusion loss.

The wrapper owns no weights of its own: it feeds the HF decoder the noised row, the shared
positions and the attention rule (a 4D boolean mask for SDPA, an additive mask for eager, a
block-sparse `BlockMask` for flex attention), gathers hidden states at supervised rows only,
and scores them with the output embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from bdcore.attention_rule import CLEAN_STREAM, PAD_STREAM, dense_mask, flex_block_mask
from bdcore.draft_adapter import draft_rows
from bdcore.gated_delta import LINEAR_LAYER_TYPES, is_hybrid
from train.config import BlockDiffusionConfig
from train.frozen_clean import frozen_clean_hidden
from train.hybrid import build_layout, patch_gated_delta_layers
from train.loss import LossParts, chain_weights, combine_losses, draft_loss, liger_available, token_ce
from train.rows import TwoStreamBatch
from train.sparse_attention import NAME as SPARSE_SDPA
from train.sparse_attention import register as register_sparse_sdpa

SUPPORTED_LAYER_TYPES = {"full_attention"} | LINEAR_LAYER_TYPES


def check_supported_model(model) -> None:
    """Refuse architectures whose layers the two-stream row would get wrong, naming the reason."""
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if "sliding_attention" in layer_types:
        raise NotImplementedError(
            "sliding-window attention layers are not supported by the two-stream row yet; "
            "use a model without sliding windows (e.g. Qwen3 with use_sliding_window=false)"
        )
    if layer_types - SUPPORTED_LAYER_TYPES:
        raise NotImplementedError(
            f"layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)} are not supported by the two-stream "
            "row (supported: full attention, Qwen3.5-style gated-delta linear attention)"
        )
    if getattr(model, "get_decoder", None) is None or model.get_output_embeddings() is None:
        raise TypeError(f"{type(model).__name__} has no reachable decoder or output embedding")


def attention_backend(config, *, cuda: bool) -> str:
    """The attn_implementation to build a model with: flex attention (block-sparse `BlockMask`) on CUDA
    where the architecture supports it, else SDPA with the dense mask (CPU: the block-sparse SDPA below).
    Qwen3.5 hybrids, for one, do not take flex attention in transformers."""
    if not cuda:
        return "sdpa"
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:  # remote code: the class is unknown before loading; SDPA is the backend every model has
        return "sdpa"
    return "flex_attention" if getattr(cls, "_supports_flex_attn", False) else "sdpa"


def is_moe(config) -> bool:
    """A mixture-of-experts decoder with a top-k router (Qwen3-MoE, Qwen2-MoE, Mixtral, ...)."""
    return (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0) > 1


def router_aux_loss(router_logits, config, *, real: torch.Tensor) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss of every layer's router logits over the row's real tokens
    (clean and noised alike: every one is routed), as transformers computes it for these models."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return load_balancing_loss_func(
        tuple(router_logits), experts, config.num_experts_per_tok, attention_mask=real.reshape(-1)
    )


class TwoStreamLM(nn.Module):
    """`cpu_block_sparse` (default: on when there is no CUDA, the model uses SDPA and the rows have
    noised views) switches the model to the block-sparse SDPA of `train/sparse_attention.py`, which
    skips hidden key tiles."""

    def __init__(
        self,
        model: nn.Module,
        cfg: BlockDiffusionConfig,
        *,
        fused_ce: bool | None = None,
        ce_chunk_rows: int = 2048,
        cpu_block_sparse: bool | None = None,
        router_aux_coef: float = 0.0,
        frozen_clean: bool = False,
        mask_id: int | None = None,
    ):
        """`frozen_clean`: a draft-only adapter's step, the clean stream once without grad
        (`train/frozen_clean.py`); dense models without a router loss only (else the joint forward).
        `mask_id`: `<|mask|>`, which no served distribution holds: a distilled draft (`draft_loss` kl or mix)
        and its teacher put no mass there."""
        super().__init__()
        check_supported_model(model)
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if cpu_block_sparse is None:  # AR-only rows are short causal documents: plain SDPA is faster there
            cpu_block_sparse = impl == "sdpa" and not torch.cuda.is_available() and cfg.views > 0
        if cpu_block_sparse:
            model.config._attn_implementation = register_sparse_sdpa()
        self.hybrid = is_hybrid(model.config)
        if self.hybrid and cfg.single_stream:
            raise NotImplementedError(
                "--objective single_stream needs every layer to see its whole block both ways; gated-delta "
                "(linear attention) layers are recurrent and have no such form yet: use --objective two_stream"
            )
        if self.hybrid:  # gated-delta layers get the two-stream forward; the model is changed in place
            patch_gated_delta_layers(model)
        self.model = model
        self.cfg = cfg
        self.fused_ce = liger_available() if fused_ce is None else fused_ce
        self.ce_chunk_rows = ce_chunk_rows
        if router_aux_coef > 0 and not is_moe(model.config):
            raise ValueError(f"router_aux_coef={router_aux_coef}: {type(model).__name__} has no expert router")
        self.router_aux_coef = router_aux_coef
        self._router_logits = None
        self.frozen_clean = frozen_clean and not self.hybrid and router_aux_coef == 0 and cfg.views > 0
        self.mask_id = mask_id

    @property
    def mask_rule(self) -> dict:
        return {"clean_causal": self.cfg.clean_causal, "within_block_causal": self.cfg.within_block_causal}

    def attention_mask(self, batch: TwoStreamBatch):
        rule = self.mask_rule
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        if impl == "flex_attention":
            return flex_block_mask(batch.meta, **rule)
        mask = dense_mask(batch.meta, **rule)
        if impl in ("sdpa", SPARSE_SDPA):
            return mask
        if impl == "eager":  # eager adds the mask to the scores: give it an additive one
            dtype = self.model.get_input_embeddings().weight.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        raise NotImplementedError(f"attn_implementation={impl!r}: use 'sdpa' (CPU/GPU) or 'flex_attention' (CUDA)")

    def gated_delta_layout(self, batch: TwoStreamBatch):
        width = getattr(self.model.config, "linear_conv_kernel_dim", 4)
        return build_layout(batch.meta, self.cfg, conv_width=width).to(batch.input_ids.device)

    def hidden_states(self, batch: TwoStreamBatch) -> torch.Tensor:
        if self.frozen_clean and getattr(self.model.config, "_attn_implementation", "") != "flex_attention":
            return frozen_clean_hidden(self, batch)
        mask = self.attention_mask(batch)
        if self.hybrid:
            mask = {"full_attention": mask, "linear_attention": self.gated_delta_layout(batch)}
        stream = batch.meta.stream
        router = {"output_router_logits": True} if self.router_aux_coef > 0 else {}
        with draft_rows(self.model, (stream != CLEAN_STREAM) & (stream != PAD_STREAM)):  # the noised views draft
            out = self.model.get_decoder()(
                input_ids=batch.input_ids,
                attention_mask=mask,
                position_ids=batch.position_ids,
                use_cache=False,
                **router,
            )
        self._router_logits = out.router_logits if router else None
        return out.last_hidden_state

    def logits(self, batch: TwoStreamBatch) -> torch.Tensor:
        """Logits at every row, [B, T, V]: for tests and inspection, not for training."""
        return self.model.get_output_embeddings()(self.hidden_states(batch))

    def forward(
        self,
        batch: TwoStreamBatch,
        *,
        diff_norm=None,
        ar_norm=None,
        rows: torch.Tensor | None = None,
        aux_weight: float = 1.0,
    ) -> LossParts | torch.Tensor:
        """The block-diffusion loss of the batch (`LossParts`), or with `rows` (flat indices) the logits
        [len(rows), V] there, for objectives that score chosen rows (on-policy distillation, RL). Both go
        through forward so that FSDP gathers the embeddings, final norm and head around them. A mixture of
        experts adds `router_aux_coef * aux_weight *` its router's load-balancing loss (the trainer passes
        1 / micro-batches, so the term is a mean over them)."""
        hidden = self.hidden_states(batch).flatten(0, 1)
        if rows is not None:  # scored rows (OPD, RL): the router's balance is the SFT loss's business
            self._router_logits = None
            return self.model.get_output_embeddings()(hidden[rows]).float()
        weight = self.model.get_output_embeddings().weight
        use_ar = self.cfg.ar_loss_weight > 0
        distilled = self.cfg.draft_loss != "ce" or self.cfg.chain_weights
        chain = None
        if distilled:  # the drafting rows against the verifier's rows (train/loss.py draft_loss)
            if batch.diff_teacher is None:
                raise ValueError("draft_loss and chain_weights need each drafting row's clean-stream row")
            diff, accept = draft_loss(
                hidden[batch.diff_index],
                hidden[batch.diff_teacher.clamp_min(0)],
                weight,
                batch.diff_labels,
                batch.diff_teacher >= 0,  # no AR row predicts a filler past its document's end
                self.cfg,
                ban=self.mask_id,
                chunk_rows=self.ce_chunk_rows,
            )
            if self.cfg.chain_weights:
                chain = chain_weights(accept, batch.diff_block, batch.diff_offset)
            keep = None if use_ar else 0  # the AR rows' CE only where the AR loss is trained
            index, labels = batch.ar_index[:keep], batch.ar_labels[:keep]
        else:
            index = torch.cat([batch.diff_index, batch.ar_index]) if use_ar else batch.diff_index
            labels = torch.cat([batch.diff_labels, batch.ar_labels]) if use_ar else batch.diff_labels
        ce = token_ce(hidden[index], weight, labels, chunk_rows=self.ce_chunk_rows, fused=self.fused_ce)
        if not distilled:
            diff, ce = ce[: batch.diff_index.numel()], ce[batch.diff_index.numel() :]
        parts = combine_losses(
            diff,
            batch.diff_rate,
            ce,
            self.cfg,
            diff_norm=diff_norm,
            ar_norm=ar_norm,
            diff_offset=batch.diff_offset,
            chain=chain,
        )
        if self._router_logits is not None:
            aux = router_aux_loss(self._router_logits, self.model.config, real=batch.meta.stream != PAD_STREAM)
            parts.loss, parts.aux = parts.loss + self.router_aux_coef * aux_weight * aux, aux.detach()
            self._router_logits = None
        return parts
