"""qtool/metrics.py: what agreement means for a one-value output."""
import numpy as np


def test_a_one_value_output_agrees_by_its_decision():
    """A VAD's speech probability (one value per sample): agreement is the same side of 0.5 (of 0 for a
    logit), counted and predicted; an argmax over one value always agreed."""
    from qtool.metrics import predicted_agreement, top1_agreement
    ref = np.array([[0.1], [0.45], [0.55], [0.9]], np.float32)
    out = np.array([[0.12], [0.52], [0.5], [0.88]], np.float32)
    assert top1_agreement(ref, out) == 0.5
    assert top1_agreement(ref - 0.5, out - 0.5) == 0.5  # logits: the threshold is 0
    assert top1_agreement(ref, ref) == 1.0
    p = predicted_agreement(ref, out)
    assert 0.5 < p < 1.0 and predicted_agreement(ref, ref + 0.001) > p
