"""A draft-adapter checkpoint's LoRA through vLLM's own code (0.33.0, and the CPU build's 0.32.0), on CPU: the
plugin's route (`draft_lora.py`).

Run in the contract environment on the tiny draft-adapter checkpoint `commands.py` wrote (and the command
`serve.py --backend vllm --mode self-spec|diffusion` built for it). Executed for real:
- vLLM's argument parser and `LoRAConfig` on the command's LoRA flags, and `is_in_target_modules` on vLLM's
  Qwen3 module names: the adapted projections get LoRA layers (q/k/v packed as qkv_proj, gate/up as
  gate_up_proj), the embedding and the output head do not;
- `DraftLoRA` over vLLM's `LRUCacheWorkerLoRAManager`: the adapter loaded by vLLM's loader (`_load_adapter`:
  `PEFTHelper.from_local_dir`, `validate_legal`, `LoRAModel.from_local_checkpoint`), every term equal to the
  peft file's, and activated;
- `BdstackModelState.prepare_inputs` (model.py) over fake batches: the per-token `LoRAMapping` it sets (no
  adapter at prefill rows; at a planned forward, the adapter at its canvas rows only, none at the pending
  clean row and the padding), through vLLM's CPU punica wrapper (`update_metadata`: slot 0 at canvas rows,
  -1 elsewhere) and its torch punica ops (`add_lora_linear`) on a loaded projection: the LoRA term at canvas
  rows, exactly zero at every other row. On vLLM 0.32 (the CPU build) those torch ops index the slot table
  with -1 as Python does, the last slot: every row without an adapter gets slot 0's LoRA term; the check holds
  0.32 to that (a live vLLM 0.32 on CPU refuses the plugin's modes anyway: its V1 runner serves no diffusion
  model, and the V2 runner needs Triton; the plugin targets the GPU wrapper, whose kernels skip -1).
Stood in: the runner's LoRA model manager (`SlotTable`), which owns the model's LoRA layers and needs vLLM's
GPU model stack; it keeps the slot table and passes the mapping to the punica wrapper as
`LoRAModelManager._set_adapter_mapping` does (`names.py` pins those lines). Not run: a forward of vLLM's
LoRA layers, the Triton punica kernels (GPU only).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

QWEN3_MODULES = {  # vLLM's Qwen3 module names (model_executor/models/qwen3.py, qwen2.py) -> gets a LoRA layer
    "model.layers.0.self_attn.qkv_proj": True,
    "model.layers.0.self_attn.o_proj": True,
    "model.layers.0.mlp.gate_up_proj": True,
    "model.layers.0.mlp.down_proj": True,
    "model.embed_tokens": False,
    "lm_head": False,
}


class SlotTable:
    """The runner's LoRA model manager as the worker manager and the punica wrapper see it (one slot)."""

    def __init__(self, lora_config, vocab_size: int, punica):
        from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

        self.lora_config, self.vocab_size, self.punica = lora_config, vocab_size, punica
        self.supported_lora_modules = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"]
        self.packed_modules_mapping = dict(Qwen3ForCausalLM.packed_modules_mapping)
        self.model = SimpleNamespace(embedding_modules=Qwen3ForCausalLM.embedding_modules, lora_manager=self)
        self.moe_ep_load_spec = None
        self.adapters, self.lora_index_to_id, self.mappings = {}, [None], []
        self.capacity = self.lora_slots = 1

    def _validate_moe_lora_format(self, lora) -> None:
        pass

    def _validate_classification_head_lora(self, lora) -> None:
        pass

    def _validate_modules_to_save(self, lora) -> None:
        """vLLM 0.32's loader asks this of the model manager; the real one loads no full module unless the
        model has a classification head: a draft adapter saves none."""
        assert not getattr(lora, "modules_to_save", None), "a draft adapter saves no full modules"

    def _validate_token_classification_lora(self, lora) -> None:
        """vLLM 0.32's loader asks this too; the real one checks only a token-classification pooling model."""

    def __len__(self) -> int:
        return len(self.adapters)

    def list_adapters(self) -> dict:
        return dict(self.adapters)

    def get_adapter(self, lora_id):
        return self.adapters.get(lora_id)

    def add_adapter(self, lora) -> bool:
        self.adapters[lora.id] = lora
        return True

    def remove_adapter(self, lora_id) -> bool:
        return self.adapters.pop(lora_id, None) is not None

    def activate_adapter(self, lora_id) -> bool:
        self.lora_index_to_id[0] = lora_id
        return True

    def set_adapter_mapping(self, mapping) -> None:
        self.mappings.append(mapping)
        self.punica.update_metadata(mapping, self.lora_index_to_id, self.lora_slots + 1, self.vocab_size)


