"""Probe cases in the shapes the two Korean tool-calling benchmarks send: FunctionChat-Bench (Kakao;
openai SDK, `model`, `messages`, `tools`, `temperature` and nothing else) and Ko-AgentBench (HF KREW;
LiteLLM, `tools` with `tool_choice` "auto", `temperature` 0.7, `max_tokens` 1024). The Korean tools and
dialogs are written for bdstack in those shapes; none of them is the benchmarks' data."""

from __future__ import annotations

import json

from benchmark.agentic.case import Case


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


KO_TOOLS = [
    _tool(
        "add_schedule",
        "캘린더에 새 일정을 추가한다.",
        {
            "title": {"type": "string", "description": "일정 제목"},
            "date": {"type": "string", "description": "날짜 (YYYY-MM-DD)"},
            "remind": {"type": "boolean", "description": "하루 전에 알림을 보낼지 여부"},
        },
        ["title", "date"],
    ),
    _tool(
        "search_restaurant",
        "지역과 음식 종류로 식당을 찾는다.",
        {
            "region": {"type": "string", "description": "동네나 역 이름 (예: 강남역)"},
            "cuisine": {"type": "string", "enum": ["한식", "중식", "일식", "양식"]},
            "count": {"type": "integer", "description": "보여 줄 식당 수"},
        },
        ["region"],
    ),
    _tool(
        "exchange_rate",
        "두 통화 사이의 현재 환율을 알려 준다.",
        {
            "base": {"type": "string", "description": "기준 통화 코드 (예: KRW)"},
            "target": {"type": "string", "description": "바꿀 통화 코드 (예: JPY)"},
            "amount": {"type": "number", "description": "바꿀 금액"},
        },
        ["base", "target"],
    ),
]
KO_SYSTEM = {
    "role": "system",
    "content": "당신은 사용자와 한국어로 대화하는 AI 비서입니다. 알맞은 도구가 있으면 호출하고, "
    "필요한 값이 빠졌으면 임의로 채우지 말고 사용자에게 물어보세요.",
}
KO_ASK = {"role": "user", "content": "다음 주 화요일에 치과 예약 일정 넣어 줘. 날짜는 2025-03-11이야."}


def ko_call(call_id: str, name: str, args: dict, *, ascii_only: bool = False) -> dict:
    """An assistant tool call as the Korean harnesses send it back: FunctionChat-Bench's data keeps Hangul
    in `arguments`; Ko-AgentBench writes them with json.dumps' default, which escapes it (\\uXXXX)."""
    text = json.dumps(args, ensure_ascii=ascii_only)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def korean_cases(max_tokens: int) -> list[Case]:
    """What FunctionChat-Bench (openai SDK: model, messages, tools, temperature; nothing else) and
    Ko-AgentBench (LiteLLM: tools with tool_choice "auto", temperature 0.7, max_tokens 1024) send, with
    Korean text; max_tokens is the probe's own for all of them, so that the probe stays short."""
    mt = {"max_tokens": max_tokens}
    schedule = ko_call("random_id", "add_schedule", {"title": "치과 예약", "date": "2025-03-11"})
    rate = ko_call("random_id", "exchange_rate", {"base": "KRW", "target": "JPY", "amount": 50000})
    seeded = ko_call("seed_call_2_1", "search_restaurant", {"region": "강남역", "cuisine": "한식"}, ascii_only=True)
    first = ko_call("call_a", "exchange_rate", {"base": "KRW", "target": "USD"}, ascii_only=True)
    second = ko_call("call_b", "exchange_rate", {"base": "KRW", "target": "JPY"}, ascii_only=True)
    return [
        Case(
            "Korean system, user and tool schemas",
            "FunctionChat-Bench (singlecall, CallDecision)",
            {"messages": [KO_SYSTEM, KO_ASK], "tools": KO_TOOLS, "temperature": 0.1, **mt},
        ),
        Case(
            "history: one call id reused, tool message with name",
            "FunctionChat-Bench (dialog)",
            {
                "messages": [
                    KO_SYSTEM,
                    KO_ASK,
                    {"role": "assistant", "content": None, "tool_calls": [schedule]},
                    # FunctionChat's tool results are Python reprs, not JSON
                    {"role": "tool", "tool_call_id": "random_id", "name": "add_schedule", "content": "{'ok': True}"},
                    {"role": "assistant", "content": "3월 11일에 치과 예약 일정을 추가했어요."},
                    {"role": "user", "content": "5만 원이면 엔화로 얼마야?"},
                    {"role": "assistant", "content": None, "tool_calls": [rate]},
                    {"role": "tool", "tool_call_id": "random_id", "name": "exchange_rate", "content": "{'jpy': 5150}"},
                ],
                "tools": KO_TOOLS,
                "temperature": 0.1,
                **mt,
            },
        ),
        Case(
            "history: call with no result, no content key",
            "Ko-AgentBench (L6/L7 seeded turns)",
            {
                "messages": [
                    {"role": "user", "content": "강남역 근처 한식집 알려 줘."},
                    {"role": "assistant", "tool_calls": [seeded]},  # a seeded action without a result
                    {"role": "assistant", "content": "강남역 근처 한식집을 찾아볼게요."},
                    {"role": "user", "content": "아까 찾은 곳 중에서 세 군데만 다시 보여 줘."},
                ],
                "tools": KO_TOOLS,
                "tool_choice": "auto",
                "temperature": 0.7,
                **mt,
            },
        ),
        Case(
            "history: parallel calls, empty content, escaped results",
            "Ko-AgentBench (L4 and every tool turn)",
            {
                "messages": [
                    {"role": "user", "content": "원화 기준으로 달러와 엔화 환율을 함께 비교해 줘."},
                    {"role": "assistant", "content": "", "tool_calls": [first, second]},
                    {"role": "tool", "tool_call_id": "call_a", "content": json.dumps({"rate": 0.00069, "통화": "USD"})},
                    {"role": "tool", "tool_call_id": "call_b", "content": json.dumps({"rate": 0.103, "통화": "JPY"})},
                ],
                "tools": KO_TOOLS,
                "tool_choice": "auto",
                "temperature": 0.7,
                **mt,
            },
        ),
    ]
