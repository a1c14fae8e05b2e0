"""Token embeddings gathered by qflash's kernel (kernels/embedding.py) instead of torch's embedding.

SGLang 0.5.17 embeds tokens through `UnquantizedEmbeddingMethod.embedding`, `F.embedding` on the table: for a
decode block's 16 ids torch picks its small-index gather, whose threads load the ids one after another. A DFLASH
cycle embeds twice (the verify's block and the draft's, both on the target's table): ~7 us each on the H100 for a
copy of 80 KB. The rows are the same bits either way. CUDA tensors outside torch.compile's tracing only: on the
CPU, and in a traced forward (which torch's own kernels serve), the call stays SGLang's.
Retire when torch's index_select keeps its row loads in flight for few indices, or SGLang embeds with a kernel of
its own at tensor parallel size 1.
"""

import torch

from qflash.kernels.embedding import embedding
from qflash.server.hooks import Hook


def _rows_in_one_launch(original, self, layer, input_):
    table = layer.weight
    if not (input_.is_cuda and table.dim() == 2 and table.stride(1) == 1) or torch.compiler.is_compiling():
        return original(self, layer, input_)
    return embedding(input_, table)


CHANGES = [Hook("sglang.srt.layers.quantization.unquant.UnquantizedEmbeddingMethod.embedding", _rows_in_one_launch,
                "AROUND")]
