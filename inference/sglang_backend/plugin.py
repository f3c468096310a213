"""Register bdstack's decode algorithms and checkpoints in an SGLang process (checked against 0.5.23).

SGLang finds dLLM algorithms in `sglang.srt.dllm.algorithm.algo_name_to_cls` and a checkpoint's block
size and mask id in a per-architecture table inside `DllmConfig.from_server_args`. Our checkpoints keep
their stock architecture (e.g. Qwen3ForCausalLM), so `register()`:

1. adds `BdstackDiffusion` and `BdstackSelfSpec` to the algorithm table (classes built from the
   SGLang-free cores in `algorithms.py` and SGLang's `DllmAlgorithm`);
2. wraps `DllmConfig.from_server_args`: for our algorithms the block size and mask id come from the
   `--dllm-algorithm-config` YAML (`settings.py`), checked against the checkpoint's
   `block_diffusion.json`; every other algorithm goes to SGLang's own code unchanged;
3. gives the algorithms their attention switch (`set_attention`): SGLang's Triton backend makes a
   forward bidirectional within its new tokens for attention layers whose `attn_type` is
   DECODER_BIDIRECTIONAL, causal otherwise. That holds for DLLM_EXTEND (canvases) and, with CUDA
   graphs off and no chunked prefill (our settings), for ordinary EXTEND (context passes, prompts)
   too, so the algorithms set the type before every forward; the first call also makes the model's
   LogitsProcessor return every canvas row's logits (`return_full_logits`);
4. on SGLang's CPU engine, replaces the `torch_native` attention backend with ours (`canvas_attention.py`): its
   extend makes a DECODER_BIDIRECTIONAL layer attend the canvas both ways (SGLang's own attends it causally,
   without an error), and refuses any forward where that mask cannot be expressed;
5. gives them their draft-adapter hook (`draft_router`): a checkpoint's draft adapter loaded into a LoRA
   manager of SGLang's over the served model at the first forward (`draft_lora.py`), which the algorithms
   route per token to canvas rows.

`launch.py` calls `register()` at import, so it runs in the launcher and in every process SGLang
spawns (spawned children re-import the main module). The pieces below take SGLang's classes as
arguments, so CPU tests check them without SGLang installed.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from bdcore.capabilities import Capabilities, read_capabilities
from bdcore.serving_gate import resolve
from inference.sglang_backend.algorithms import SelfSpec, ShiftedDiffusion
from inference.sglang_backend.settings import DIFFUSION, SELF_SPEC, DecodeSettings

logger = logging.getLogger("bdstack.sglang")
TESTED_SGLANG = "0.5.23"
CORES = {DIFFUSION: ShiftedDiffusion, SELF_SPEC: SelfSpec}


class PluginError(ValueError):
    """A bdstack checkpoint or setting SGLang cannot serve as asked."""


# -- SGLang-free pieces --------------------------------------------------------------------------
def local_model_dir(model_path: str) -> Path:
    """The checkpoint directory; a hub id is fetched (config, sidecar and tokenizer files only)."""
    path = Path(model_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, allow_patterns=["*.json", "*.model", "*.txt", "*.jinja"]))


def read_settings_yaml(config_path: str):
    """The `--dllm-algorithm-config` file as SGLang reads it (`yaml.safe_load`): our settings' mapping, unchecked."""
    import yaml

    return yaml.safe_load(Path(config_path).read_text())


def load_settings(model_path: str, algorithm: str, config_path: str | None) -> DecodeSettings:
    """Our algorithm's settings, checked against the checkpoint they are meant for: the serving gate decides
    whether SGLang serves them there (as serve.py's did when it wrote them), then the YAML must describe it."""
    if config_path is None:
        raise PluginError(f"{algorithm} needs --dllm-algorithm-config (serve.py --backend sglang writes it for you)")
    settings = DecodeSettings.from_dict(read_settings_yaml(config_path))
    if settings.algorithm != algorithm:
        raise PluginError(f"{config_path} is a {settings.algorithm} config, but --dllm-algorithm is {algorithm}")
    caps = read_capabilities(local_model_dir(model_path)) or Capabilities.from_sidecar(None)
    resolve(caps, settings.decode_config(), "sglang")
    if caps.mask_id != settings.mask_id:
        raise PluginError(f"{config_path}: mask_id {settings.mask_id}, but the checkpoint's is {caps.mask_id}")
    if caps.within_block_causal != settings.within_block_causal:
        raise PluginError(f"{config_path}: within_block_causal disagrees with the checkpoint's sidecar")
    if caps.draft_adapter != (settings.draft_adapter is not None):
        # without it the drafts would come from the base model; with it on a plain checkpoint, from nothing trained
        raise PluginError(f"{config_path}: draft_adapter disagrees with the checkpoint's sidecar")
    return settings


