"""The log-prob head's memory as ``bicc.machine.memory`` counts it, against one chunk's resident peak measured on CPU
(``bench.memory_model.measure_head``, in a fresh process whose allocator returns freed buffers at once)."""

import pytest
import torch


@pytest.mark.launch
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)], ids=["eager", "compiled"])
def test_one_head_chunk_holds_what_the_memory_model_counts(compiled):
    """bf16, a chunk of 512 tokens x 32,768 logits. Eager: a no-grad chunk holds the matmul's bf16 output and its fp32
    copy (6 bytes a logit), the update's its fp32 logits, exponentials and the entropy's product (12). Compiled: the
    matmul's output alone (2), and beside it the fp32 exponentials kept for the backward (6); the backward adds the
    weight's gradient (32,768 x 32 bf16, 0.125 bytes a logit), which the model counts apart. Where the compiled head
    fell back to eager, it would hold the eager counts. A host whose GEMM computes a bf16 product in an fp32 buffer
    (a CPU without native bf16: 6 bytes a logit for the bare product) peaks at that wherever the model counts less,
    and the backward's weight-gradient product ([V, H]) holds such a buffer too: 4 x 32 / 512 = 0.25 bytes a logit."""
    from bench.memory_model import HEAD_SIZE, head_expected, head_in_a_process, predict_head

    measured, predicted = head_in_a_process(compiled, "bfloat16"), predict_head(compiled, "bfloat16")
    assert predicted == ({"no-grad log-probs": 2, "update": 6} if compiled else {"no-grad log-probs": 6, "update": 12})
    assert 2 - 0.3 <= measured["matmul"] <= 6 + 0.3  # its bf16 output, and at most an fp32 buffer beside it
    expected = head_expected(predicted, measured)
    n, _, hidden = HEAD_SIZE
    # per logit, for the weight gradient's product: on a CPU without native bf16 GEMMs (oneDNN's check) even where the
    # forward's product came out unbuffered (an AVX2 EPYC: matmul 2.0, update 6.37 = 6 + 0.125 + 0.25)
    buffered = measured["matmul"] > 2 + 0.3 or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    gemm_buffer = 4 * hidden / n if buffered else 0
    for phase, value in expected.items():
        # within 0.3 bytes a logit (5 MiB here: the weight's gradient, the kernels' row-wise buffers)
        assert measured[phase] == pytest.approx(value, abs=0.3 + gemm_buffer), (phase, measured)


def test_the_expected_peak_is_the_model_s_count_or_the_bare_product_s():
    """2 and 6 bytes a logit counted; a GEMM that peaks at 6 raises the first to 6, one that peaks at 2 (its output
    alone) leaves both."""
    from bench.memory_model import head_expected

    counted = {"no-grad log-probs": 2, "update": 6}
    assert head_expected(counted, {"matmul": 6.0}) == {"no-grad log-probs": 6.0, "update": 6}
    assert head_expected(counted, {"matmul": 2.0}) == counted
