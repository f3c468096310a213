"""The SGLang contract check: our commands, plugin and family presets against SGLang 0.5.23's own code.

Runs in the contract environment (`.venv-sglang`, see run.sh), never in `.venv`:
`python -m tests.contracts.sglang.check WORK` with WORK/commands.json written by `commands.py`.

Executed against the real wheel: SGLang's argument parser (`prepare_server_args`) on every command,
`register()` into SGLang's algorithm table and DllmConfig, SGLang's dLLM resolution step
(`handle_dllm_inference`, which calls our `configure_server_args` and SGLang's own dLLM passes), our
DllmConfig factory and algorithm classes built on SGLang's `DllmAlgorithm`, and SGLang's own
LowConfidence / JointThreshold reading the family presets.

Stubbed (CPU has no way to import them; see `install_stubs`), and read from the wheel's source instead:
the model-config package and the GPU model-execution modules. What we use from them is checked by
name in `static_names` (`names.py`).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path

from tests.contracts.report import Report
from tests.contracts.sglang.lora import check_lora
from tests.contracts.sglang.names import DLLM_CONFIG_PARAMS, SOURCE_NAMES, class_names

REPO = Path(__file__).resolve().parents[3]

SGLANG_VERSION = "0.5.23"
OUR_MODULES = ("inference.sglang_backend.launch", "sglang.launch_server")


def install_stubs(root: Path) -> None:
    """Stand-ins for modules CPU cannot import, registered before anything imports them.

    - `sglang.srt.configs` (package init) and `.model_config`: the package imports every model's
      config, multimodal ones import torchvision, and PyPI's torchvision needs the CUDA torch build.
      ModelConfig serves SGLang's own DLLM_PARAMS table only; our factory never calls it.
    - `sglang.srt.layers.logits_processor`, `sglang.srt.model_executor.forward_batch_info`,
      `sglang.srt.model_executor.model_runner`: they import the GPU kernel stack (sglang-kernel,
      flashinfer); `dllm/algorithm/base.py` and the algorithms use their names as annotations.
    """
    import sglang.srt  # noqa: F401  (the real parent packages first)

    def module(name: str, **names) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(names)
        sys.modules[name] = mod
        return mod

    class ModelConfig:
        @classmethod
        def from_server_args(cls, *args, **kwargs):
            raise RuntimeError("ModelConfig is stubbed in the contract check")

    module("sglang.srt.configs").__path__ = [str(root / "srt" / "configs")]
    module("sglang.srt.configs.model_config", ModelConfig=ModelConfig)
    module("sglang.srt.layers.logits_processor", LogitsProcessorOutput=type("LogitsProcessorOutput", (), {}))
    module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=type("ForwardBatch", (), {}))
    module("sglang.srt.model_executor.model_runner", ModelRunner=type("ModelRunner", (), {}))


def check_registration(r: Report) -> None:
    from sglang.srt.dllm import algorithm as table
    from sglang.srt.dllm.algorithm.base import DllmAlgorithm
    from sglang.srt.dllm.config import DllmConfig

    from inference.sglang_backend.plugin import CORES, register

    r.check(list(inspect.signature(DllmConfig).parameters) == DLLM_CONFIG_PARAMS, "DllmConfig.__init__ signature")
    run = inspect.signature(DllmAlgorithm.run)
    r.check(list(run.parameters) == ["self", "model_runner", "forward_batch", "algo_states"], "DllmAlgorithm.run")
    for name in ("requires_separate_context_encoding", "required_attention_backend", "supported_attention_backends"):
        r.check(hasattr(DllmAlgorithm, name), f"DllmAlgorithm.{name}")
    for name in ("reuse_forward_metadata", "capture_input_preparation", "configure_server_args", "validate_request"):
        r.check(hasattr(DllmAlgorithm, name), f"DllmAlgorithm.{name}")
    register()
    for name in CORES:
        cls = table.algo_name_to_cls.get(name)
        r.check(cls is not None and issubclass(cls, DllmAlgorithm), f"{name} registered on SGLang's DllmAlgorithm")
        r.check(table.get_algorithm_cls(name) is cls, f"get_algorithm_cls({name})")
        r.check(cls.run is CORES[name].run, f"{name}.run is ours (MRO)")
    r.check(getattr(DllmConfig.from_server_args, "bdstack", False), "DllmConfig.from_server_args wrapped")


def resolve(argv: list[str]):
    """SGLang's server arguments for a command's argv after `-m MODULE`, through the pipeline's steps the dLLM step
    reads (--cuda-graph-* into a config, the page size default) and the dLLM step itself: our
    configure_server_args, then SGLang's own dLLM passes."""
    from sglang.srt.arg_groups.cuda_graph_hook import handle_cuda_graph_config
    from sglang.srt.arg_groups.dllm_hook import handle_dllm_inference
    from sglang.srt.arg_groups.overrides import _page_size_default, run_post_process_pass
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    handle_cuda_graph_config(args)
    run_post_process_pass(args, _page_size_default)
    handle_dllm_inference(args)
    return args


