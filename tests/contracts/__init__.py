"""The engine contract checks: our SGLang and vLLM backends against those engines' own code, on CPU, each in
its engine's own venv (`make sglang-contract`, `make vllm-contract`; sglang/run.sh, vllm/run.sh). Not
collected by pytest: no file here is named test_*.py."""