def dllm_config_kwargs(view) -> dict:
    """DllmConfig's arguments for one of our algorithms, from the resolved server arguments."""
    settings = load_settings(view.model_path, view.dllm_algorithm, view.dllm_algorithm_config)
    return dict(
        algorithm=view.dllm_algorithm,
        algorithm_config=settings.to_dict(),
        block_size=settings.block_size,
        mask_id=settings.mask_id,
        max_running_requests=1 if view.max_running_requests is None else view.max_running_requests,
        first_done_first_out_mode=False,
        requires_separate_context_encoding=True,
        capture_input_preparation=False,
    )


def wrap_config_factory(original, dllm_config_cls, resolving_view):
    """`DllmConfig.from_server_args` that knows our algorithms and defers to `original` otherwise."""

    def from_server_args(server_args):
        view = resolving_view(server_args)
        if view.dllm_algorithm not in CORES:
            return original(server_args)
        return dllm_config_cls(**dllm_config_kwargs(view))

    from_server_args.bdstack = True
    return from_server_args


def attention_switch(radix_attention_cls, attention_type):
    """The `set_attention` hook: set `attn_type` on every attention layer of the served model."""

    def set_attention(self, model_runner, *, bidirectional: bool) -> None:
        layers = getattr(self, "_attention_layers", None)
        if layers is None:
            modules = list(model_runner.model.modules())
            layers = [m for m in modules if isinstance(m, radix_attention_cls)]
            if not layers:
                raise PluginError("no RadixAttention layers in the served model: cannot set canvas attention")
            # A DLLM_EXTEND forward returns every canvas row's logits only from a LogitsProcessor built
            # with return_full_logits (SGLang's dLLM model classes set it; stock causal ones do not).
            heads = [m for m in modules if hasattr(m, "return_full_logits")]
            if not heads:
                raise PluginError("no LogitsProcessor in the served model: cannot return canvas logits")
            for head in heads:
                head.return_full_logits = True
            check_canvas_backend(model_runner)
            self._attention_layers = layers
        kind = attention_type.DECODER_BIDIRECTIONAL if bidirectional else attention_type.DECODER
        for layer in layers:
            layer.attn_type = kind

    return set_attention


def check_canvas_backend(model_runner) -> None:
    """Refuse SGLang's own torch_native backend (it would attend every canvas causally, without an error): on the
    CPU engine the plugin's subclass must be the one running, however this process was started."""
    backend = getattr(model_runner, "attn_backend", None)
    for b in (backend, getattr(backend, "full_attn_backend", None)):  # a hybrid model's full-attention layers
        if type(b).__name__ == "TorchNativeAttnBackend":
            raise PluginError(
                "SGLang's own torch_native attention would attend canvases causally, and bdstack's canvas backend "
                "is not registered in this process (start SGLang through inference.sglang_backend.launch)"
            )


@contextlib.contextmanager
def mamba_state_guard(self, model_runner, forward_batch):
    """The `recurrent_state_guard` hook: snapshot the batch's gated-delta slots (conv and recurrent
    state in SGLang's mamba pool) before a canvas forward and put them back after it, so the canvas
    starts from the block-entry state and the request's state stays the one after its committed tokens."""
    pool = getattr(model_runner.req_to_token_pool, "mamba_pool", None)
    if pool is None:  # a dense model
        yield
        return
    owner = model_runner.req_to_token_pool
    slots = owner.get_mamba_indices(forward_batch.req_pool_indices)
    # With --enable-unified-memory the request's slot ids are virtual; the cache is indexed physically.
    translate = getattr(owner, "translate_mamba_indices", None)
    slots = translate(slots) if translate is not None else slots
    cache = pool.mamba_cache
    conv = [c[:, slots].clone() for c in cache.conv]
    temporal = cache.temporal[:, slots].clone()
    try:
        yield
    finally:
        for c, saved in zip(cache.conv, conv):
            c[:, slots] = saved
        cache.temporal[:, slots] = temporal


