"""The SGLang contract's draft-adapter part: a tiny draft-adapter checkpoint's LoRA through SGLang 0.5.23's own code.

Run by `check.py` (in `.venv-sglang`), after the command checks, on the draft checkpoint `commands.py` wrote
(WORK/draft) and its diffusion and self-spec commands. Executed against the wheel:

- SGLang's dLLM resolution turns `--enable-lora` off (the premise of our own LoRA manager, `draft_lora.py`);
- SGLang's loader (`LoRAConfig`, `LoRAAdapter.initialize_weights` through `DefaultModelLoader`) reads the
  checkpoint's peft directory: every term as peft saved it, q/k/v and gate/up stacked, scaled `lora_alpha / r`,
  `mask_row.safetensors` dropped, no embedding term;
- our algorithm classes, built by SGLang's `get_algorithm` from its own resolution of our command, decode requests
  over fake batches (random logits) with the plugin's real `draft_router`: `DraftLoRA.load` makes a real
  `LoRARef` and attaches the trained `<|mask|>` row; each canvas-pass forward's routing goes through
  `LoRAManager.prepare_lora_token_segments` and `reset_lora_batch` (compiled from the wheel's source) into the
  real `TritonLoRABackend`, whose batch info is read at every forward: none in context passes, the adapter at the
  rows that draft, none elsewhere; and SGLang's torch LoRA ops (`torch_ops/lora_ops.py`: `sgemm_lora_a_fwd`,
  `sgemm_lora_b_fwd`, the reference of its kernels' segment semantics) run on that batch info give peft's LoRA term
  at those rows and exactly zero at the others, for every adapted projection of a layer.

Stood in: the `LoRAManager` object itself (its module imports the GPU stack; its `__init__` would build SGLang's
model layers): a class with the manager's real two methods, its pool holding the base slot and the adapter, the
real loader and the real Triton backend on CPU. `install_lora_stubs` lets the loader's modules import on CPU.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

SLOTS = {None: 0}  # the pool's slot of the base model; the adapter takes slot 1
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def install_lora_stubs() -> None:
    """On top of check.py's stubs: modules the LoRA code imports only for names it annotates or never calls on
    CPU (the model-config package's classes, the forward batch, the HF config helpers) answer any name."""

    def permissive(name: str) -> None:
        mod = sys.modules.get(name) or sys.modules.setdefault(name, types.ModuleType(name))

        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = type(attr, (), {})
            setattr(mod, attr, value)
            return value

        mod.__getattr__ = missing

    for name in (
        "sglang.srt.configs",
        "sglang.srt.configs.model_config",
        "sglang.srt.model_executor.forward_batch_info",
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.layers.logits_processor",
        "sglang.srt.utils.hf_transformers_utils",
    ):
        permissive(name)
    import sglang.srt.model_loader.loader as loader
    from sglang.srt.arg_groups.fields.model import Model

    # No process-wide server args in this check: the loader's checksum step is off, the rest at its defaults.
    loader.get_server_args = lambda: None
    loader.get_model = lambda: Model(model_path="unused")


def manager_methods(root: Path) -> dict:
    """`LoRAManager.prepare_lora_token_segments` and `reset_lora_batch`, compiled from the wheel's source."""
    import typing

    path = root / "srt" / "lora" / "lora_manager.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "LoRAManager")
    names = ("prepare_lora_token_segments", "reset_lora_batch")
    wanted = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in names]
    namespace = {name: getattr(typing, name) for name in ("Optional", "Sequence")}  # its annotations' names
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {f.name: namespace[f.name] for f in wanted}


