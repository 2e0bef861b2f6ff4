"""andrea-export: ANDREA-120M from PyTorch to verified ONNX and TensorRT engines.

Each pipeline stage is a module usable from Python: config, model, checkpoint, export, verify, ...
Nothing heavy is imported here.
"""

__version__ = "0.1.0"