def draft_router(self, model_runner):
    """The `draft_router` hook: the checkpoint's draft adapter in a LoRA manager of SGLang's over the served model."""
    from inference.sglang_backend.draft_adapter import adapter_dir
    from inference.sglang_backend.draft_lora import DraftLoRA

    directory = adapter_dir(model_runner.model_config.model_path, self.settings.draft_adapter)
    return DraftLoRA.load(model_runner, directory, self.settings.mask_id)


def make_algorithm_class(name: str, base_cls, set_attention, configure):
    """An SGLang algorithm class: our core first in the MRO (its `run`), SGLang's base for the rest."""
    core = CORES[name]

    def __init__(self, config):
        base_cls.__init__(self, config)
        core.__init__(self, DecodeSettings.from_dict(config.algorithm_config))

    return type(
        name,
        (core, base_cls),
        {
            "__init__": __init__,
            "__doc__": core.__doc__,
            "requires_separate_context_encoding": True,
            # SGLang keeps a listed backend the user named, else forces the required one (Triton: CUDA);
            # check_device_and_attention then holds each device to its own (torch_native on the CPU engine).
            "required_attention_backend": "triton",
            "supported_attention_backends": tuple(ATTENTION_BY_DEVICE.values()),
            "reuse_forward_metadata": False,
            "capture_input_preparation": False,
            "set_attention": set_attention,
            "recurrent_state_guard": mamba_state_guard,
            "draft_router": draft_router,
            "configure_server_args": classmethod(configure),
            "validate_request": classmethod(lambda cls, req: unsupported_request(req)),
        },
    )


def unsupported_request(req) -> str | None:
    """SGLang's `validate_request`: the request features our algorithms do not apply, as an error."""
    sp = req.sampling_params
    defaults = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "min_p": 0.0,
    }
    bad = [name for name, default in defaults.items() if getattr(sp, name, default) != default]
    bad += [name for name in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(sp, name, None) is not None]
    bad += ["sampling_seed"] if getattr(sp, "sampling_seed", None) is not None else []  # ours: from the rid
    bad += ["logit_bias"] if getattr(sp, "logit_bias", None) else []
    bad += ["logprobs"] if getattr(req, "return_logprob", False) else []
    logprob = getattr(req, "logprob", None)
    bad += [name for name in ("top_logprobs_num", "token_ids_logprob") if getattr(logprob, name, None)]
    bad += ["custom_logit_processor"] if getattr(req, "custom_logit_processor", None) else []
    if not bad:
        return None
    return f"bdstack's diffusion/self-spec algorithms do not support {', '.join(bad)}; use --mode causal for these"


# Where our canvases get their bidirectional mask: CUDA through SGLang's Triton backend (its own
# DECODER_BIDIRECTIONAL extend), the CPU engine through our torch_native extend (canvas_attention.py). Every
# other pair would attend a canvas causally, or fail later less clearly: refused at start.
ATTENTION_BY_DEVICE = {"cuda": "triton", "cpu": "torch_native"}


def check_device_and_attention(view) -> None:
    """Refuse, in one line, a device we cannot serve or an attention backend that would not honour our canvas
    mask there. A device SGLang has not resolved yet (None) is CUDA, its default on a GPU machine."""
    device = getattr(view, "device", None) or "cuda"
    want = ATTENTION_BY_DEVICE.get(device)
    if want is None:
        raise PluginError(
            f"the bdstack SGLang algorithms run on CUDA (triton attention) or on SGLang's CPU engine (torch_native "
            f"attention), not on --device {device}; use the native engine there"
        )
    fields = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    got = {f: getattr(view, f, None) for f in fields}
    if got["attention_backend"] != want or any(b not in (None, want) for b in got.values()):
        named = ", ".join(f"--{f.replace('_', '-')} {b}" for f, b in got.items() if b not in (None, want)) or "none"
        raise PluginError(
            f"on --device {device} the bdstack SGLang algorithms need --attention-backend {want} (the backend "
            f"whose canvas mask they set), and no other prefill/decode backend; got {named}"
        )


def _draft_adapter_named(config_path: str | None) -> bool:
    """Whether our settings YAML at `config_path` names a draft adapter (False when there is none to read)."""
    if config_path is None or not Path(config_path).is_file():
        return False
    return bool((read_settings_yaml(config_path) or {}).get("draft_adapter"))


