"""The MLP of the target's and the drafter's layers at decode rows in two launches where SGLang's forward makes three.

SGLang 0.5.17's MLPs (Qwen2MoeMLP, which Qwen3.5's dense layers build, and DFlashMLP) call gate_up_proj, the
SiLU-and-multiply and down_proj in turn; on qflash's W8A8 method that is the gate_up GEMM, qflash's SiLU-and-multiply
kernel that also quantizes its output (quant_handoff) and the down GEMM. At decode rows (a verify's or draft's
block) the MLP runs `w8a8_glu_mlp` instead (kernels/w8a8_gemm.py): the gate_up GEMM multiplies silu(gate) by up in its
epilogue and the down GEMM quantizes that product in its loads, the same bits in one launch fewer a layer (38 a
cycle). Prefill rows, and MLPs on other methods or split over GPUs, keep SGLang's forward. Hooked around each
class's `forward`. Retire when SGLang runs the activation in its int8 GEMM's epilogue.
"""

import torch

from qflash.kernels.w8a8_gemm import GLU_MAX_M
from qflash.quant import handoff
from qflash.quant.method import W8A8LinearMethod
from qflash.server.hooks import Hook


def _runs_in_two(mlp: torch.nn.Module, x: torch.Tensor) -> bool:
    """Both projections on qflash's W8A8 method without bias, on one GPU, over 1 to GLU_MAX_M rows of unit stride."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return (all(isinstance(p.quant_method, W8A8LinearMethod) and p.bias is None for p in (gate_up, down))
            and down.tp_size == 1 and x.dim() == 2 and 0 < x.shape[0] <= GLU_MAX_M and x.stride(-1) == 1
            and not torch.compiler.is_compiling())


def _in_two_launches(original, self, x, *args, **kwargs):
    if args or kwargs or not _runs_in_two(self, x):
        return original(self, x, *args, **kwargs)
    gate_up, down = self.gate_up_proj, self.down_proj
    x_q, x_scale = handoff.take(x)  # the post-attention norm's int8 rows of x
    return torch.ops.qflash.w8a8_glu_mlp(x, gate_up.weight, gate_up.weight_scale, down.weight, down.weight_scale,
                                         gate_up.quant_method.decode_phase, x_q, x_scale)


CHANGES = [
    Hook("sglang.srt.models.qwen2_moe.Qwen2MoeMLP.forward", _in_two_launches, "AROUND"),
    Hook("sglang.srt.models.dflash.DFlashMLP.forward", _in_two_launches, "AROUND"),
]
