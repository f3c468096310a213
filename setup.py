"""Package layout for `pip install .` (everything else is in pyproject.toml).

The checkout keeps train/, inference/, data/ and benchmark/ at its root; the wheel puts them under
bdstack/_src/ so site-packages gains no generic top-level names (see bdstack/__init__.py). The package
list is computed here because setuptools' static config cannot map a found tree onto another prefix.
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pip's isolated build does not put the checkout there
from bdstack import APPS  # noqa: E402

apps = find_packages(include=[f"{app}*" for app in APPS] + list(APPS))
setup(
    packages=["bdstack", *find_packages(include=["bdcore", "bdcore.*"]), *(f"bdstack._src.{p}" for p in apps)],
    package_dir={f"bdstack._src.{app}": app for app in APPS},
    package_data={"bdstack._src.inference.sglang_backend": ["configs/*.yaml"]},
)
