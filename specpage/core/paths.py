"""Where specpage keeps what it writes: models fetched, native kernels built,
start-up cost timings. Read from the environment, as the XDG spec asks."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The model cache directory.

    ``$SPECPAGE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/specpage``, else
    ``~/.cache/specpage``.
    """
    # Empty values count as unset, as the XDG spec asks.
    if explicit := env.get("SPECPAGE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := env.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "specpage"
    return Path.home() / ".cache" / "specpage"
