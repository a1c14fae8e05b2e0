"""Qwen3.5 served as a text model.

SGLang serves `Qwen3_5ForConditionalGeneration` as multimodal: its ModelConfig then demands an image processor,
and `--enable-multimodal` can only turn multimodality on, never off. qflash serves the text model only
(server/models/qwen3_5_text.py), and the stock systems of `qflash bench` serve the same text model, so every
ModelConfig built in a process with either plugin is text-only.
Retire when SGLang lets `--enable-multimodal false` (or a text-only architecture switch) turn it off.
"""

from qflash.server.hooks import Hook


def _text_only_model_config(*args, **kwargs):
    return args, {**kwargs, "enable_multimodal": False}


CHANGES = [Hook("sglang.srt.configs.model_config.ModelConfig.__init__", _text_only_model_config, "BEFORE")]
