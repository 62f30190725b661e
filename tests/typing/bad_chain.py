"""An obviously wrong composition: a GEMM straight after the top-k. mypy must reject it."""

import torch

import moeforge as mf

E, K, H, I = 4, 2, 32, 16
w13 = torch.randn(E, 2 * I, H)
pipeline = mf.chain(mf.TopK(E, K)).then(mf.GroupedGemm(mf.GemmRole.GATE_UP, w13))
