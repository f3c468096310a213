"""Tiny random models and a servable tiny checkpoint: real HF architectures built from configs, fp32.

The tests build on them (the engine contract checks under tests/contracts/ serve the same checkpoints),
and so does the prepared GPU check (gpu_lib.sh); they live here, not in tests/, so no shipped module
imports the test suite.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

VOCAB = 96
MASK_ID = 95
FILLER_ID = 94
EOT_ID = 93


def _sizes(vocab: int, tied: bool, layers: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        # A wide init makes logits depend strongly on what each row sees, so a wrong mask shows.
        initializer_range=0.2,
    )


def tiny_config(arch: str = "qwen3", *, tied: bool = True, vocab: int = VOCAB):
    common = _sizes(vocab, tied, layers=2)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3_moe":  # every layer sparse: 4 experts, 2 per token
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
        )
    raise ValueError(arch)


def tiny_model(arch: str = "qwen3", *, tied: bool = True, seed: int = 0, attn: str = "sdpa", vocab: int = VOCAB):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, tied=tied, vocab=vocab)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def tiny_hybrid_config(*, tied: bool = True, vocab: int = VOCAB):
    """A Qwen3.5 text config: three gated-delta layers then one full-attention layer."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **_sizes(vocab, tied, layers=4),
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def tiny_hybrid_model(*, tied: bool = True, seed: int = 0, vocab: int = VOCAB, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = tiny_hybrid_config(tied=tied, vocab=vocab)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        # Decays from strong to weak, so the state carries information across blocks, yet no cumulative
        # log-decay so large that fp32 cumsums (ours and the stock 64-token chunks) lose digits.
        for layer in model.get_decoder().layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.dt_bias.normal_(0.0, 1.0)
                layer.linear_attn.A_log.uniform_(-3.0, 0.5)
    return model.eval()


def tiny_checkpoint(
    directory,
    *,
    arch: str = "qwen3",
    bd_size: int = 4,
    seed: int = 0,
    clean_causal: bool = True,
    within_block_causal: bool = False,
    shift: bool = True,
    tokenizer=None,
    tied: bool = True,
):
    """A servable block-diffusion checkpoint: tiny random model, char tokenizer (or `tokenizer`), <|mask|>,
    sidecar. `shift=False`: an unshifted (single-stream) one, whose clean stream is block-causal. `tied=False`:
    its own output layer (lm_head.weight saved beside the embedding)."""
    from bdcore.sidecar import Sidecar, write_sidecar
    from data.toy_tokenizer import build_char_tokenizer
    from train.special_tokens import add_mask_token

    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    model = (
        tiny_hybrid_model(seed=seed, vocab=len(tok), tied=tied)
        if arch == "qwen3_5"
        else tiny_model(arch, seed=seed, vocab=len(tok), tied=tied)
    )
    mask_id = add_mask_token(model, tok)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    write_sidecar(
        directory,
        Sidecar(
            bd_size=bd_size,
            mask_id=mask_id,
            ar_loss_weight=0.2 if clean_causal else 0.0,
            shift=shift,
            clean_causal=clean_causal,
            within_block_causal=within_block_causal,
            views=2 if shift else 1,
            base_model="tiny",
        ),
    )
    return directory


def randomize_adapter(model, seed: int = 0, scale: float = 0.3) -> None:
    """LoRA B starts at zero (a no-op adapter): give every adapter weight a value that changes outputs."""
    from bdcore.draft_adapter import MASK_ROW

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or MASK_ROW in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def draft_checkpoint(directory, arch: str = "qwen3", seed: int = 0):
    """tiny_checkpoint's base weights untouched, plus a random draft-only adapter (rank 4, every linear
    projection, a trained-looking <|mask|> row) and a sidecar naming it (the tests, the SGLang and vLLM contracts
    and GPU checks)."""
    from pathlib import Path

    from bdcore.draft_adapter import ADAPTER_DIR, LoraSpec, add_lora, save_adapter
    from bdcore.sidecar import Sidecar, read_sidecar, write_sidecar

    directory = Path(directory)  # the GPU scripts pass a string
    tiny_checkpoint(directory, arch=arch, bd_size=4)
    sidecar = read_sidecar(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    add_lora(model, LoraSpec(rank=4, alpha=8, draft_only=True), sidecar.mask_id)
    randomize_adapter(model, seed)
    save_adapter(model, model.state_dict(), directory / ADAPTER_DIR)
    write_sidecar(directory, Sidecar(**{**sidecar.__dict__, "draft_adapter": ADAPTER_DIR}))
    return directory
