"""The OpenAI-compatible HTTP server over the native engine (FastAPI + uvicorn).

app.py             create_app: shared state, API key middleware, error handlers, routes
state.py           ServerState: engine, scheduler, metrics, request threads, limits
prepare.py         an HTTP request -> PreparedRequest (body, model, prompt ids, context, sampling, mode)
completion_prompts.py  /v1/completions' prompt: a string, token ids, or a list of either (one choice each)
prompt_bound.py    the most characters a token stands for: too long a prompt is refused before tokenising
template_limits.py client chat templates rendered under a deadline and an output bound
request_checks.py  what is checked before any work: body size and JSON, API key, field types
protocol.py        OpenAI request fields parsed and validated (sampling, tools, messages); APIError
generation.py      one generation request end to end: whole JSON reply, or SSE; cancels and counts
streaming.py       SSE streaming, holding back text that may be a tool call
responses.py       the reply shapes of chat and completions (one builder), usage, ids
token_text.py      each answer token's share of the reply's text (logprobs token strings, text_offset)
tool_calls.py      Hermes/Qwen <tool_call> parsing, the streaming hold-back boundary, forced prefixes
prometheus.py      /metrics on prometheus_client: counters, latency/forward/draft histograms, cost
run.py             serve_app: HTTP on a thread of its own, decoding on the thread that loaded the model; the
                   header timeout (connections that send no request head in time are closed)
"""

from inference.server.app import create_app
from inference.server.run import serve_app

__all__ = ["create_app", "serve_app"]
