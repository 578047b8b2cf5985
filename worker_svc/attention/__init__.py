from worker_svc.attention.base import AttentionBackend, AttentionLayer
from worker_svc.attention.torch_native import TorchNativeAttentionBackend

__all__ = ["AttentionBackend", "AttentionLayer", "TorchNativeAttentionBackend"]
