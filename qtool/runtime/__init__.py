"""qtool's int8 executor: runs QDQ ONNX models on the native kernels (qtool.kernels)."""
from qtool.runtime.session import NativeSession

__all__ = ["NativeSession"]
