"""qtool: post-training INT8 quantization for ONNX models, with its own CPU runtime."""
__version__ = "0.1.0"
