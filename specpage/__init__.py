"""specpage: a speculative-decoding serving daemon over one paged KV block pool."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specpage")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
