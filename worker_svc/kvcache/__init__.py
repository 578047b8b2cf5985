from worker_svc.kvcache.allocator import KVSlotAllocator
from worker_svc.kvcache.mha_pool import MHAKVPool
from worker_svc.kvcache.mla_pool import MLAKVPool
from worker_svc.kvcache.req_to_token import ReqToTokenTable

__all__ = ["KVSlotAllocator", "MHAKVPool", "MLAKVPool", "ReqToTokenTable"]
