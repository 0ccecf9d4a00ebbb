"""The engine: requests in, token deltas out, one step at a time.

``Engine`` runs steps synchronously; ``AsyncEngine`` (engine.async_engine)
runs them off the event loop and is all that the front ends use.
"""

from specpage.core.engine_config import EngineConfig
from specpage.engine.engine import Engine, EngineStats, RequestOutput

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestOutput"]
