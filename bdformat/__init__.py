"""The checkpoint format shared by `train/` (writer) and `inference/` (reader).

It holds the one definition of `block_diffusion.json` so the two sides never import each other
yet agree byte for byte on what a checkpoint means. No torch, no transformers: importable anywhere.
"""
