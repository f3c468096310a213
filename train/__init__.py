"""bdstack trainer: converts an autoregressive causal LM into a block-diffusion LM by SFT.

`train/` never imports `inference/`; the checkpoint directory is their only interface.
"""
