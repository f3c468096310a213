"""Run scripts for the two Korean tool-calling benchmarks, FunctionChat-Bench and Ko-AgentBench
(`python -m benchmark.agentic.configure functionchat|ko_agentbench ...` writes them).

Neither is a pip package: each script clones the benchmark at the commit read for bdstack (README.md,
sections 7 and 8), builds the benchmark's own virtual environment the first time, then runs it against
the server. Their data comes with the clone, at the user's run time; nothing of theirs is in bdstack.
"""

from __future__ import annotations

import shlex
from pathlib import Path

FUNCTIONCHAT = ("https://github.com/kakao/FunctionChat-Bench", "cb32af378a2b94ee84fc4d3cb50302377c7ff679")
KO_AGENTBENCH = ("https://github.com/Hugging-Face-KREW/Ko-AgentBench", "1174fedd9fa1c7177baa0cbff039a765c9b14d02")
# What Ko-AgentBench's API route imports (its `uv sync` also installs vLLM and transformers for its local
# routes, which a run against a server does not use); the versions verified with it.
KO_AGENTBENCH_PACKAGES = (
    "litellm==1.110.2",
    "python-dotenv==1.2.4",
    "requests==2.34.2",
    "beautifulsoup4==4.15.0",
    "pyjwt==2.15.1",
    "pyyaml==6.0.4",
    "pandas==3.1.1",
    "jsonschema==4.26.0",
)


def _q(x) -> str:
    return shlex.quote(str(x))


def _setup(var: str, repo: tuple[str, str], src: Path, venv: Path, python: str, install: str) -> list[str]:
    """Shell lines that clone `repo` at its commit into $<var>_SRC and build $<var>_VENV with `python` (or
    $<var>_PYTHON), unless they are there already."""
    url, commit = repo
    return [
        "set -euo pipefail",
        f"{var}_SRC=${{{var}_SRC:-{_q(src)}}}",
        f"{var}_VENV=${{{var}_VENV:-{_q(venv)}}}",
        f'[ -d "${var}_SRC/.git" ] || git clone {_q(url)} "${var}_SRC"',
        f'git -C "${var}_SRC" checkout -q {commit}  # the commit read for bdstack',
        f'if [ ! -x "${var}_VENV/bin/python" ]; then',
        f'    "${{{var}_PYTHON:-{python}}}" -m venv "${var}_VENV"',
        f"    {install}",
        "fi",
        f'cd "${var}_SRC"',
    ]


def functionchat(base_url, model, out: Path, *, api_key="EMPTY", temperature=0.1, **_) -> dict[str, str]:
    """FunctionChat-Bench: its `inhouse` model route (openai SDK, base_url + served_model_name) on the
    Singlecall and CallDecision sets, scored by exact match of the calls, and with the rubric judge
    (GPT-4.1 through OpenAI's batch API, key in config/openai.cfg) when asked for, also the Dialog set."""
    lines = [
        "#!/usr/bin/env bash",
        "# FunctionChat-Bench (Kakao, Apache-2.0) against a bdstack server. Its client waits 30 s per request",
        "# (3 tries): serve with a --max-tokens that a reply finishes within that.",
        *_setup(
            "FUNCTIONCHAT",
            FUNCTIONCHAT,
            out / "src" / "FunctionChat-Bench",
            out / "venvs" / "functionchat",
            "python3.11",  # its pins (numpy 1.24.0, pandas 2.0.3) have no wheels past 3.11
            '"$FUNCTIONCHAT_VENV/bin/pip" install -r requirements.txt',
        ),
        "# True: exact match of the calls only (no OpenAI key). False: also the GPT-4.1 rubric judge, which",
        "# reads its key from $FUNCTIONCHAT_SRC/config/openai.cfg (the published scores use it).",
        'ONLY_EXACT="${FUNCTIONCHAT_ONLY_EXACT:-True}"',
        f"SERVER=(--model inhouse --base_url {_q(base_url)} --api_key {_q(api_key)} "
        f'--served_model_name {_q(model)} --temperature {temperature} --only_exact "$ONLY_EXACT")',
        'PY="$FUNCTIONCHAT_VENV/bin/python"',
        '"$PY" evaluate.py singlecall --input_path data/FunctionChat-Singlecall.jsonl --tools_type all \\\n'
        '    --system_prompt_path data/system_prompt.txt "${SERVER[@]}"',
        '"$PY" evaluate.py common --input_path data/FunctionChat-CallDecision.jsonl "${SERVER[@]}"',
        "# Dialog turns are mostly answers, slot questions and refusals, which only the judge scores (at",
        "# cb32af3 its exact-match-only report of this set divides by zero on them)",
        'if [ "$ONLY_EXACT" = False ]; then',
        '    "$PY" evaluate.py dialog --input_path data/FunctionChat-Dialog.jsonl \\\n'
        '        --system_prompt_path data/system_prompt.txt "${SERVER[@]}"',
        "else",
        '    echo "FunctionChat-Dialog skipped: it needs the judge (FUNCTIONCHAT_ONLY_EXACT=False)"',
        "fi",
        'echo "scores: $FUNCTIONCHAT_SRC/output/<served model>/FunctionChat-<served model>.eval_score.json"',
    ]
    return {"run_functionchat.sh": "\n".join(lines) + "\n"}


