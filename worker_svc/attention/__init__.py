from worker_svc.attention.base import AttentionBackend, AttentionLayer, MLAAttentionBackend, StepAttentionBackend
from worker_svc.attention.torch_native import TorchNativeAttentionBackend

__all__ = ["AttentionBackend", "AttentionLayer", "MLAAttentionBackend", "StepAttentionBackend",
           "TorchNativeAttentionBackend"]
