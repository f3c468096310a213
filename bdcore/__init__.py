"""Semantics shared by `train/` and `inference/`, which never import each other (tests/test_layering.py).

- `sidecar.py`: the one definition of `block_diffusion.json` (docs/design.md section 5);
- `capabilities.py`: what a checkpoint is, read off its sidecar and config by one constructor;
  `serving_gate.py`: what each serving backend serves on it, with which settings (`resolve`, the one
  gate); `loading.py`: load a checkpoint to decode it;
- `checkpoint_files.py`: cheap checks of a model directory's files (config, safetensors headers) that
  every loader runs before transformers reads them;
- `attention_rule.py`: the one definition of who attends to whom (docs/design.md section 3), used by the
  training rows and by every decode forward of the native engine;
- `tokens.py`: which ids are `<|mask|>`, end-of-turn and the block filler;
- `scoring.py`: answer scoring, one definition for evaluation and RL rewards;
- `chat.py`: prompt rendering (chat template, then tokens), one definition for training and serving;
- `vector_math.py`: MKL's vector math called once in one thread before any forward (an Intel first-call race);
- `gated_delta.py`: the q/k conventions and chunk math of gated-delta layers (trainer op and engine
  recurrence); `gated_delta_reference.py`: their slow per-token references (tests, benchmark);
- `decode/`: the decode core: modes, rules, rows, sequences, the runner (see its __init__).
Importing these needs only torch (no transformers), so any backend can import them; the decode runner
uses transformers' cache when it runs a model.
"""
