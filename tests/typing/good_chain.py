"""A well-typed composition: mypy must accept it."""

import torch

import moeforge as mf

E, K, H, I = 4, 2, 32, 16
w13 = torch.randn(E, 2 * I, H)
w2 = torch.randn(E, H, I)
pipeline: "mf.Pipeline[mf.MoEInput, mf.MoEOutput]" = (
    mf.chain(mf.TopK(E, K))
    .then(mf.SortedDispatch(E))
    .then(mf.GroupedGemm(mf.GemmRole.GATE_UP, w13))
    .then(mf.Activate())
    .then(mf.GroupedGemm(mf.GemmRole.DOWN, w2))
    .then(mf.Combine())
    .build(mf.input_spec(H, torch.float32, E))
)
