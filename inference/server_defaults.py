"""The serving defaults, written once: where a server listens and the native server's limits.

serve.py's flags, `create_app`, the scheduler, the request checks, the SGLang and vLLM commands and the clients
(chat.py, eval.py, the router) take theirs from `SERVER`. The decode settings' defaults (threshold, draft length,
self-spec layout) are `bdcore.decode.config.DecodeConfig`'s. Stdlib only: serve.py, the SGLang launcher and the
clients import it without torch or FastAPI (inference/server/__init__.py imports the app).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerDefaults:
    host: str = "127.0.0.1"  # this machine only
    port: int = 30000
    max_batch: int = 8  # requests decoded together (SGLang's --max-running-requests, vLLM's --max-num-seqs)
    max_tokens: int = 512  # a request's max_tokens when it gives none
    max_request_bytes: int = 4 * 2**20  # larger request bodies are refused with 413
    chat_template_timeout_s: float = 2.0  # client templates render in milliseconds (traced, a long chat ~0.1 s)
    header_timeout_s: float = 20.0  # a connection's request head must arrive within this (inference/server/run.py)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of a server listening on the defaults (the clients' default)."""
        return f"http://{self.host}:{self.port}/v1"


SERVER = ServerDefaults()