def server_arg_decisions(view) -> dict:
    """Launch-time constraints: no radix cache (canvas tokens are not reusable KV), no chunked
    prefill (the seed is the context's last row), no CUDA graphs (the attention type changes per
    forward), no first-done-first-out rounds (each round commits its tokens). SGLang turns FDFO on by
    default; our DllmConfig never uses it, and the resolved flag is set off to say so."""
    if getattr(view, "enable_linear_replayssm", False):
        raise PluginError("--enable-linear-replayssm is not supported by the bdstack algorithms (state snapshots)")
    check_device_and_attention(view)
    if getattr(view, "device", None) == "cpu" and _draft_adapter_named(getattr(view, "dllm_algorithm_config", None)):
        # Tried once (2026-12-08): SGLang 0.5.23's LoRA layers allocate with pin_memory=True (lora/layers.py:475,
        # sglang issue #31894), so the first request would crash the scheduler. Refused at start instead.
        raise PluginError(
            "draft adapters do not run on SGLang's CPU engine (its LoRA layers pin memory, which needs an "
            "accelerator); serve this checkpoint with --backend native or --backend vllm on a CPU"
        )
    decisions = {"disable_radix_cache": True, "chunked_prefill_size": -1}
    if getattr(view, "dllm_fdfo", False):
        logger.warning("--dllm-fdfo is ignored: the bdstack algorithms commit every round (--no-dllm-fdfo)")
        decisions["dllm_fdfo"] = False
    return decisions


# -- the SGLang side -----------------------------------------------------------------------------
_registered = False


def register() -> None:
    """Make our algorithms and checkpoints known to this SGLang process (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        import sglang
    except ImportError as e:
        raise PluginError(
            "SGLang is not installed in this interpreter; run the launcher with SGLang's own environment "
            f"(serve.py --sglang-python PATH or $BDSTACK_SGLANG_PYTHON; see inference/sglang_backend/README.md): {e}"
        ) from e
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.dllm import algorithm as algorithm_table
    from sglang.srt.dllm.algorithm.base import DllmAlgorithm
    from sglang.srt.dllm.config import DllmConfig
    from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    version = getattr(sglang, "__version__", "unknown")
    if version != TESTED_SGLANG:
        logger.warning("bdstack's SGLang plugin was written against SGLang %s; this is %s", TESTED_SGLANG, version)

    def configure(cls, server_args) -> None:
        view = resolving_view(server_args)
        graphs = with_phase(view.cuda_graph_config, Phase.PREFILL, backend=Backend.DISABLED)
        graphs = with_phase(graphs, Phase.DECODE, backend=Backend.DISABLED)
        declare_resolution(server_args, cls.__name__, cuda_graph_config=graphs, **server_arg_decisions(view))

    switch = attention_switch(RadixAttention, AttentionType)
    for name in CORES:
        algorithm_table.algo_name_to_cls[name] = make_algorithm_class(name, DllmAlgorithm, switch, configure)
    if not getattr(DllmConfig.from_server_args, "bdstack", False):
        DllmConfig.from_server_args = staticmethod(
            wrap_config_factory(DllmConfig.from_server_args, DllmConfig, resolving_view)
        )
    try:
        register_canvas_attention(AttentionType, DllmConfig)
    except ImportError as e:  # an SGLang without its model zoo (the contract check stubs its configs): no CPU
        # engine can start there; and where one does, check_canvas_backend refuses SGLang's own torch_native
        logger.info("bdstack: torch_native canvas attention not registered (%s)", e)
    _registered = True


def register_canvas_attention(attention_type, dllm_config_cls) -> None:
    """SGLang's CPU engine: `torch_native` in SGLang's attention registry becomes our backend with the canvas
    rule (canvas_attention.py), so a DECODER_BIDIRECTIONAL layer is never attended causally. Causal layers take
    SGLang's own path. Runs in every process `register()` runs in, the spawned scheduler included."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from inference.sglang_backend.canvas_attention import canvas_backend_factory

    if getattr(attention_registry.ATTENTION_BACKENDS.get("torch_native"), "bdstack", False):
        return

    def canvas_size(model_runner) -> int | None:
        config = dllm_config_cls.from_server_args(model_runner.server_args)
        return None if config is None else config.block_size

    factory = canvas_backend_factory(TorchNativeAttnBackend, attention_type, canvas_size)
    attention_registry.ATTENTION_BACKENDS["torch_native"] = factory
