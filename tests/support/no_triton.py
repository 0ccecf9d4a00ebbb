"""`python -m tests.support.no_triton ARGS` is `specpage ARGS` in a Python
where triton cannot be imported, as on a CPU machine without it: every
finder answers "not here" for triton and its submodules, so
`importlib.util.find_spec("triton")` is None and `import triton` raises
ModuleNotFoundError, which is what libraries probing for it expect."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any


class _WithoutTriton(MetaPathFinder):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "triton" or name.startswith("triton."):
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


def hide_triton() -> None:
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        del sys.modules[name]
    sys.meta_path[:] = [_WithoutTriton(finder) for finder in sys.meta_path]


if __name__ == "__main__":
    hide_triton()
    from specpage.cli import main

    sys.exit(main(sys.argv[1:]))
