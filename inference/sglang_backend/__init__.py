"""bdstack decode modes inside upstream SGLang (out of tree: no patched copy of SGLang).

- `settings.py`: the one definition of our algorithms' `--dllm-algorithm-config` YAML (stdlib only);
- `algorithms.py`: shifted block diffusion and self-spec on SGLang's dLLM driver contract: adapters that
  place the forwards of bdcore's shared decoders (`bdcore.decode.modes`) in SGLang's context and canvas
  passes, written without importing SGLang so CPU tests run them;
- `requests.py`: one shared decoder per SGLang request id (sampling settings, generator, round tokens);
- `plugin.py`: registers those algorithms and our checkpoints' block size / mask id in an SGLang
  process (imports SGLang);
- `launch.py`: what `serve.py --backend sglang` runs in place of `sglang.launch_server`.
See README.md beside this file.
"""
