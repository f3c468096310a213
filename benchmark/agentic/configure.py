"""Write each harness's configuration for a bdstack server, and the exact commands that use it.

    python -m benchmark.agentic.configure {bfcl,tau2,swebench,terminal-bench,functionchat,ko_agentbench,all} \\
        --base-url http://127.0.0.1:8000/v1 --model NAME --out runs/agentic [--checkpoint CKPT]

Writes into --out (one file set per harness) and prints the commands of `run_<harness>.sh`:

- bfcl:            run_bfcl.sh (BFCL's `bfcl` CLI through `python -m benchmark.agentic.bfcl_run`, which
                   registers the bdstack model entries in BFCL's model table at run time)
- tau2:            tau2_llm_args.json (LiteLLM arguments: api_base, api_key, temperature), run_tau2.sh
- swebench:        mini_swe_agent.yaml (a mini-swe-agent config layered over its swebench.yaml),
                   run_swebench.sh (trajectories with mini-extra swebench, then the swebench harness)
- terminal-bench:  run_terminal_bench.sh (`tb run` with Terminus-2, and `harbor run` for Terminal-Bench 2.0)
- functionchat:    run_functionchat.sh (FunctionChat-Bench's evaluate.py, `--model inhouse`, all three sets)
- ko_agentbench:   ko_agentbench.env (LiteLLM's endpoint variables), run_ko_agentbench.sh (the run, then
                   the LLM-judge evaluation against OpenAI, never against this server)

The last two clone the benchmark at the commit read for bdstack and build its own virtual environment
(never bdstack's .venv) the first time they run: their data is fetched then, not shipped here.

Every harness reaches the server through LiteLLM or the openai SDK as an OpenAI-compatible endpoint:
model `openai/NAME` plus the base URL (LiteLLM) or OPENAI_BASE_URL (openai SDK). The server needs no key
unless it was started with --api-key; the clients insist on one, so "EMPTY" is sent by default.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmark.agentic.configure_korean import functionchat, ko_agentbench

HARNESSES = ("bfcl", "tau2", "swebench", "terminal-bench", "functionchat", "ko_agentbench")


def _q(x) -> str:
    return shlex.quote(str(x))


def litellm_args(base_url: str, api_key: str, temperature: float) -> dict:
    """Keyword arguments LiteLLM's completion() needs for an OpenAI-compatible server (model `openai/NAME`)."""
    return {"api_base": base_url, "api_key": api_key, "temperature": temperature}


def bfcl(base_url, model, out: Path, *, api_key="EMPTY", checkpoint=None, **_) -> dict[str, str]:
    """BFCL v4: the FC route (chat completions + tools, our tool-call parser) and, given a checkpoint, the
    prompt route of BFCL's own Qwen handler (/v1/completions with BFCL's prompt; BFCL parses the calls)."""
    wrap = f"python -m benchmark.agentic.bfcl_run --base-url {_q(base_url)} --served-model {_q(model)}"
    wrap += f" --api-key {_q(api_key)}"
    if checkpoint:
        wrap += f" --checkpoint {_q(checkpoint)}"
    cats = "simple_python,multiple,parallel,parallel_multiple,irrelevance,multi_turn_base"
    lines = [
        "# BFCL v4 against a bdstack server. Run from the bdstack repo root with BFCL's venv active",
        "# (pip install bfcl-eval soundfile). Results and scores go under $BFCL_PROJECT_ROOT.",
        f"export BFCL_PROJECT_ROOT={_q(out / 'bfcl')}",
        'mkdir -p "$BFCL_PROJECT_ROOT"',
        "# FC route: POST /v1/chat/completions with tools; the server parses the model's <tool_call> blocks",
        f"{wrap} generate --model bdstack-FC --test-category {cats} --num-threads 1",
        f"{wrap} evaluate --model bdstack-FC --test-category {cats}",
    ]
    if checkpoint:
        lines += [
            "# prompt route: POST /v1/completions with BFCL's Qwen prompt; BFCL parses the calls itself.",
            "# The server must serve the checkpoint under its path: serve.py CKPT --served-model-name CKPT",
            f"{wrap} generate --model bdstack-qwen-FC --test-category {cats} --num-threads 1",
            f"{wrap} evaluate --model bdstack-qwen-FC --test-category {cats}",
        ]
    return {"run_bfcl.sh": "\n".join(lines) + "\n"}


def tau2(base_url, model, out: Path, *, api_key="EMPTY", temperature=0.0, user_llm=None, domain="airline", **_):
    """tau2-bench: agent (and, by default, user simulator) through LiteLLM as `openai/NAME` + api_base."""
    args = litellm_args(base_url, api_key, temperature)
    args_file = out / "tau2_llm_args.json"
    agent = f"openai/{model}"
    cmd = [
        "tau2 run",
        f"--domain {_q(domain)}",
        f"--agent-llm {_q(agent)}",
        f'--agent-llm-args "$(cat {_q(args_file)})"',
    ]
    if user_llm:  # e.g. gpt-4.1 as the leaderboard does (needs that provider's key)
        cmd += [f"--user-llm {_q(user_llm)}"]
    else:
        cmd += [f"--user-llm {_q(agent)}", f'--user-llm-args "$(cat {_q(args_file)})"']
    cmd += ["--num-trials 1", "--max-concurrency 1", f"--save-to {_q(out / 'tau2' / domain)}"]
    script = [
        "# tau2-bench against a bdstack server (run inside tau2-bench's checkout: uv sync, then uv run ...)",
        "export LITELLM_LOCAL_MODEL_COST_MAP=True  # offline: LiteLLM's bundled model table",
        " \\\n    ".join(cmd),
    ]
    return {"tau2_llm_args.json": json.dumps(args, indent=2) + "\n", "run_tau2.sh": "\n".join(script) + "\n"}