def check_command(r: Report, case: dict) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.dllm.algorithm import algo_name_to_cls, get_algorithm
    from sglang.srt.dllm.config import DllmConfig
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.server_args import prepare_server_args

    name, argv = case["name"], case["argv"]
    r.check(argv[1] == "-m" and argv[2] in OUR_MODULES, f"{name}: runs {argv[2]}")
    try:
        args = prepare_server_args(argv[3:])
    except SystemExit:
        r.check(False, f"{name}: SGLang's parser rejects {' '.join(argv[3:])}")
        return
    view = resolving_view(args)
    model = argv[argv.index("--model-path") + 1]
    r.check(view.model_path == model and view.host == "127.0.0.1", f"{name}: --model-path and --host parsed")
    if "--max-running-requests" in argv:
        want = int(argv[len(argv) - 1 - argv[::-1].index("--max-running-requests") + 1])
        r.check(view.max_running_requests == want, f"{name}: --max-running-requests {want} (last wins)")
    if case["mode"] == "causal":
        r.check(view.dllm_algorithm is None, f"{name}: no dLLM algorithm")
        return
    r.check(view.dllm_algorithm in algo_name_to_cls, f"{name}: {view.dllm_algorithm} is in SGLang's algorithm table")
    if case["mode"] not in ("diffusion", "self-spec"):
        return  # SGLang's own families: their resolution needs the real checkpoint's config (ModelConfig)
    try:
        args = resolve(argv[3:])
    except Exception as e:  # noqa: BLE001 (any failure is the finding)
        r.check(False, f"{name}: resolution raised {type(e).__name__}: {e}")
        return
    view = resolving_view(args)
    graphs = view.cuda_graph_config
    r.check(view.attention_backend == "triton", f"{name}: attention backend triton")
    r.check(view.disable_radix_cache is True and view.chunked_prefill_size == -1, f"{name}: no radix, no chunking")
    r.check(graphs.prefill.backend == graphs.decode.backend == Backend.DISABLED, f"{name}: CUDA graphs off")
    r.check(view.dllm_fdfo is False, f"{name}: FDFO off")
    r.check(view.disable_overlap_schedule is True, f"{name}: SGLang's overlap pass ran after ours")
    config = DllmConfig.from_server_args(args)
    r.check(not config.first_done_first_out_mode and config.requires_separate_context_encoding, f"{name}: DllmConfig")
    r.check(config.max_running_requests == (view.max_running_requests or 1), f"{name}: DllmConfig batch size")
    algorithm = get_algorithm(config)
    r.check(algorithm.block_size == config.block_size == algorithm.settings.block_size, f"{name}: algorithm built")
    r.check(not algorithm.fdfo, f"{name}: SGLang's DllmAlgorithm.__init__ read fdfo off")


class Recording(dict):
    """An algorithm config that remembers which keys the algorithm asked for."""

    def __init__(self, data):
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def config_factory_keys(root: Path) -> set[str]:
    """Keys DllmConfig.from_server_args reads from every algorithm's config (`algorithm_config.get`)."""
    import ast

    tree = ast.parse((root / "srt" / "dllm" / "config.py").read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "algorithm_config"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def check_family_presets(r: Report, root: Path) -> None:
    from sglang.srt.dllm.algorithm import algo_name_to_cls
    from sglang.srt.dllm.config import DllmConfig

    from inference.sglang_backend.command import ALGORITHM_KEYS, FAMILIES, load_family_config

    common = config_factory_keys(root)
    r.check(common >= {"block_size"}, f"DllmConfig reads block_size from the algorithm config (reads {common})")
    for algorithm, keys in ALGORITHM_KEYS.items():
        cls = algo_name_to_cls.get(algorithm)
        r.check(cls is not None, f"SGLang has algorithm {algorithm}")
        if cls is None:
            continue
        config = Recording({})
        cls(DllmConfig(algorithm, config, block_size=4, mask_id=0, max_running_requests=1))
        read = config.read | common
        r.check(set(keys) <= read, f"{algorithm}: ALGORITHM_KEYS {sorted(set(keys) - read)} are not read by SGLang")
    for family in FAMILIES:
        cfg = load_family_config(family)
        cls = algo_name_to_cls[cfg.algorithm]
        config = Recording(cfg.algorithm_config)
        algo = cls(DllmConfig(cfg.algorithm, config, block_size=4, mask_id=0, max_running_requests=1))
        unread = set(cfg.algorithm_config) - config.read - common
        r.check(not unread, f"{family}.yaml: keys {sorted(unread)} are not read by SGLang's {cfg.algorithm}")
        for key, value in cfg.algorithm_config.items():
            if key != "block_size" and hasattr(algo, key):
                r.check(getattr(algo, key) == value, f"{family}.yaml: {cfg.algorithm}.{key} == {value}")


def check_static_names(r: Report, root: Path) -> None:
    for (path, cls), wanted in SOURCE_NAMES.items():
        source = root / path
        found = class_names(source, cls) if source.is_file() else set()
        missing = sorted(set(wanted) - found)
        r.check(not missing, f"{path}: {cls} lacks {missing}")


def main(work: Path) -> int:
    spec = importlib.util.find_spec("sglang")
    root = Path(spec.origin).parent
    from importlib.metadata import version

    r = Report()
    r.check(version("sglang") == SGLANG_VERSION, f"sglang {SGLANG_VERSION} installed (found {version('sglang')})")
    install_stubs(root)
    check_static_names(r, root)
    check_registration(r)
    cases = json.loads((work / "commands.json").read_text())
    for case in cases:
        check_command(r, case)
    check_family_presets(r, root)
    check_lora(r, root, work, cases, resolve)  # last: its stubs let the LoRA modules import (lora.py)
    print(f"sglang contract: {r.passed} checks passed, {len(r.failures)} failed, {len(cases)} commands")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
