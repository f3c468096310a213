"""What every route of the server shares: the engine and its scheduler, the metrics, the request
threads, and the limits the server was started with."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bdcore.decode.memory import RequestFloor, available_bytes, describe, request_bytes
from bdcore.loading import LoadedModel
from inference.native.engine import DecodeConfig, Engine
from inference.native.scheduler import Scheduler
from inference.server.prometheus import ServerMetrics
from inference.server.prompt_bound import chars_per_token
from inference.server.template_limits import TemplateLimits


@dataclass
class ServerState:
    loaded: LoadedModel
    decode: DecodeConfig  # the server's default; a request may pick another mode
    engine: Engine
    scheduler: Scheduler
    metrics: ServerMetrics
    workers: ThreadPoolExecutor
    model_name: str
    default_max_tokens: int
    max_context: int
    chars_per_token: int | None  # prompt_bound.py: prompts too long are refused before tokenising
    vocab_size: int  # the ids a prompt may hold: tokens of the tokenizer that the model has rows for
    max_request_bytes: int
    allow_client_chat_template: bool
    request_floor: RequestFloor  # what a request holds at least (bdcore.decode.memory): refused when it cannot
    template_limits: TemplateLimits  # what a client's chat template may cost (template_limits.py)

    @classmethod
    def build(
        cls,
        loaded: LoadedModel,
        decode: DecodeConfig,
        *,
        model_name: str,
        default_max_tokens: int,
        max_batch: int,
        max_request_bytes: int,
        allow_client_chat_template: bool,
        chat_template_timeout: float,
        compiled: bool = False,
    ) -> ServerState:
        floor = RequestFloor.of(loaded.model.config, next(loaded.model.parameters()).dtype)
        _check_smallest_requests_fit(loaded, decode, floor)
        engine = Engine(loaded, decode, compiled=compiled)
        if engine.compile_seconds is not None:  # serve.py's start-up report, beside "serving ... at"
            print(f"decode step compiled in {engine.compile_seconds:.0f} s (inductor's disk cache: less next start)")
        if _serves_auto_self_spec(loaded):
            # The self-spec cost model is measured here, on the thread that loaded the model and will decode
            # (serve.py's main thread). Measured at a request's first `auto`, it ran on that request's thread,
            # whose OpenMP team of its own slowed every later forward of the process by about a third on a
            # 2-core CPU. Cached on disk after.
            engine.speculation()
        scheduler = Scheduler(engine, max_batch)
        metrics = ServerMetrics()
        metrics.watch(engine.driver, scheduler.batch_sizes)
        # Each in-flight request blocks a thread until it ends; asyncio's default pool holds cores + 4 threads
        # (6 on a 2-core machine), which would cap the scheduler's batch below --max-batch. Queued requests
        # hold threads too, so the pool has room beyond the batch.
        workers = ThreadPoolExecutor(max_workers=max(64, 4 * max_batch), thread_name_prefix="bdstack-request")
        max_context = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
        per_token = chars_per_token(loaded.tokenizer)
        max_chars = max_context * per_token if per_token else None  # past it, the prompt is refused anyway
        return cls(
            loaded=loaded,
            decode=decode,
            engine=engine,
            scheduler=scheduler,
            metrics=metrics,
            workers=workers,
            model_name=model_name,
            default_max_tokens=default_max_tokens,
            max_context=max_context,
            chars_per_token=per_token,
            vocab_size=min(len(loaded.tokenizer), loaded.model.get_input_embeddings().num_embeddings),
            max_request_bytes=max_request_bytes,
            allow_client_chat_template=allow_client_chat_template,
            request_floor=floor,
            template_limits=TemplateLimits(chat_template_timeout, max_chars, max_context),
        )

    def start(self, fn) -> asyncio.Future:
        """Run `fn` in a request thread (the scheduler decides what runs together)."""
        return asyncio.get_running_loop().run_in_executor(self.workers, fn)


def _serves_auto_self_spec(loaded: LoadedModel) -> bool:
    """Whether a request may ask this checkpoint for self-spec with `draft_len` or canvases `auto`."""
    from bdcore.serving_gate import CannotServe, resolve

    try:
        resolve(loaded.capabilities, DecodeConfig(mode="self-spec", draft_len="auto"), "native")
    except CannotServe:
        return False
    return True


def _check_smallest_requests_fit(loaded: LoadedModel, decode: DecodeConfig, floor: RequestFloor) -> None:
    """Refuse to start (one line from serve.py) when even a one-token request of a mode a request may pick
    cannot fit: every such request would be refused. A sidecar block of 10**9 under a context of 2 * 10**9 passed
    every other check and answered a MemoryError 500, or grew until the process was killed."""
    from dataclasses import replace

    from bdcore.serving_gate import CannotServe, resolve, served_modes

    room = available_bytes()
    if room is None:
        return
    for mode in dict.fromkeys((decode.mode, *served_modes(loaded.capabilities, "native"))):
        try:
            resolved = resolve(loaded.capabilities, replace(decode, mode=mode), "native")
        except CannotServe:
            continue  # serve.py refused the server's own mode already; a request asking for this one gets a 400
        need = request_bytes(floor, resolved, 1, 1)
        if need > room:
            diffusion = mode == "diffusion"
            flag, size = ("--block-size", resolved.block) if diffusion else ("--draft-len", resolved.draft_len)
            which = "" if mode == decode.mode else ", which a request may pick"
            raise ValueError(
                f"{mode} mode{which}, with {flag} {size}: a one-token request needs at least {describe(need)}, more "
                f"than the {describe(room)} this process can still allocate; serve with a smaller {flag}, or fix "
                "bd_size in block_diffusion.json to the block size the checkpoint was trained with"
            )
