"""The tanh-GELU TensorRT plugin: its identity (shared by the graph pass, the TensorRT registration and
the manifest), the NVRTC compile of our CUDA kernel, and a float64 reference of the exact function."""

# One identity everywhere: the ONNX node is op_type=<name> in domain <namespace> with the attributes
# plugin_namespace=<namespace>, plugin_version=<version>; TensorRT's registry key is "<namespace>::<name>".
PLUGIN_NAMESPACE = "andrea"  # no dots: tensorrt.plugin namespaces may not contain '.'
PLUGIN_VERSION = "1"
GELU_OP = "TanhGelu"  # y = gelu_tanh(x)
GELU_BIAS_OP = "TanhGeluBias"  # y = gelu_tanh(x + bias), bias broadcast over the last axis
