"""Quant methods: each owns the expert weights' format and contributes its stages.

==================  ====================================================  =========================
method              weights                                               activations after dispatch
==================  ====================================================  =========================
UnquantizedMethod   bf16 / fp16 / fp32                                    float
Fp8W8A8Method       fp8 e4m3, per channel or 128x128 blocks               fp8 per token / per 128-group
                    (DeepSeek-V3 ``weight_scale_inv``)                     or float (quantized after)
Int8W8A8Method      int8 per channel                                      int8 per token or float
W4A16Method         int4, group 32/64/128, symmetric or zero points       float
                    (GPTQ / AWQ checkpoints)
Nvfp4Method         NVFP4 (e2m1, 16-element blocks, e4m3 scales, global)  NVFP4 or float (emulated)
Mxfp4Method         MXFP4 (e2m1, 32-element blocks, E8M0 scales; GPT-OSS) float (emulated)
W4A4NpuMethod       int4 per channel; quantizes activations itself         bf16 only (NPU pattern)
==================  ====================================================  =========================
"""

from moeforge.quant.base import QuantMethod
from moeforge.quant.fp8 import ActivationScales, Fp8W8A8Method, WeightScales
from moeforge.quant.int8 import Int8W8A8Method
from moeforge.quant.int4_packing import CheckpointFormat
from moeforge.quant.mxfp4 import Mxfp4Method
from moeforge.quant.nvfp4 import Nvfp4Method, Nvfp4Quantizer
from moeforge.quant.unquantized import UnquantizedMethod
from moeforge.quant.w4a4_npu import W4A4NpuMethod
from moeforge.quant.w4a16 import W4A16Method

__all__ = ["ActivationScales", "CheckpointFormat", "Fp8W8A8Method", "Int8W8A8Method", "WeightScales", "Mxfp4Method", "Nvfp4Method", "Nvfp4Quantizer", "QuantMethod", "UnquantizedMethod",
           "W4A16Method", "W4A4NpuMethod"]
