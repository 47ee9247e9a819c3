from .block_pool import BlockPool, hash_block
from .kv_manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager", "hash_block"]