def stand_in_manager_module(root: Path, made: list) -> types.ModuleType:
    """`sglang.srt.lora.lora_manager` for `DraftLoRA.load`: a `LoRAManager` that records its arguments, loads its
    adapters with SGLang's loader and routes with SGLang's own methods over the real Triton backend."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.backend.triton_backend import TritonLoRABackend
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    methods = manager_methods(root)

    class Pool:
        def __init__(self):
            self.uid_to_buffer_id = dict(SLOTS)

        def get_buffer_id(self, uid):
            return self.uid_to_buffer_id[uid]

    class LoRAManager:
        prepare_lora_token_segments = methods["prepare_lora_token_segments"]
        reset_lora_batch = methods["reset_lora_batch"]

        def __init__(self, **kwargs):
            made.append(self)
            self.kwargs = kwargs
            self.max_loras_per_batch = kwargs["max_loras_per_batch"]
            self.lora_backend = TritonLoRABackend(self.max_loras_per_batch, torch.device("cpu"))
            self.memory_pool, self.loras, self.fetched = Pool(), {}, []
            hf = kwargs["base_hf_config"]
            for ref in kwargs["lora_paths"]:
                config = LoRAConfig(ref.lora_path, base_vocab_size=hf.vocab_size)
                adapter = LoRAAdapter(ref.lora_id, config, hf, LoadConfig(), self.lora_backend)
                adapter.initialize_weights()
                self.loras[ref.lora_id] = adapter

        def fetch_new_loras(self, new_loras, running_loras=frozenset()):
            self.fetched.append(set(new_loras))
            for uid in new_loras:
                self.memory_pool.uid_to_buffer_id.setdefault(uid, len(self.memory_pool.uid_to_buffer_id))

    mod = types.ModuleType("sglang.srt.lora.lora_manager")
    mod.LoRAManager = LoRAManager
    return mod


def check_lora(r, root: Path, work: Path, cases: list[dict], resolve) -> None:
    """All of the module doc; `resolve(argv)` is check.py's resolution of a command's server arguments."""
    import json

    from safetensors.torch import load_file
    from sglang.srt.arg_groups.overrides import resolving_view

    install_lora_stubs()
    from sglang.srt.lora.backend.base_backend import BaseLoRABackend
    from sglang.srt.lora.backend.lora_registry import get_backend_from_name

    from inference.sglang_backend.draft_adapter import LORA_BACKEND

    backend = get_backend_from_name(LORA_BACKEND)
    own = backend.prepare_lora_token_segments is not BaseLoRABackend.prepare_lora_token_segments
    r.check(own, f"SGLang's {LORA_BACKEND} LoRA backend ({backend.__name__}) implements explicit token segments")
    draft = work / "draft"
    drafts = [c for c in cases if c["name"] in ("draft diffusion", "draft self-spec")]
    r.check(len(drafts) == 2, "commands.json has the draft checkpoint's diffusion and self-spec commands")
    args = resolve([*drafts[0]["argv"][3:], "--enable-lora", "--lora-paths", f"x={draft / 'draft_adapter'}"])
    r.check(resolving_view(args).enable_lora is False, "SGLang's dLLM resolution turns --enable-lora off")
    peft = load_file(str(draft / "draft_adapter" / "adapter_model.safetensors"))
    hf = SimpleNamespace(**json.loads((draft / "config.json").read_text()))
    made: list = []
    sys.modules["sglang.srt.lora.lora_manager"] = stand_in_manager_module(root, made)
    for case in drafts:
        check_one(r, case, resolve(case["argv"][3:]), draft, hf, peft, made)


def check_one(r, case: dict, args, draft: Path, hf, peft: dict, made: list) -> None:
    from safetensors.torch import load_file
    from sglang.srt.dllm.algorithm import get_algorithm
    from sglang.srt.dllm.config import DllmConfig

    from bdcore.draft_adapter import MASK_ROW, MASK_ROW_FILE
    from inference.backend_settings import DRAFT_LORA_NAME
    from inference.sglang_backend.draft_adapter import LORA_BACKEND, LORA_SLOTS

    name = case["name"]
    algo = get_algorithm(DllmConfig.from_server_args(args))
    algo.set_attention = lambda model_runner, *, bidirectional: None  # the layers' switch is check.py's
    embed = torch.nn.Embedding(hf.vocab_size, hf.hidden_size)
    runner = FakeRunner(algo, SimpleNamespace(get_input_embeddings=lambda: embed), hf, draft, args)
    served = drive(algo, runner, requests=3, rounds=4)
    manager = made[-1]
    r.check(algo.router.manager is manager, f"{name}: the plugin's draft_router loaded the adapter (DraftLoRA.load)")
    kw = manager.kwargs
    r.check(kw["lora_backend"] == LORA_BACKEND and kw["max_loras_per_batch"] == LORA_SLOTS, f"{name}: manager settings")
    (ref,) = kw["lora_paths"]
    r.check(ref.pinned and ref.lora_name == DRAFT_LORA_NAME and ref.lora_id == algo.router.lora_id, f"{name}: LoRARef")
    r.check(Path(ref.lora_path) == draft / "draft_adapter", f"{name}: the checkpoint's adapter directory")
    r.check(manager.fetched == [{None, ref.lora_id}], f"{name}: base and adapter slots resident")
    check_loaded(r, name, manager.loras[ref.lora_id], peft, hf)
    trained = load_file(str(draft / "draft_adapter" / MASK_ROW_FILE))[MASK_ROW]
    out = embed(torch.tensor([3, algo.settings.mask_id, 5]))
    r.check(torch.equal(out[1], trained) and torch.equal(out[0], embed.weight[3]), f"{name}: the trained <|mask|> row")
    context = [info for mode, info, _ in runner.seen if mode == "EXTEND"]
    canvas = [(info, want) for mode, info, want in runner.seen if mode == "DLLM_EXTEND"]
    r.check(served > 0 and context and canvas, f"{name}: requests decoded over fake batches ({served} tokens)")
    r.check(all(info is None for info in context), f"{name}: context passes run without LoRA batch info")
    routed = [rows_of(info, ref.lora_id, manager) or [False] * len(want) for info, want in canvas]
    r.check(
        all(got == want for got, (_, want) in zip(routed, canvas)), f"{name}: each forward's rows are Rows.drafting"
    )
    r.check(any(any(g) for g in routed), f"{name}: the adapter is routed")
    only_drafting = all((info is None) == (not any(want)) for info, want in canvas)
    r.check(only_drafting, f"{name}: LoRA batch info only for forwards with drafting rows")
    if "self-spec" in name:
        r.check(all(any(g) for g in routed[0::2]) and not any(any(g) for g in routed[1::2]), f"{name}: draft, verify")
    r.check(manager.lora_backend.batch_info is None, f"{name}: routing reset after the last forward")
    for (info, _), want in zip(canvas, routed):
        if info is not None:
            check_terms(r, name, info, want, manager.loras[ref.lora_id], peft)


def rows_of(info, lora_id: str, manager) -> list[bool] | None:
    """Per token of a forward, whether the backend's batch info runs the adapter's slot there."""
    if info is None:
        return None
    slot = manager.memory_pool.get_buffer_id(lora_id)
    out = []
    for index, n in zip(info.weight_indices.tolist(), info.seg_lens.tolist()):
        out += [index == slot and int(info.lora_ranks[index]) > 0] * n
    return out


def check_loaded(r, name: str, adapter, peft: dict, hf) -> None:
    import json

    saved = json.loads((Path(adapter.config.path) / "adapter_config.json").read_text())
    r.check(adapter.scaling == saved["lora_alpha"] / saved["r"], f"{name}: scaling lora_alpha / r")
    r.check(not adapter.embedding_layers and not adapter.added_tokens_embeddings, f"{name}: no embedding term loaded")
    for layer in range(hf.num_hidden_layers):
        got = adapter.layers[layer].weights
        want = {}
        for module in MODULES:
            group = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
            for ab in ("lora_A", "lora_B"):
                parts = [peft[key(layer, group, p, ab)] for p in PARTS.get(module, (module,))]
                want[f"model.layers.{layer}.{group}.{module}.{ab}.weight"] = torch.cat(parts)
        ok = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        r.check(ok, f"{name}: layer {layer}'s terms as peft saved them, stacked (mask row dropped)")


def key(layer: int, group: str, proj: str, ab: str) -> str:
    return f"model.layers.{layer}.{group}.{proj}.{ab}.weight"


def check_terms(r, name: str, info, drafting: list[bool], adapter, peft: dict) -> None:
    """SGLang's torch LoRA ops on the forward's batch info: peft's term at drafting rows, exactly zero elsewhere."""
    from sglang.srt.lora.torch_ops.lora_ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

    gen = torch.Generator().manual_seed(len(drafting))
    weights = adapter.layers[0].weights
    rows = torch.tensor(drafting)
    for module in MODULES:
        group = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
        a = weights[f"model.layers.0.{group}.{module}.lora_A.weight"]
        b = weights[f"model.layers.0.{group}.{module}.lora_B.weight"]
        parts = PARTS.get(module, (module,))
        # the pool's buffers: slot 0 the base model (rank 0: never read), slot 1 the adapter
        a_buf, b_buf = torch.stack([torch.zeros_like(a), a]), torch.stack([torch.zeros_like(b), b])
        x = torch.randn(len(drafting), a.shape[1], generator=gen)
        outs = [peft[key(0, group, p, "lora_B")].shape[0] for p in parts]
        offsets = torch.tensor([0, *torch.tensor(outs).cumsum(0).tolist()])
        mid = sgemm_lora_a_fwd(x, a_buf, info.weight_indices, info.seg_lens, info.lora_ranks, info.scalings, len(parts))
        got = sgemm_lora_b_fwd(mid, b_buf, info.weight_indices, info.seg_lens, info.lora_ranks, offsets)
        want = torch.cat(
            [
                x @ peft[key(0, group, p, "lora_A")].T @ peft[key(0, group, p, "lora_B")].T * adapter.scaling
                for p in parts
            ],
            dim=1,
        )
        close = torch.allclose(got[rows], want[rows], atol=1e-5) and not got[~rows].any()
        r.check(close, f"{name}: {module}'s LoRA term at drafting rows only (SGLang's torch ops)")


