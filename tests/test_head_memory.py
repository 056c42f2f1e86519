"""The log-prob head's memory as ``bicc.memory`` counts it, against one chunk's resident peak measured on CPU
(``bench.memory_model.measure_head``, in a fresh process whose allocator returns freed buffers at once)."""

import pytest


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_head_chunk_holds_what_the_memory_model_counts(compiled):
    """bf16, a chunk of 512 tokens x 32,768 logits. Eager: a no-grad chunk holds the matmul's bf16 output and its fp32
    copy (6 bytes a logit), the update's its fp32 logits, exponentials and the entropy's product (12). Compiled: the
    matmul's output alone (2), and beside it the fp32 exponentials kept for the backward (6); the backward adds the
    weight's gradient (32,768 x 32 bf16, 0.125 bytes a logit), which the model counts apart. Where the compiled head
fell back to eager, it would hold the eager counts."""
    from bench.memory_model import head_in_a_process, predict_head

    measured, predicted = head_in_a_process(compiled, "bfloat16"), predict_head(compiled, "bfloat16")
    assert predicted == ({"no-grad log-probs": 2, "update": 6} if compiled else {"no-grad log-probs": 6, "update": 12})
    for phase, value in predicted.items():
        # within 0.3 bytes a logit (5 MiB here: the weight's gradient, the kernels' row-wise buffers)
        assert measured[phase] == pytest.approx(value, abs=0.3), (phase, measured)
