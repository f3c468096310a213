"""Does an OpenAI-compatible server accept what agentic harnesses send, and answer in OpenAI's shape?

    python -m benchmark.agentic.probe --base-url http://127.0.0.1:8000/v1 --model NAME [--json out.json]

Sends the request shapes that BFCL, tau2-bench, mini-swe-agent (SWE-bench), Terminal-Bench's Terminus,
FunctionChat-Bench and Ko-AgentBench send (through the openai SDK or LiteLLM): tools with JSON schemas
(Korean ones too), tool_choice auto / none / required / a named function, parallel_tool_calls,
multi-turn histories with assistant tool_calls and `tool` messages (reused ids, escaped arguments, calls
without results), system and developer prompts, content parts, response_format, max_completion_tokens, stop,
streaming with and without tools, the legacy completions endpoint, and the extra fields SDKs add.
Each answer is checked for OpenAI's shape: tool_calls with ids, known function names and arguments that
are a JSON object's text, finish_reason "tool_calls" when calls are present, usage counts, and for
streams well-formed chunks ending in [DONE].

Whether a model *chooses* to call a tool is the model's business: a reply without a call is reported
as "ok" with "no call". `--require-tool-calls` turns a missing call into a failure for the cases that
force one (tool_choice required or named), for use with a real tool-calling model. Only the standard
library is used, so the probe runs in any environment (a harness's own venv included).
Exit status: 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from benchmark.agentic.case import Case
from benchmark.agentic.probe_cases import cases


@dataclass
class Result:
    case: Case
    ok: bool
    detail: str
    calls: int | None = None  # tool calls in the reply (None: not a tool request)
    seconds: float = 0.0


class ShapeError(Exception):
    pass


def _need(cond, msg: str) -> None:
    if not cond:
        raise ShapeError(msg)


def _http(base_url: str, case: Case, model: str, api_key: str | None, timeout: float):
    data = None
    if case.method == "POST":
        data = json.dumps({"model": model, **case.body}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + case.path, data=data, method=case.method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _usage(u) -> None:
    _need(isinstance(u, dict), "no usage object")
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        _need(isinstance(u.get(k), int), f"usage.{k} is not an integer")


def _check_calls(calls, tool_names: set[str], finish) -> int:
    _need(isinstance(calls, list) and calls, "tool_calls must be a non-empty list")
    for c in calls:
        _need(isinstance(c.get("id"), str) and c["id"], "a tool call has no id")
        _need(c.get("type") == "function", "a tool call's type is not 'function'")
        fn = c.get("function") or {}
        _need(fn.get("name") in tool_names, f"tool call names an unknown function {fn.get('name')!r}")
        _need(isinstance(fn.get("arguments"), str), "function.arguments must be a string")
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError as e:
            raise ShapeError(f"function.arguments is not JSON: {e}") from e
        _need(isinstance(args, dict), "function.arguments is not a JSON object")
    _need(finish == "tool_calls", f"finish_reason is {finish!r} with tool calls (want 'tool_calls')")
    return len(calls)


def _check_message(message: dict, finish, case: Case) -> int | None:
    _need(message.get("role") == "assistant", "message.role is not 'assistant'")
    tool_names = {t["function"]["name"] for t in case.body.get("tools", [])}
    calls = message.get("tool_calls")
    n = 0
    if calls:
        _need(not case.check.get("no_calls"), "tool calls came back although tool_choice was 'none'")
        n = _check_calls(calls, tool_names, finish)
        if case.check.get("name"):
            _need(all(c["function"]["name"] == case.check["name"] for c in calls), "call to another function")
        if case.check.get("max_calls"):
            _need(n <= case.check["max_calls"], f"{n} calls although parallel_tool_calls was false")
    else:
        _need(isinstance(message.get("content"), str), "no tool_calls and content is not a string")
        _need(finish in ("stop", "length"), f"finish_reason {finish!r} without tool calls")
    return n if tool_names else None


def _check_chat(status: int, text: str, case: Case) -> int | None:
    body = json.loads(text)
    _need(body.get("object") == "chat.completion", "object is not 'chat.completion'")
    _need(isinstance(body.get("id"), str), "no id")
    choices = body.get("choices")
    _need(isinstance(choices, list) and len(choices) == 1, "choices must hold one choice")
    _usage(body.get("usage"))
    return _check_message(choices[0].get("message") or {}, choices[0].get("finish_reason"), case)


def _check_stream(status: int, text: str, case: Case) -> int | None:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    _need(events and events[-1] == "[DONE]", "stream does not end with [DONE]")
    content, calls, finish, role, usage = "", {}, None, None, None
    for raw in events[:-1]:
        chunk = json.loads(raw)
        _need("error" not in chunk, f"error event: {chunk.get('error')}")
        _need(chunk.get("object") == "chat.completion.chunk", "a chunk's object is not 'chat.completion.chunk'")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            role = delta.get("role", role)
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                _need(isinstance(tc.get("index"), int), "a streamed tool call has no index")
                slot = calls.setdefault(
                    tc["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}}
                )
                slot["id"] = tc.get("id") or slot["id"]
                slot["type"] = tc.get("type") or slot["type"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    _need(role == "assistant", "no delta with role 'assistant'")
    if case.body.get("stream_options", {}).get("include_usage"):
        _usage(usage)
    message = {"role": role, "content": content if not calls or content else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return _check_message(message, finish, case)


def _check_completion(status: int, text: str, case: Case) -> None:
    body = json.loads(text)
    _need(body.get("object") == "text_completion", "object is not 'text_completion'")
    choice = (body.get("choices") or [{}])[0]
    _need(isinstance(choice.get("text"), str), "choices[0].text is not a string")
    _need(choice.get("finish_reason") in ("stop", "length"), "bad finish_reason")
    _usage(body.get("usage"))


def _check_models(status: int, text: str, case: Case, model: str) -> None:
    ids = [m.get("id") for m in json.loads(text).get("data", [])]
    _need(model in ids, f"/models lists {ids}, not {model!r}")


def run_case(base_url: str, model: str, case: Case, *, api_key=None, timeout=300.0, require_calls=False) -> Result:
    t0 = time.perf_counter()
    try:
        status, text = _http(base_url, case, model, api_key, timeout)
    except Exception as e:  # connection refused, timeout
        return Result(case, False, f"request failed: {e}", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if status != 200:
        try:
            msg = json.loads(text)["error"]["message"]
        except Exception:
            msg = text[:200]
        return Result(case, False, f"rejected: HTTP {status}: {msg}", seconds=seconds)
    try:
        calls = None
        if case.path == "/models":
            _check_models(status, text, case, model)
        elif case.path == "/completions":
            _check_completion(status, text, case)
        elif case.body.get("stream"):
            calls = _check_stream(status, text, case)
        else:
            calls = _check_chat(status, text, case)
        if require_calls and case.check.get("forced") and not calls:
            return Result(case, False, "no tool call although one was forced", calls, seconds)
    except (ShapeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        return Result(case, False, f"bad shape: {e}", seconds=seconds)
    return Result(case, True, "", calls, seconds)


def run_probe(base_url: str, model: str, *, api_key=None, max_tokens=32, timeout=300.0, require_calls=False):
    return [
        run_case(base_url, model, c, api_key=api_key, timeout=timeout, require_calls=require_calls)
        for c in cases(max_tokens)
    ]


def table(results: list[Result]) -> str:
    lines = ["| case | used by | result | tool calls | s |", "|---|---|---|---|---|"]
    for r in results:
        calls = "-" if r.calls is None else ("no call" if r.calls == 0 else str(r.calls))
        verdict = "ok" if r.ok else f"FAIL: {r.detail}"
        lines.append(f"| {r.case.name} | {r.case.used_by} | {verdict} | {calls} | {r.seconds:.2f} |")
    passed = sum(r.ok for r in results)
    lines.append(f"\n{passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.agentic.probe",
        description="Send the request shapes agentic harnesses use and check the answers' OpenAI shape.",
    )
    p.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    p.add_argument(
        "--require-tool-calls",
        action="store_true",
        help="fail the forced cases (tool_choice required / named) when no call comes back",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    results = run_probe(
        args.base_url,
        args.model,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        timeout=args.timeout,
        require_calls=args.require_tool_calls,
    )
    print(table(results))
    if args.json:
        rows = [
            {"case": r.case.name, "used_by": r.case.used_by, "ok": r.ok, "detail": r.detail, "tool_calls": r.calls}
            for r in results
        ]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
