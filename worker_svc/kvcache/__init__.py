from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.cache import KVCache
from worker_svc.kvcache.mha_pool import MHAKVPool
from worker_svc.kvcache.mla_pool import MLAKVPool
from worker_svc.kvcache.pool import KVPool
from worker_svc.kvcache.req_to_token import ReqToTokenTable

__all__ = ["KVCache", "KVPool", "KVSlotAllocator", "MHAKVPool", "MLAKVPool", "ReqToTokenTable"]
