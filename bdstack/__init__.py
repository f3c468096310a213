"""bdstack's installed entry: the console scripts and `enable()`.

A checkout keeps its folders at the top (`train.py`, `train/`, `inference/serve.py`, `data/`, `benchmark/`)
and runs from its root. An installed bdstack (`pip install .`) puts only two names into site-packages:
`bdcore` (the shared core, a name of its own) and `bdstack`; the application folders travel inside it as
`bdstack/_src/{train,inference,data,benchmark}`, so they never shadow a user's own `data` or `train`
module. `enable()` puts that source root at the front of sys.path (and on PYTHONPATH, for the processes
bdstack starts: torchrun ranks, the SGLang launcher, `python -m data.self_distill`); the console scripts
call it first. An editable install (`pip install -e .`, what `make` does) finds the checkout root instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APPS = ("train", "inference", "data", "benchmark")


def source_root() -> Path:
    """Where train/, inference/, data/ and benchmark/ live: bdstack/_src in a wheel, else the checkout."""
    here = Path(__file__).resolve().parent
    installed = here / "_src"
    return installed if (installed / "train").is_dir() else here.parent


def enable() -> Path:
    """Make `import train`, `import inference`, ... resolve to bdstack's own folders, here and in children."""
    root = str(source_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, *paths) if p)
    return Path(root)