class FakeRunner:
    """`model_runner` for the algorithms: the attributes `DraftLoRA.load` reads, and a forward returning random
    logits that records the LoRA backend's batch info and the rows the planned forwards draft at."""

    def __init__(self, algo, model, hf, draft: Path, args):
        self.algo, self.model, self.hf = algo, model, hf
        self.model_config = SimpleNamespace(hf_config=hf, model_path=str(draft))
        self.load_config, self.dtype, self.server_args = None, torch.float32, args
        self.req_to_token_pool = SimpleNamespace()  # a dense model's: no mamba pool for the state guard
        self.gen = torch.Generator().manual_seed(0)
        self.seen: list[tuple[str, object, list[bool] | None]] = []

    def forward(self, batch, pp_proxy_tensors=None):
        dllm = batch.forward_mode.is_dllm_extend()
        backend = self.algo.router.manager.lora_backend
        want = None
        if dllm:
            B = self.algo.block_size
            want = []
            for rid in batch.rids:
                req = self.algo.requests.get(rid)
                rows = req.planned.rows.drafting() if req.planned is not None and not req.for_context else []
                want += rows + [False] * (B - len(rows))
        self.seen.append(("DLLM_EXTEND" if dllm else "EXTEND", backend.batch_info, want))
        n = batch.input_ids.numel() if dllm else batch.batch_size
        logits = torch.randn(n, self.hf.vocab_size, generator=self.gen) * 4
        out = SimpleNamespace(next_token_logits=None if dllm else logits, full_logits=logits if dllm else None)
        return SimpleNamespace(logits_output=out, can_run_graph=False)


