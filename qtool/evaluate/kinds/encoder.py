"""An encoder's vectors: token states [N, T, H] (mean-pooled over the attention mask into one vector per
sample) or one vector per sample [N, H]. Judged as a search index uses them, over the whole evaluation set
(metrics.vector_figures): cosine to fp32 per sample, nearest-neighbour agreement, Spearman rank correlation of
all pair similarities, and SQNR; token states also by each real token's cosine. Never per-position classes or
CTC text: an argmax over a vector's coordinates picks its largest feature. Keeps one vector per sample and
model (float32) for the figures over the set."""
from __future__ import annotations

import numpy as np

from qtool.encoders import real_tokens
from qtool.metrics import cosine_each, mean_pool, vector_figures


class Encoder:
    per_class = False
    reads_mask = True  # add() takes the batch's attention mask (stats.OutputStats)

    @staticmethod
    def recognises(first) -> bool:
        return first.task == "encoder" and first.encoder is not None

    def __init__(self, first):
        self.tokens, self.mask_name = first.encoder == "tokens", first.mask
        self.ref: list = []  # one vector per sample, fp32's and int8's
        self.out: list = []
        self.masked = self.unmasked = 0  # batches pooled over the mask, over every position
        self.tok_sum, self.tok_n, self.tok_min = 0.0, 0, 1.0

    def add(self, a: np.ndarray, b: np.ndarray, mask=None) -> None:
        if not a.size:
            return
        if not self.tokens:
            self.ref.append(a.reshape(len(a), -1).astype(np.float32))
            self.out.append(b.reshape(len(b), -1).astype(np.float32))
            return
        m = real_tokens(mask, a.shape)
        self.masked += m is not None
        self.unmasked += m is None
        self.ref.append(mean_pool(a, m).astype(np.float32))
        self.out.append(mean_pool(b, m).astype(np.float32))
        cos = cosine_each(a[m], b[m]) if m is not None else cosine_each(a, b)
        if cos.size:
            self.tok_sum += float(cos.sum())
            self.tok_n += cos.size
            self.tok_min = min(self.tok_min, float(cos.min()))

    def result(self) -> dict:
        if not self.ref:
            return {}
        r = {"vectors": self._vectors(), **vector_figures(np.concatenate(self.ref), np.concatenate(self.out))}
        if self.tokens and self.tok_n:
            r["token_cosine"] = {"mean": self.tok_sum / self.tok_n, "worst": self.tok_min, "tokens": self.tok_n}
        return {"encoder": r}

    def _vectors(self) -> str:
        """How each sample's vector was made."""
        if not self.tokens:
            return "one per sample, as written"
        if self.masked and not self.unmasked:
            return f"token states mean-pooled over the attention mask '{self.mask_name}'"
        if self.masked:
            return (f"token states mean-pooled over the attention mask '{self.mask_name}' in {self.masked} batches, "
                    f"over every position in {self.unmasked} (the mask did not fit)")
        return "token states mean-pooled over every position" + (
            f" (the attention mask '{self.mask_name}' did not fit)" if self.mask_name else "")
