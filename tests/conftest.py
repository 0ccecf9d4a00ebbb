import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from specpage.models.fetch import cache_dir

# Triton picks interpreter or compiler when it is first imported (transformers
# imports it through torch._dynamo), so the choice is made here, before any
# test module: the interpreter wherever there is no GPU.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # Tests are steadier without torch threads fighting other processes.
    torch.set_num_threads(1)


def _private_cache() -> None:
    """Engines and daemons under test keep what they write (start-up cost
    timings) in a cache of this run's own, so no run reads another's timings
    and the user's cache is left alone; the models fetched into the user's
    cache (SmolLM2 and its GGUF) and the native kernels built there are shared
    through links, fetched or built once."""
    shared = cache_dir()
    private = Path(tempfile.mkdtemp(prefix="specpage-test-cache-"))
    for name in ("models", "gguf", "kernels"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        (private / name).symlink_to(shared / name, target_is_directory=True)
    os.environ["SPECPAGE_CACHE_DIR"] = str(private)  # inherited by daemon subprocesses


_private_cache()


def pytest_unconfigure(config: pytest.Config) -> None:
    # rmtree unlinks the links to the shared folders; it does not follow them
    shutil.rmtree(os.environ["SPECPAGE_CACHE_DIR"], ignore_errors=True)
