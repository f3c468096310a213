"""Client chat templates rendered under limits: a deadline and, where the tokenizer bounds a token's
characters, an output size.

With --allow-client-chat-template a request's Jinja template is code the server runs. Jinja's sandbox stops
attribute escapes, not work: two nested `range(100000)` loops (1e10 turns) render for many minutes, holding a
request thread and a core after the client left (and, writing a character a turn, filling memory), and
uvicorn's graceful shutdown waits for that request, so SIGTERM would not stop the server. Jinja compiles a
template to Python, so a trace function set on the rendering thread alone (`sys.settrace` is per thread) sees
every line a template's loop runs and stops the render by raising there. Only client templates are traced: the
server's own template is the operator's code, and tracing slows a render several times.

What a trace cannot stop is one long C call (`"x" * 10**9`, a `join` of a huge list): it runs to its end
and the render is stopped at the next line.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from inference.server_defaults import SERVER

_TEMPLATE_FILE = "<template>"  # the file name Jinja compiles every template under


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = SERVER.chat_template_timeout_s
    # Characters the template may write: the most the context can hold (max_context x the characters one
    # token stands for; more is refused after rendering anyway), None where the tokenizer promises no bound.
    max_chars: int | None = None
    max_context: int | None = None  # named in the refusal of an output past `max_chars`


DEFAULT_LIMITS = TemplateLimits()


class TemplateStopped(Exception):
    """A client template went past a limit; `problem` says which, for the client's 400."""

    def __init__(self, problem: str, code: str):
        super().__init__(problem)
        self.problem, self.code = problem, code


def render_bounded(render, limits: TemplateLimits):
    """`render()` (a chat template render) on this thread, stopped once it passes `limits`."""
    deadline = time.monotonic() + limits.seconds
    written = 0

    def check_time() -> None:
        # Raised at every event once late, not once: a frame that catches it (Jinja re-raises what a render
        # raises, after rewriting its traceback) is stopped at its next line or call.
        if time.monotonic() > deadline:
            raise TemplateStopped(
                f"the chat template ran past {limits.seconds:g} s, this server's limit for client chat templates "
                "(--chat-template-timeout), and was stopped; send a template that renders in less time",
                "chat_template_timeout",
            )

    def in_template(frame, event, arg):  # the local trace of the template's own frames: every line
        nonlocal written
        check_time()
        # Each yield of a template's `root` is one piece of its output (Template.render joins them), and a yield
        # is a "return" event: counted before the join, which would build the whole text at once in C.
        if event == "return" and isinstance(arg, str) and limits.max_chars is not None:
            if frame.f_code.co_name == "root":
                written += len(arg)
                if written > limits.max_chars:
                    raise TemplateStopped(
                        f"the chat template wrote more than {limits.max_chars} characters, more than this model's "
                        f"context of {limits.max_context} tokens can hold, and was stopped; shorten the messages "
                        "or the template's output",
                        "context_length_exceeded",
                    )
        return in_template

    def on_call(frame, event, arg):
        # Every Python call (a generator's resumption too) checks the time; only the template's frames are
        # traced line by line (its loops), which costs a render 3x rather than 5x when every frame is.
        check_time()
        return in_template if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()  # a debugger's or coverage's, put back after
    sys.settrace(on_call)  # this thread only; frames called from here on are traced, this one is not
    try:
        return render()
    finally:
        sys.settrace(previous)