def lora_engine_args(parser, argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["serve", *argv[3:]])  # the server module takes `vllm serve`'s flags
    args.model = args.model_tag or args.model
    return AsyncEngineArgs.from_cli_args(args)


def check_draft_lora(r, parser, cases: list[dict], work: Path) -> None:
    for case in cases:
        if case["name"] in ("draft-adapter self-spec", "draft-adapter diffusion"):
            check_case(r, parser, case, work / "draft-adapter")


def check_case(r, parser, case: dict, ckpt: Path) -> None:
    from safetensors.torch import load_file
    from vllm.config.lora import LoRAConfig
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper
    from vllm.lora.utils import is_in_target_modules

    import inference.vllm_backend.model as m
    from inference.vllm_backend.draft_adapter import DRAFT_LORA_ID
    from inference.vllm_backend.draft_lora import DraftLoRA
    from inference.vllm_backend.settings import VllmDecodeSettings
    from inference.vllm_backend.steps import StepGlue

    name = case["name"]

    def check(ok: bool, what: str) -> None:
        r.check(ok, f"{name}: {what}")

    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from inference.vllm_backend.draft_adapter import VLLM_MAX_LORA_RANKS

    check(get_args(MaxLoRARanks) == VLLM_MAX_LORA_RANKS, f"vLLM's LoRA ranks are {VLLM_MAX_LORA_RANKS}")
    engine = lora_engine_args(parser, case["argv"])
    peft = json.loads((ckpt / "draft_adapter" / "adapter_config.json").read_text())
    check(engine.enable_lora and engine.max_loras == 1 and engine.max_lora_rank >= peft["r"], "LoRA on, one slot")
    lora_config = LoRAConfig(
        max_lora_rank=engine.max_lora_rank, max_loras=engine.max_loras, target_modules=engine.lora_target_modules
    )
    # what VllmConfig does with it (lora_dtype "auto" -> the model's: the tiny checkpoint is fp32)
    model_facts = SimpleNamespace(runner_type="generate", is_lora_supported=True, dtype=torch.float32, architectures=[])
    lora_config.verify_with_model_config(model_facts)
    packed = SlotTable(lora_config, 0, None).packed_modules_mapping
    for module, wrapped in QWEN3_MODULES.items():
        got = is_in_target_modules(module, lora_config.target_modules, packed)
        check(got == wrapped, f"{module} {'gets' if wrapped else 'gets no'} LoRA layer (got {got})")

    settings = VllmDecodeSettings.from_additional_config(engine.additional_config)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    # The CPU wrapper's sgmv path holds one segment per run of equal LoRA ids, at most max_batches (vLLM passes
    # max_num_seqs); a routed forward has up to three runs per request (clean, canvas, padding), so it gets
    # room here. The GPU wrapper groups tokens by id instead (LoRAKernelMeta.prepare_tensors: a stable sort),
    # whatever the runs (names.py pins it): the bound is the CPU platform's, which the plugin does not target.
    punica = get_punica_wrapper(64, max_batches=16, device="cpu", lora_config=lora_config)
    check(type(punica).__name__ == "PunicaWrapperCPU", f"vLLM's CPU punica wrapper (got {type(punica).__name__})")
    table = SlotTable(lora_config, vocab, punica)
    text = SimpleNamespace(max_position_embeddings=1024)
    vllm_config = SimpleNamespace(
        lora_config=lora_config,
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        model_config=SimpleNamespace(
            model=str(ckpt),
            is_encoder_decoder=False,
            get_vocab_size=lambda: vocab,
            hf_config=SimpleNamespace(get_text_config=lambda: text),
        ),
    )
    draft = DraftLoRA(vllm_config, table.model, "cpu", m.draft_dir(vllm_config, settings.draft_adapter))

    # the plugin's ModelState (its __init__ needs a VllmConfig the model class was built for)
    from tests.contracts.vllm.model_state import PROMPTS, fake_batch

    state = m.BdstackModelState.__new__(m.BdstackModelState)
    state.settings, state.glue, state.device, state.draft = settings, StepGlue(settings), torch.device("cpu"), draft
    state.model = SimpleNamespace(bdstack_prefill_rows=None)
    params = SimpleNamespace(max_tokens=12, extra_args=None)
    for req_id, prompt in PROMPTS.items():
        state.glue.add(req_id, prompt, m.request_params(None, params.max_tokens), torch.Generator())
    width = settings.canvas_length
    default_inputs = m.DefaultModelState.prepare_inputs
    m.DefaultModelState.prepare_inputs = lambda self, b, s: {}  # a rope-free text model's (needs no GPU buffer)
    try:
        batch = fake_batch([("a", 0, 0, 4, True), ("b", 1, 0, 6, True)], width)
        state.prepare_inputs(batch, None)
        check(DRAFT_LORA_ID in table.adapters and table.lora_index_to_id == [DRAFT_LORA_ID], "loaded and activated")
        check(table.mappings[-1].index_mapping == (0,) * 10, "prefill rows run the base weights")
        saved = load_file(str(ckpt / "draft_adapter" / "adapter_model.safetensors"))
        check_loaded(check, table.adapters.get(DRAFT_LORA_ID), saved, peft)

        last = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
        rows = m.batch_rows(batch)
        state.glue.sample(rows, torch.zeros(0, vocab), last)  # the prefills plan each request's first forward
        planned = [state.glue.requests[k].planned for k in ("a", "b")]
        batch = fake_batch([("a", 0, 4, width, False), ("b", 1, 6, width, False)], width)
        state.prepare_inputs(batch, None)
    finally:
        m.DefaultModelState.prepare_inputs = default_inputs
    want = []
    for p in planned:  # diffusion: the whole block is canvas; self-spec: the pending token is a clean row
        n = len(p.tokens)
        drafting = [True] * n if settings.mode == "diffusion" else [False] + [True] * (n - 1)
        want += [DRAFT_LORA_ID if d else 0 for d in drafting] + [0] * (width - n)
    got = table.mappings[-1].index_mapping
    check(got == tuple(want), f"the mapping names the canvas rows only: {got} = {tuple(want)}")
    indices = punica.token_lora_indices.tolist()
    check(indices == [0 if t else -1 for t in want], f"punica's token indices (slot 0 / -1): {indices}")
    check_punica_ops(check, punica, table.adapters[DRAFT_LORA_ID], np.array(want) > 0)