def drive(algo, runner: FakeRunner, *, requests: int, rounds: int) -> int:
    """SGLang's separate-context rounds for `requests` prompts, greedy: a context pass, then canvas and context
    passes in turn. Returns the tokens the rounds committed."""
    B, committed, served = algo.block_size, {f"c{i}": 5 + i for i in range(requests)}, 0

    def batch(dllm: bool, rids: list[str], lens: list[int], n_ids: int):
        mode = SimpleNamespace(is_dllm_extend=lambda: dllm)
        ids = torch.zeros(n_ids, dtype=torch.long)
        return SimpleNamespace(forward_mode=mode, input_ids=ids, batch_size=len(rids), rids=rids, seq_lens=lens)

    rids = list(committed)
    algo.run(runner, batch(False, rids, [committed[r] for r in rids], sum(committed.values())))
    for _ in range(rounds):
        rids = [r for r in rids if algo.requests.get(r) is not None]
        if not rids:
            break
        _, tokens, *_ = algo.run(runner, batch(True, rids, [committed[r] + B for r in rids], B * len(rids)))
        for rid, t in zip(rids, tokens):
            committed[rid] += len(t)
            served += len(t)
        rids = [r for r in rids if algo.requests.get(r) is not None]
        if rids:
            algo.run(runner, batch(False, rids, [committed[r] for r in rids], len(rids)))
    return served
