"""SGLang's DFlash drafter, with its layers' norms and SiLU-and-multiply marked to hand their output's int8 rows to
the drafter's W8A8 projections (quant/handoff.py), as the target's are.

Registered under the drafter checkpoint's architecture name, `DFlashDraftModel`, in place of SGLang's class (a
subclass, so DFLASH's checks of the draft model still hold).
"""

import logging

from sglang.srt.models.dflash import DFlashDraftModel as SGLangDFlashDraftModel

from qflash.server.models.qwen3_5_text import HANDOFF_LOG, mark_int8_handoffs

logger = logging.getLogger(__name__)


class DFlashDraftModel(SGLangDFlashDraftModel):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        logger.info(HANDOFF_LOG.format(model="drafter", count=mark_int8_handoffs(self.layers)))


EntryClass = [DFlashDraftModel]