def check_loaded(check, lora, saved: dict, peft: dict) -> None:
    """vLLM's LoRAModel holds every term of the peft file, as saved, with peft's scaling."""
    if lora is None:
        check(False, "vLLM loaded no LoRAModel")
        return
    names = {k.rsplit(".lora_", 1)[0] for k in saved}
    check(set(lora.loras) == names, f"vLLM loaded the adapter's {len(names)} projections (got {len(lora.loras)})")
    for module in sorted(names):
        term = lora.loras.get(module)
        same = term is not None and torch.equal(term.lora_a, saved[f"{module}.lora_A.weight"])
        same = same and torch.equal(term.lora_b, saved[f"{module}.lora_B.weight"])
        check(same and term.scaling == peft["lora_alpha"] / peft["r"], f"{module}: A, B and scaling as peft saved")


def check_punica_ops(check, punica, lora, drafting: np.ndarray) -> None:
    """vLLM's torch punica ops on one loaded projection under the plugin's mapping: the LoRA term at the
    drafting rows, exactly zero elsewhere (the stacked layout is the LoRA layers' `create_lora_weights`)."""
    term = lora.loras["model.layers.0.self_attn.q_proj"]
    a, b = term.lora_a.float(), term.lora_b.float() * term.scaling  # vLLM folds scaling into B (`optimize`)
    rank, max_rank = a.shape[0], 8
    a_stacked = torch.zeros(1, 1, max_rank, a.shape[1])
    b_stacked = torch.zeros(1, 1, b.shape[0], max_rank)
    a_stacked[0, 0, :rank], b_stacked[0, 0, :, :rank] = a, b
    x = torch.randn(len(drafting), a.shape[1], generator=torch.Generator().manual_seed(1))
    y = torch.zeros(len(drafting), b.shape[0])
    punica.add_lora_linear(y, x, (a_stacked,), (b_stacked,), 1.0, (b.shape[0],))
    rows = torch.from_numpy(drafting)
    from tests.contracts.vllm.check import installed_vllm

    if installed_vllm() == "0.32.0":  # -1 wraps to the last slot (the module's docstring)
        check(torch.allclose(y[~rows], x[~rows] @ a.T @ b.T, atol=1e-5), "0.32's CPU punica: slot 0 at rows of -1")
    else:
        check(bool((y[~rows] == 0).all()), "punica adds nothing at non-drafting rows")
    check(torch.allclose(y[rows], x[rows] @ a.T @ b.T, atol=1e-5), "punica adds x A^T B^T s at the drafting rows")
