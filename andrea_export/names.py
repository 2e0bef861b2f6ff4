"""The names every artifact shares: graph inputs and outputs, ONNX metadata keys, file names, precisions and
builders. A module of
its own, importing nothing, so the builder and the precision pass agree with the exporter without
pulling in torch."""

INPUT_IDS = "input_ids"  # int64 [batch, tokens]
ATTENTION_MASK = "attention_mask"  # int64 [batch, past + tokens] (KV-cache decoder)
LOGITS = "logits"  # float32 [batch, tokens, vocab], whatever the graph's precision
WEIGHTS_FILE = "weights.{}.data"  # a build folder's weights of one precision, shared by its graphs (graphs/external_data.py)

CONFIG_KEY = "andrea.config"  # the ModelConfig, JSON (ONNX metadata and safetensors metadata)
WEIGHTS_KEY = "andrea.weights"  # where the weights came from: a checkpoint (sha256) or a seeded random init
PRECISION_KEY = "andrea.precision"  # fp32 | fp16 | bf16 (graphs/precision.convert_precision)
KV_LAYOUT_KEY = "andrea.kv_layout"  # the decoder's cache layout (graphs/layout.KVLayout)
PLUGIN_KEY = "andrea.plugin"  # what the plugin graph pass did (graphs/gelu_plugin.py)

DECODER_FILE = "decoder.onnx"  # the KV-cache decoder graph's name inside a build folder
INPLACE_DECODER_FILE = "decoder.inplace.onnx"  # the in-place decoder's (graphs/inplace_decoder.py), fp32
SLOT_DECODER_FILE = "decoder.slots.onnx"  # the slot decoder's (graphs/slot_decoder.py), fp32
PREFILL, DECODE = "prefill", "decode"  # the decoder engine's two optimization profiles (graphs/kvcache.optimization_profiles)
TOKENIZER_FILE = "tokenizer.json"  # a build folder's tokenizer (build --tokenizer), Hugging Face format
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # beside it: what transformers and onnxruntime-genai load it as
EVAL_TEXT_FILE = "eval.txt"  # a build folder's evaluation text (build --eval-text)
EOT = "<|endoftext|>"  # GPT-2's end of text and ours (model/text.py: id 0); generation stops there (runtime)

FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")  # every weight and activation in that type (graphs/precision.py)
WEIGHT_ONLY = ("int8", "int4")  # float32 activations, MatMulNBits weights (graphs/quantize.py; Q/DQ for the engines)
PRECISIONS = (*FLOAT_PRECISIONS, *WEIGHT_ONLY)
BUILDERS = ("tensorrt", "tensorrt-rtx")  # engine builders (engine/backends.py)
MAX_SEED = 2**63 - 1  # every seed we take: torch's generator refuses more than 64 bits, and JSON readers int64

MAX_SLOTS = 256  # the most decoding rows a slot engine's profiles hold (graphs/slot_decoder.py's slot_profiles)
PREFILL_CHUNK = 64  # the batcher's default prompt tokens per step, and what a built slot engine's mixed step takes