def ko_agentbench(base_url, model, out: Path, *, api_key="EMPTY", levels="L1,L2,L3,L4,L5,L6,L7", **_):
    """Ko-AgentBench: its LiteLLM route with `openai/NAME`, which reaches the server through LiteLLM's
    OPENAI_API_BASE (the runner has no base-URL option). The runner fixes temperature 0.7 and max_tokens
    1024 itself. Tools answer from the cache shipped with the benchmark (no service keys)."""
    if "gpt-5" in model.lower() or model.lower().startswith("openrouter/"):
        # the runner routes these by name: gpt-5 to Azure's Responses API, openrouter/ to OpenRouter
        raise ValueError(
            f"Ko-AgentBench sends a model named {model!r} to another API, not to this server: "
            "serve it under another --served-model-name"
        )
    env_file = out / "ko_agentbench.env"
    env = [
        "# LiteLLM reads these for `openai/NAME` models: the server's URL (OPENAI_BASE_URL first, then",
        "# OPENAI_API_BASE, as LiteLLM 1.110 looks them up) and the key it expects",
        f"OPENAI_BASE_URL={_q(base_url)}",
        f"OPENAI_API_BASE={_q(base_url)}",
        f"OPENAI_API_KEY={_q(api_key)}",
        "LITELLM_LOCAL_MODEL_COST_MAP=True",
    ]
    install = '"$KO_AGENTBENCH_VENV/bin/pip" install ' + " ".join(KO_AGENTBENCH_PACKAGES)
    lines = [
        "#!/usr/bin/env bash",
        "# Ko-AgentBench (HF KREW, Apache-2.0) against a bdstack server.",
        *_setup(
            "KO_AGENTBENCH",
            KO_AGENTBENCH,
            out / "src" / "Ko-AgentBench",
            out / "venvs" / "ko_agentbench",
            "python3.11",  # it asks for >= 3.10
            install,
        ),
        'PY="$KO_AGENTBENCH_VENV/bin/python"',
        'RUN_DATE="$(date +%Y%m%d)"  # the evaluation finds the run by its date',
        "# the run, in a subshell so that the endpoint variables reach neither the judge nor this shell;",
        "# --timeout is per task (its default, 60 s, is short for an agent on one local server)",
        f"( set -a; . {_q(env_file)}; set +a",
        f'  "$PY" run_benchmark_with_logging.py --model {_q("openai/" + model)} --levels {_q(levels)} \\\n'
        "      --max-steps 10 --timeout 600 )",
        "# the LLM judge (default openai/gpt-4.1-mini; KO_AGENTBENCH_JUDGE to choose) goes to OpenAI",
        'if [ -n "${OPENAI_API_KEY:-}" ]; then',
        f'  "$PY" evaluate_model_run.py --date "$RUN_DATE" --model {_q("openai/" + model)} --format all \\\n'
        '      --judge-models "${KO_AGENTBENCH_JUDGE:-openai/gpt-4.1-mini}"',
        '  echo "reports: $KO_AGENTBENCH_SRC/reports/"',
        "else",
        '  echo "no OPENAI_API_KEY for the judge: the run logs are in $KO_AGENTBENCH_SRC/logs/benchmark_results"',
        "fi",
    ]
    return {"ko_agentbench.env": "\n".join(env) + "\n", "run_ko_agentbench.sh": "\n".join(lines) + "\n"}
