"""Semantics shared by `train/` and `inference/`, which never import each other.

- `sidecar.py`: the one definition of `block_diffusion.json` (docs/design.md section 5);
- `attention_rule.py`: the one definition of who attends to whom (docs/design.md section 3), used by the
  training rows and by every decode forward of the native engine;
- `tokens.py`: which ids are `<|mask|>`, end-of-turn and the block filler;
- `gated_delta.py`: the q/k conventions of gated-delta layers (trainer op and engine recurrence).
Only torch is needed here (no transformers), so any backend can import it.
"""