def swebench(base_url, model, out: Path, *, api_key="EMPTY", temperature=0.0, subset="verified", **_):
    """SWE-bench: mini-swe-agent (tool-calling `bash` agent, LiteLLM) writes preds.json; the swebench
    harness scores it."""
    import yaml

    cfg = {
        "model": {
            "model_name": f"openai/{model}",
            "model_kwargs": {**litellm_args(base_url, api_key, temperature), "drop_params": True},
            # a local model has no price in LiteLLM's table: cost is not tracked (step_limit still applies)
            "cost_tracking": "ignore_errors",
        }
    }
    overlay = out / "mini_swe_agent.yaml"
    traj = out / "swebench" / subset
    dataset = {"verified": "princeton-nlp/SWE-bench_Verified", "lite": "princeton-nlp/SWE-bench_Lite"}.get(
        subset, subset
    )
    script = [
        "# SWE-bench against a bdstack server: mini-swe-agent (pip install mini-swe-agent) writes patches,",
        "# the swebench harness (pip install swebench) runs each instance's tests in Docker.",
        "export LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_COST_TRACKING=ignore_errors",
        f"mini-extra swebench --subset {_q(subset)} --split test --workers 1 \\\n"
        f"    -c swebench.yaml -c {_q(overlay)} -o {_q(traj)}",
        f"python -m swebench.harness.run_evaluation --dataset_name {_q(dataset)} \\\n"
        f"    --predictions_path {_q(traj / 'preds.json')} --max_workers 4 --run_id bdstack-{_q(model)}",
    ]
    return {"mini_swe_agent.yaml": yaml.safe_dump(cfg, sort_keys=False), "run_swebench.sh": "\n".join(script) + "\n"}


def terminal_bench(base_url, model, out: Path, *, api_key="EMPTY", temperature=0.7, **_):
    """Terminal-Bench: Terminus-2 through LiteLLM (`openai/NAME`, api_base as an agent kwarg)."""
    script = [
        "# Terminal-Bench against a bdstack server (needs Docker). The OpenAI key only satisfies LiteLLM.",
        f"export OPENAI_API_KEY={_q(api_key)} LITELLM_LOCAL_MODEL_COST_MAP=True",
        "# Terminal-Bench 1 (core) with the terminal-bench package's `tb`:",
        f"tb run --dataset terminal-bench-core==0.1.1 --agent terminus-2 --model {_q('openai/' + model)} \\\n"
        f"    --agent-kwarg api_base={_q(base_url)} --agent-kwarg temperature={temperature} \\\n"
        f"    --n-concurrent 1 --output-path {_q(out / 'terminal-bench')}",
        "# Terminal-Bench 2.0 with Harbor (pip install harbor):",
        f"harbor run --dataset terminal-bench@2.0 --agent terminus-2 --model {_q('openai/' + model)} \\\n"
        f"    --agent-kwarg api_base={_q(base_url)} --n-concurrent 1 --jobs-dir {_q(out / 'harbor')}",
    ]
    return {"run_terminal_bench.sh": "\n".join(script) + "\n"}


WRITERS = {
    "bfcl": bfcl,
    "tau2": tau2,
    "swebench": swebench,
    "terminal-bench": terminal_bench,
    "functionchat": functionchat,
    "ko_agentbench": ko_agentbench,
}


def write(harness: str, out: Path, **kw) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for h in HARNESSES if harness == "all" else (harness,):
        for name, text in WRITERS[h](out=out, **kw).items():
            path = out / name
            path.write_text(text)
            if name.endswith(".sh"):
                path.chmod(0o755)
            written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.agentic.configure",
        description="Write agentic harness configs (BFCL, tau2-bench, SWE-bench, Terminal-Bench, FunctionChat-Bench, "
        "Ko-AgentBench) for a bdstack server.",
    )
    p.add_argument("harness", choices=[*HARNESSES, "all"])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (with /v1)")
    p.add_argument("--model", required=True, help="served model name (serve.py --served-model-name)")
    p.add_argument("--out", default="runs/agentic", help="where configs and run scripts are written")
    p.add_argument("--api-key", default="EMPTY", help="key the clients send (the server's --api-key, if any)")
    p.add_argument("--checkpoint", default=None, help="BFCL prompt route: the checkpoint directory (tokenizer)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (harness default if unset)")
    p.add_argument("--user-llm", default=None, help="tau2: user simulator model (default: the served model)")
    p.add_argument("--domain", default="airline", help="tau2 domain (airline, retail, telecom, mock)")
    p.add_argument("--subset", default="verified", help="SWE-bench subset for mini-swe-agent (verified, lite)")
    p.add_argument("--levels", default="L1,L2,L3,L4,L5,L6,L7", help="Ko-AgentBench levels to run")
    args = p.parse_args(argv)
    kw = dict(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        checkpoint=str(Path(args.checkpoint).resolve()) if args.checkpoint else None,
        user_llm=args.user_llm,
        domain=args.domain,
        subset=args.subset,
        levels=args.levels,
    )
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    try:
        written = write(args.harness, Path(args.out).resolve(), **kw)
    except ValueError as e:  # a setting the harness cannot work with, named with its fix
        p.error(str(e))
    for path in written:
        print(f"# wrote {path}")
        if path.suffix == ".sh":
            print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
