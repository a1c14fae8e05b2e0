"""A forward's copies into its CUDA graph's input buffers, in one foreach launch where they can be.

SGLang 0.5.17's graph runner copies a batch's inputs (input ids, positions, cache slots, pool rows, lengths, and for
Qwen3.5 the mrope positions) into its buffers with one `torch._foreach_copy_` per dtype pair. torch's fast foreach
takes only dense tensors of matching strides; the mrope buffer's slice of a batch's columns, [3, tokens] of a
[3, max tokens] buffer, is not, and sends every copy of its group to torch's slow path, one launch each: six before
each target verify. Here the dense pairs go to one foreach and the rest to another call, as SGLang groups them.
Retire when SGLang's registry keeps strided slots out of its foreach groups.
"""

from qflash.server.hooks import Hook


def _dense_pairs_in_one_launch(original, dsts, srcs):
    dense = [d.is_contiguous() and s.is_contiguous() and d.shape == s.shape for d, s in zip(dsts, srcs)]
    if all(dense) or not any(dense):
        return original(dsts, srcs)
    for keep in (True, False):
        original([d for d, f in zip(dsts, dense) if f is keep], [s for s, f in zip(srcs, dense) if f is keep])


CHANGES = [Hook("sglang.srt.model_executor.cuda_graph_buffer_registry._grouped_foreach_copy_",
                _dense_pairs_in_one_launch, "AROUND")]
