"""The harness configs and run scripts `python -m benchmark.agentic.configure` writes: they parse, name the
endpoint, and (FunctionChat-Bench, Ko-AgentBench) run: each script is executed with stand-ins for git and
Python on PATH that record every command, so the clone, the checkout, the benchmark's own virtual
environment and each benchmark command are checked as the script issues them."""

import json
import os
import stat
import subprocess

import pytest

from benchmark.agentic import configure
from benchmark.agentic.configure_korean import FUNCTIONCHAT, KO_AGENTBENCH


def test_configure_writes_configs_that_parse_and_name_the_endpoint(tmp_path):
    import subprocess

    import yaml

    url, out = "http://127.0.0.1:8123/v1", tmp_path / "agentic"
    assert configure.main(["all", "--base-url", url, "--model", "my-bd", "--out", str(out), "--checkpoint", "ck"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "ko_agentbench.env",
        "mini_swe_agent.yaml",
        "run_bfcl.sh",
        "run_functionchat.sh",
        "run_ko_agentbench.sh",
        "run_swebench.sh",
        "run_tau2.sh",
        "run_terminal_bench.sh",
        "tau2_llm_args.json",
    ]
    mini = yaml.safe_load((out / "mini_swe_agent.yaml").read_text())["model"]
    assert mini["model_name"] == "openai/my-bd" and mini["model_kwargs"]["api_base"] == url
    assert mini["model_kwargs"]["api_key"] and mini["cost_tracking"] == "ignore_errors"
    assert json.loads((out / "tau2_llm_args.json").read_text()) == {
        "api_base": url,
        "api_key": "EMPTY",
        "temperature": 0.0,
    }
    for script in out.glob("*.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)  # valid shell
        text = script.read_text()
        # tau2, mini-swe-agent and Ko-AgentBench read the URL from their config files
        assert url in text or script.name in ("run_tau2.sh", "run_swebench.sh", "run_ko_agentbench.sh"), script.name
    tau2 = (out / "run_tau2.sh").read_text()
    assert "--agent-llm openai/my-bd" in tau2 and str(out / "tau2_llm_args.json") in tau2
    bfcl = (out / "run_bfcl.sh").read_text()
    assert "--model bdstack-FC" in bfcl and "--model bdstack-qwen-FC" in bfcl and "--served-model my-bd" in bfcl
    sweb = (out / "run_swebench.sh").read_text()
    assert "-c swebench.yaml -c " + str(out / "mini_swe_agent.yaml") in sweb and "preds.json" in sweb
    tb = (out / "run_terminal_bench.sh").read_text()
    assert f"--agent-kwarg api_base={url}" in tb and "--model openai/my-bd" in tb and "--agent terminus-2" in tb
    # a user simulator elsewhere (tau2's leaderboard uses gpt-4.1): no bdstack args for it
    configure.main(["tau2", "--model", "m", "--out", str(out), "--user-llm", "gpt-4.1", "--domain", "retail"])
    tau2 = (out / "run_tau2.sh").read_text()
    assert "--user-llm gpt-4.1" in tau2 and "--user-llm-args" not in tau2 and "--domain retail" in tau2


# A stand-in for git and for python3.11 (and the python / pip of the venv it makes): each appends its
# name, arguments and the endpoint variables it sees to $CALLS, one JSON line per command.
RECORDER = """#!/usr/bin/env python3
import json, os, sys
name = os.path.basename(sys.argv[0])
env = {k: os.environ.get(k) for k in ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY")}
with open(os.environ["CALLS"], "a") as f:
    f.write(json.dumps({"cmd": name, "args": sys.argv[1:], "cwd": os.getcwd(), "env": env}) + "\\n")
if name == "git" and sys.argv[1] == "clone":
    os.makedirs(os.path.join(sys.argv[3], ".git"))
if name.startswith("python3") and sys.argv[1:3] == ["-m", "venv"]:
    os.makedirs(os.path.join(sys.argv[3], "bin"))
    for tool in ("python", "pip"):
        os.symlink(os.path.abspath(sys.argv[0]), os.path.join(sys.argv[3], "bin", tool))
"""


def run_script(tmp_path, script, env=None):
    """Run a generated script with the recorders first on PATH; returns the recorded commands."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir(exist_ok=True)
    for name in ("git", "python3.11"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(stat.S_IRWXU)
    base = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), **(env or {})}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()], r.stdout


def test_functionchat_script_clones_builds_its_venv_and_runs_the_sets(tmp_path):
    url, out = "http://127.0.0.1:8124/v1", tmp_path / "out"
    assert configure.main(["functionchat", "--base-url", url, "--model", "my-bd", "--out", str(out)]) == 0
    calls, _ = run_script(tmp_path, out / "run_functionchat.sh")
    src, venv = out / "src" / "FunctionChat-Bench", out / "venvs" / "functionchat"
    assert calls[0]["args"] == ["clone", FUNCTIONCHAT[0], str(src)]
    assert calls[1]["args"] == ["-C", str(src), "checkout", "-q", FUNCTIONCHAT[1]]
    assert calls[2]["cmd"] == "python3.11" and calls[2]["args"] == ["-m", "venv", str(venv)]
    assert calls[3]["cmd"] == "pip" and calls[3]["args"] == ["install", "-r", "requirements.txt"]
    runs = calls[4:]
    assert [c["args"][:2] for c in runs] == [["evaluate.py", "singlecall"], ["evaluate.py", "common"]]
    for c in runs:
        assert c["cmd"] == "python" and c["cwd"] == str(src)
        opts = dict(zip(c["args"][2::2], c["args"][3::2]))
        assert opts["--model"] == "inhouse" and opts["--base_url"] == url and opts["--served_model_name"] == "my-bd"
        assert opts["--api_key"] == "EMPTY" and opts["--temperature"] == "0.1" and opts["--only_exact"] == "True"
    assert dict(zip(runs[0]["args"][2::2], runs[0]["args"][3::2]))["--tools_type"] == "all"
    # a second run reuses the clone and the venv; the judge is asked for by the environment
    (tmp_path / "calls.jsonl").unlink()
    calls, _ = run_script(tmp_path, out / "run_functionchat.sh", {"FUNCTIONCHAT_ONLY_EXACT": "False"})
    assert [c["cmd"] for c in calls] == ["git", "python", "python", "python"]  # with the judge: Dialog too
    assert [c["args"][1] for c in calls[1:]] == ["singlecall", "common", "dialog"]
    assert all(c["args"][c["args"].index("--only_exact") + 1] == "False" for c in calls[1:])


def test_ko_agentbench_script_points_litellm_at_the_server_and_the_judge_elsewhere(tmp_path):
    url, out = "http://127.0.0.1:8125/v1", tmp_path / "out"
    argv = ["ko_agentbench", "--base-url", url, "--model", "my-bd", "--out", str(out), "--api-key", "k1"]
    assert configure.main([*argv, "--levels", "L1,L4"]) == 0
    calls, stdout = run_script(tmp_path, out / "run_ko_agentbench.sh")
    src = out / "src" / "Ko-AgentBench"
    assert calls[0]["args"] == ["clone", KO_AGENTBENCH[0], str(src)] and calls[1]["args"][-1] == KO_AGENTBENCH[1]
    pip = calls[3]
    assert pip["cmd"] == "pip" and pip["args"][0] == "install" and any(a.startswith("litellm==") for a in pip["args"])
    run = calls[4]
    assert run["args"][:1] == ["run_benchmark_with_logging.py"] and run["cwd"] == str(src)
    opts = dict(zip(run["args"][1::2], run["args"][2::2]))
    assert opts["--model"] == "openai/my-bd" and opts["--levels"] == "L1,L4" and int(opts["--timeout"]) >= 600
    assert run["env"] == {"OPENAI_BASE_URL": url, "OPENAI_API_BASE": url, "OPENAI_API_KEY": "k1"}
    assert len(calls) == 5 and "no OPENAI_API_KEY for the judge" in stdout  # no key: no judge step
    # with the user's OpenAI key the judge runs, and sees neither the server's URL nor its key
    (tmp_path / "calls.jsonl").unlink()
    calls, _ = run_script(tmp_path, out / "run_ko_agentbench.sh", {"OPENAI_API_KEY": "sk-judge"})
    run, judge = calls[-2:]
    assert run["env"] == {"OPENAI_BASE_URL": url, "OPENAI_API_BASE": url, "OPENAI_API_KEY": "k1"}
    assert judge["args"][0] == "evaluate_model_run.py"
    assert judge["env"] == {"OPENAI_BASE_URL": None, "OPENAI_API_BASE": None, "OPENAI_API_KEY": "sk-judge"}
    opts = dict(zip(judge["args"][1::2], judge["args"][2::2]))
    assert opts["--model"] == "openai/my-bd" and opts["--judge-models"] == "openai/gpt-4.1-mini"
    assert len(opts["--date"]) == 8 and opts["--date"].isdigit()


@pytest.mark.parametrize("name", ["gpt-5-mini", "openrouter/x"])
def test_ko_agentbench_refuses_names_its_runner_sends_elsewhere(tmp_path, name, capsys):
    with pytest.raises(SystemExit) as e:
        configure.main(["ko_agentbench", "--model", name, "--out", str(tmp_path)])
    assert e.value.code == 2 and "--served-model-name" in capsys.readouterr().err
