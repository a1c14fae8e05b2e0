"""Qwen3.5 served text-only, with DFlash hidden-state capture.

Registered under the checkpoint's own architecture name, `Qwen3_5ForConditionalGeneration`, so every
arch-keyed SGLang rule for Qwen3.5 (mamba radix cache, prefill graphs) still applies. It builds SGLang's
text-only Qwen3.5 (no vision tower, so no image processor) and adds what that class lacks for DFlash:
`set_dflash_layers_to_capture`, loading the multimodal checkpoint's `model.language_model.*` names, and
loading the lm_head's tensors besides its weight (the int8 head's `weight_scale`), which that class drops.
Each layer's norms and SiLU-and-multiply are marked to hand their output's int8 rows to the W8A8 projections
that read it (quant/handoff.py), as are the drafter's (server/models/dflash_drafter.py), and each Gated-DeltaNet
layer's two input projections share one int8 weight, run as one GEMM (server/hooks/gdn_input_proj.py). The layers
DFlash taps learn their place among the taps, where their input norm stores the tap (server/hooks/dflash_taps.py).
"""

import logging
from typing import Iterable, Optional

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.models.qwen3_5_text import Qwen3_5ForCausalLM

from qflash.quant import handoff
from qflash.quant.layout import LM_HEAD, text_name
from qflash.quant.method import runs_w8a8
from qflash.server.hooks import dflash_taps, gdn_input_proj

logger = logging.getLogger(__name__)
HANDOFF_LOG = "qflash: {model}: {count} norms, activations and gates hand their int8 rows to W8A8 projections"
MERGE_LOG = "qflash: target: {count} Gated-DeltaNet layers run in_proj_qkvz and in_proj_ba as one GEMM"
# A decoder layer's producers of projection input -> the projections that read it (the names of either layer type
# of the target and of the DFlash drafter's layers; "" is the layer itself: the target attention's output gate).
INT8_HANDOFFS = {
    "": ("o_proj",),
    "input_layernorm": ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "qkv_proj", "self_attn.qkv_proj"),
    "post_attention_layernorm": ("mlp.gate_up_proj",),
    "mlp.act_fn": ("mlp.down_proj",),
    "linear_attn.norm": ("linear_attn.out_proj",),
}


def text_only_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's tensors under the text model's names; vision tower and MTP head dropped."""
    return ((text_name(name), tensor) for name, tensor in weights if text_name(name) is not None)


def _submodules(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules of `module` at those names that it has."""
    found = []
    for name in names:
        try:
            found.append(module.get_submodule(name))
        except AttributeError:
            pass
    return found


def mark_int8_handoffs(layers: Iterable[torch.nn.Module]) -> int:
    """Mark each layer's producers of a W8A8 projection's input (INT8_HANDOFFS); returns how many were marked."""
    marked = 0
    for layer in layers:
        for producer, consumers in INT8_HANDOFFS.items():
            linears = _submodules(layer, consumers)
            for module in _submodules(layer, (producer,)):
                width = getattr(linears[0], "input_size_per_partition", linears[0].input_size) if linears else 0
                marked += handoff.mark(module, [runs_w8a8(linear) for linear in linears], width)
    return marked


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    def __init__(self, config, quant_config: Optional[QuantizationConfig] = None, prefix: str = ""):
        text_config = config.get_text_config()
        text_config.tie_word_embeddings = getattr(config, "tie_word_embeddings", text_config.tie_word_embeddings)
        super().__init__(text_config, quant_config=quant_config, prefix=prefix)
        logger.info(HANDOFF_LOG.format(model="target", count=mark_int8_handoffs(self.model.layers)))
        logger.info(MERGE_LOG.format(count=gdn_input_proj.merge(self.model.layers)))

    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        """DFlash taps the output of target layer i, i.e. the input of layer i + 1 (as SGLang's VL class)."""
        if not self.pp_group.is_last_rank:
            return
        self.capture_aux_hidden_states = True
        self.model.set_dflash_layers_to_capture([i + 1 for i in layer_ids])
        dflash_taps.mark(self.model.layers, [i + 1 for i in layer_ids])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, head_loaded = dict(self.named_parameters()), set()

        def body_and_head_weight():
            for name, tensor in text_only_weights(weights):
                if name.startswith("lm_head.") and name != LM_HEAD and name in params:
                    params[name].weight_loader(params[name], tensor)
                    head_loaded.add(name)
                else:
                    yield name, tensor

        return super().load_weights(body_and_head_weight()) | head_loaded


EntryClass = [Qwen3_5ForConditionalGeneration]
