"""The native engine: checkpoint loading (`loading.py`), the engine and its text output (`engine.py`) and
continuous batching (`scheduler.py`) over the shared decode core in `bdcore.decode`."""
