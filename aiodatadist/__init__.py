"""aiodatadist: asyncio-native KV-cache block transfer with the LLM-DataDist API.

Re-exports only; see the submodules for the implementation.
"""

from ._version import __version__

try:
    from . import _native as _native  # the compiled core: everything below needs it
except ImportError as _e:  # a source tree without a build, or a core that cannot load
    from ._nocore import no_core_error

    # from None: Python's own message here blames a circular import; ours says what to do
    # (and quotes the loader's reason when a built core is there but does not load).
    raise no_core_error(_e, __file__) from None

from .cache_manager import CacheManager, CacheTask
from .config import DataPath, LLMConfig, LlmConfig
from .datadist import LLMDataDist
from .errors import (
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
    Status,
)
from .types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataPath",
    "DataType",
    "KvCache",
    "LLMCacheNotFoundError",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMLinkError",
    "LLMParamError",
    "LLMRole",
    "LLMStatusCode",
    "LLMTimeoutError",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "__version__",
]
