"""Run SGLang's server with bdstack's algorithms registered: `python -m inference.sglang_backend.launch ARGS`.

ARGS are `sglang.launch_server`'s. `serve.py --backend sglang --mode {diffusion,self-spec}` builds this
command (and the `--dllm-algorithm-config` YAML) for you; run it by hand only to pass SGLang flags
serve.py does not know. Needs SGLang's environment, not ours: this module imports SGLang, torch and
the few stdlib/torch-only modules of bdstack listed in inference/sglang_backend/README.md.
"""

from __future__ import annotations

import os
import sys

from inference.sglang_backend.plugin import PluginError, register

# Module level on purpose: SGLang starts its scheduler processes with the spawn method, which
# re-imports this module (as __mp_main__) in each of them, so every process registers our algorithms.
register()


def main(argv: list[str] | None = None) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    try:
        run_server(server_args)
    except PluginError as e:  # a setting we refuse (SGLang resolves its arguments in run_server): one line
        sys.exit(f"inference.sglang_backend.launch: error: {e}")
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
