"""SGLang quantization method `qflash_w8a8`: qflash's W8A8 body and W8A16 lm_head, run by qflash's kernels.

- Target, a checkpoint from `qflash quantize` (SGLang builds this config from its `quantization_config`):
  each decoder-layer linear holds int8 [N, K] weights + fp32 per-channel scales, created and loaded as
  SGLang's own W8A8 int8 method does, and runs `qflash::w8a8_gemm`; the untied int8 lm_head runs
  `qflash::w8a16_gemm` for logits (the DFlash draft pick uses its fused argmax, server/hooks/draft_pick.py).
- Drafter, a bf16 checkpoint (SGLang builds the config with no arguments for a draft model): linears load
  bf16 and are quantized per channel once loaded, then run the same W8A8 kernel; its `qkv_proj` keeps its bf16
  weights beside the int8 ones (DrafterQKVMethod).
Each GEMM reads its launch config from the table of its phase, which follows from the role and M.
"""

from typing import Any, Optional

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.layers.quantization.w8a8_int8 import W8A8Int8LinearMethod
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.utils import set_weight_attrs
from torch.nn import Parameter

from qflash.kernels import w8a8_gemm, w8a16_argmax, w8a16_gemm  # noqa: F401  register the torch.ops.qflash ops
from qflash.kernels.config_table import gemm_phase
from qflash.quant import handoff
from qflash.quant.layout import LM_HEAD_KEY, METHOD_NAME
from qflash.quant.quantize import quantize_per_channel

def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
          decode_phase: str) -> torch.Tensor:
    x_q, x_scale = handoff.take(x)  # x's int8 rows, where the kernel that wrote x wrote them too
    return torch.ops.qflash.w8a8_gemm(x, weight, scale, bias, gemm_phase(decode_phase, _rows(x)), x_q, x_scale)


class W8A8LinearMethod(W8A8Int8LinearMethod):
    """int8 weights [N, K] + fp32 scales [N, 1] as SGLang's W8A8 int8 method creates and loads them."""

    def __init__(self, decode_phase: str = "verify"):
        self.decode_phase = decode_phase

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The kernel reads w [N, K] row-major and scales [N] (SGLang's method transposes for CUTLASS).
        layer.weight = Parameter(layer.weight.data.contiguous(), requires_grad=False)
        layer.weight_scale = Parameter(layer.weight_scale.data.reshape(-1).float().contiguous(), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _w8a8(x, layer.weight, layer.weight_scale, bias, self.decode_phase)


class OnlineW8A8LinearMethod(W8A8LinearMethod):
    """bf16 checkpoint weights (the DFlash drafter), quantized per output channel once loaded."""

    def __init__(self):
        super().__init__(decode_phase="draft")

    def create_weights(self, layer: torch.nn.Module, *args, **extra_weight_attrs) -> None:
        UnquantizedLinearMethod().create_weights(layer, *args, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight, scale = quantize_per_channel(layer.weight.data)
        layer.weight = Parameter(weight, requires_grad=False)
        layer.weight_scale = Parameter(scale.reshape(-1).contiguous(), requires_grad=False)


class DrafterQKVMethod(UnquantizedLinearMethod):
    """The drafter's fused QKV: its bf16 weights for DFLASH's context-KV write, an int8 copy for the draft forward.

    After each verify, DFLASH writes the accepted tokens' K/V into every drafter layer through SGLang's fused
    materialisation (one GEMM over the stacked K|V rows of these weights, then one Triton kernel), which takes an
    `UnquantizedLinearMethod`'s bf16 weights only; any other method sends it to a per-layer eager loop of ~130
    host-side launches a cycle. The draft forward's projection reads the whole matrix once a cycle in each layer:
    on the W8A8 kernel over the int8 copy (quantized per channel once loaded, as the drafter's other linears) it reads
    half the bytes. The draft only proposes tokens, which the target verifies: its precision moves acceptance, never
    the output."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.int8_weight, scale = quantize_per_channel(layer.weight.data)
        layer.int8_weight_scale = scale.reshape(-1).contiguous()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _w8a8(x, layer.int8_weight, layer.int8_weight_scale, bias, "draft")


class W8A16LMHeadMethod(QuantizeMethodBase):
    """The untied lm_head: int8 [V, H] weights + fp32 [V, 1] scales, bf16 activations (weight-only)."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        rows = sum(output_partition_sizes)
        weight = Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.int8), requires_grad=False)
        scale = Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.weight_scale = Parameter(layer.weight_scale.data.reshape(-1).contiguous(), requires_grad=False)

    # SGLang's fp32 logits buffer, while its logits step runs (server/hooks/logits_buffer.py): apply writes it
    logits_buffer: Optional[torch.Tensor] = None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x.reshape(-1, x.shape[-1])
        if self.logits_buffer is not None:  # the hook handed it over for a call it fits (no bias, x's rows)
            torch.ops.qflash.w8a16_gemm_into(x, layer.weight, layer.weight_scale, self.logits_buffer, "lm_head")
            return self.logits_buffer
        logits = torch.ops.qflash.w8a16_gemm(x, layer.weight, layer.weight_scale, "lm_head")
        return logits if bias is None else logits + bias


def greedy_ids(lm_head: torch.nn.Module, hidden: torch.Tensor, num_org: int) -> torch.Tensor:
    """Greedy token ids over the first `num_org` rows of an int8 lm_head, without writing logits."""
    weight, scale = lm_head.weight[:num_org], lm_head.weight_scale[:num_org]
    return torch.ops.qflash.w8a16_argmax(hidden.to(torch.bfloat16), weight, scale, "lm_head")


def runs_w8a8(linear: Any) -> bool:
    return isinstance(getattr(linear, "quant_method", None), (W8A8LinearMethod, DrafterQKVMethod))


def is_int8_lm_head(lm_head: Any) -> bool:
    return isinstance(getattr(lm_head, "quant_method", None), W8A16LMHeadMethod)


class QflashW8A8Config(QuantizationConfig):
    """`quantization_config` of a `qflash quantize` checkpoint, or (no arguments) a bf16 drafter."""

    def __init__(self, ignore: Optional[list[str]] = None, int8_lm_head: bool = False, prequantized: bool = False):
        super().__init__()
        self.ignore = list(ignore or [])
        self.int8_lm_head = int8_lm_head
        self.prequantized = prequantized

    @classmethod
    def get_name(cls) -> str:
        return METHOD_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # int8 tensor cores through Triton's mma

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QflashW8A8Config":
        return cls(ignore=config.get("ignore"), int8_lm_head=LM_HEAD_KEY in config, prequantized=True)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> Optional[str]:
        """Claim qflash's checkpoints (they carry the int8 lm_head key), unless another method was asked for."""
        if hf_quant_cfg is not None and LM_HEAD_KEY in hf_quant_cfg and user_quant in (None, METHOD_NAME):
            return METHOD_NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, ParallelLMHead):
            return W8A16LMHeadMethod() if self.int8_lm_head else None
        if isinstance(layer, LinearBase):
            if should_ignore_layer(prefix, ignore=self.ignore, fused_mapping=self.packed_modules_mapping):
                return UnquantizedLinearMethod()
            if self.prequantized:
                return W8A8LinearMethod("verify")
            if prefix.rsplit(".", 1)[-1] == "qkv_proj":
                return DrafterQKVMethod()
            return OnlineW8A8LinearMethod()
        return None

    def get_scaled_act_names(self) -> list[str]:
        return []
