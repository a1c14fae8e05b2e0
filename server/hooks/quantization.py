"""A quiet start for qflash's quantization method.

SGLang's ModelConfig warns that every quantization method outside a list written into `_verify_quantization`
"is not fully optimized yet. The speed can be slower than non-quantized models.", which a user of
`qflash_w8a8` (qflash's own kernels) reads as something broken. The list is a local variable, so the warning is
filtered from that module's logger for `qflash_w8a8` alone.
Retire when SGLang lets a registered method declare itself optimized.
"""

import logging

from qflash.quant.layout import METHOD_NAME

LOGGER = "sglang.srt.configs.model_config"


def _keep(record: logging.LogRecord) -> bool:
    return not (record.args and record.args[0] == METHOD_NAME and "not fully" in str(record.msg))


class LogFilter:
    """`_keep` on SGLang's ModelConfig logger (a filter, not a hook: the warning is a log call inside a method)."""

    target = f"{LOGGER}.<filter>"

    def install(self):
        logging.getLogger(LOGGER).addFilter(_keep)
        return lambda: _keep in logging.getLogger(LOGGER).filters


CHANGES = [LogFilter()]
