"""The quant-method interface: capabilities as class data, weight creation, and
``apply_without_routing_weights`` (the expert-grouped entry point of NPU-style / fused-EP backends),
which must equal the full forward once the caller combines with the routing weights."""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import pytest
import torch

import moeforge as mf
from moeforge.payloads import ExpertRows, PaddedRows, SortedRows
from moeforge.reference import layer_reference
from moeforge.spec import FLOAT_DTYPES

E, K, H, I = 8, 2, 32, 16


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _randomize(layer: mf.MoELayer, seed: int = 0) -> None:
    """Random non-zero values for every parameter (biases start at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)


# -- capabilities and weights -----------------------------------------------------------------------


def test_unquantized_capabilities_are_class_data() -> None:
    assert "accepts" in vars(mf.UnquantizedMethod)
    assert "accepts_scales" in vars(mf.UnquantizedMethod)
    # float64 too: the torch experts compute it (the triton ones say they cannot serve it)
    assert mf.UnquantizedMethod.accepts == frozenset({mf.DType.BF16, mf.DType.FP16, mf.DType.FP32, mf.DType.FP64})
    assert mf.UnquantizedMethod.accepts == FLOAT_DTYPES | {mf.DType.FP64}
    assert vars(mf.UnquantizedMethod)["differentiable"] is True and mf.QuantMethod.differentiable is False
    assert mf.UnquantizedMethod.accepts_scales == frozenset({mf.ScaleLayout.NONE})
    method = mf.UnquantizedMethod()
    assert method.accepts is mf.UnquantizedMethod.accepts
    assert method.required_dispatch_dtype() is None
    assert method.name == "UnquantizedMethod"


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_create_weights_shapes(gated: bool, bias: bool, dtype: torch.dtype) -> None:
    holder = torch.nn.Module()
    mf.UnquantizedMethod().create_weights(holder, num_experts=E, hidden_size=H, intermediate_size=I,
                                          gated=gated, bias=bias, dtype=dtype, device="cpu")
    gate_up = 2 * I if gated else I
    params = dict(holder.named_parameters())
    assert params["w13_weight"].shape == (E, gate_up, H)
    assert params["w2_weight"].shape == (E, H, I)
    if bias:
        assert params["w13_bias"].shape == (E, gate_up)
        assert params["w2_bias"].shape == (E, H)
        assert set(params) == {"w13_weight", "w2_weight", "w13_bias", "w2_bias"}
    else:
        assert holder.w13_bias is None and holder.w2_bias is None
        assert set(params) == {"w13_weight", "w2_weight"}
    for name in ("w13_weight", "w2_weight"):
        weight = params[name].detach()
        assert weight.dtype == dtype and weight.device.type == "cpu"
        assert bool(torch.isfinite(weight).all()) and float(weight.float().std()) > 0


def test_layer_weights_follow_the_activation() -> None:
    gated = mf.MoELayer(E, K, H, I, environ={})
    plain = mf.MoELayer(E, K, H, I, activation=mf.ActivationConfig(mf.ActivationKind.RELU2), environ={})
    assert gated.w13_weight.shape == (E, 2 * I, H)
    assert plain.w13_weight.shape == (E, I, H)


def test_quant_method_missing_abstract_methods_cannot_be_instantiated() -> None:
    # expert_stages has a default (the selector's experts for the method) and apply_without_routing_weights
    # one (those stages, run without routing weights); only the weights are the method's to define.
    assert set(mf.QuantMethod.__abstractmethods__) == {"create_weights"}

    class NothingAtAll(mf.QuantMethod):
        pass

    with pytest.raises(TypeError, match="create_weights"):
        NothingAtAll()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        mf.QuantMethod()  # type: ignore[abstract]


class OwnStagesMethod(mf.QuantMethod):
    """A method written outside moeforge: its weights and its own torch expert stages, nothing else."""

    accepts: ClassVar[frozenset[mf.DType]] = FLOAT_DTYPES
    accepts_scales: ClassVar[frozenset[mf.ScaleLayout]] = frozenset({mf.ScaleLayout.NONE})
    expert_parameters: ClassVar[tuple[str, ...]] = ("gate_up", "down")

    def create_weights(self, layer: torch.nn.Module, *, num_experts: int, hidden_size: int,
                       intermediate_size: int, gated: bool, bias: bool, dtype: torch.dtype,
                       device: Any) -> None:
        gate_up = 2 * intermediate_size if gated else intermediate_size
        layer.register_parameter("gate_up", torch.nn.Parameter(
            torch.randn(num_experts, gate_up, hidden_size, dtype=dtype, device=device) / hidden_size ** 0.5))
        layer.register_parameter("down", torch.nn.Parameter(
            torch.randn(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
            / intermediate_size ** 0.5))

    def expert_stages(self, layer: torch.nn.Module, *, activation: mf.ActivationConfig,
                      routing_weights_in_epilogue: bool, **kwargs: Any) -> list[mf.Stage[Any, Any]]:
        return [
            mf.stages.GroupedGemm(mf.stages.GemmRole.GATE_UP, getattr(layer, "gate_up")),
            mf.stages.Activate(activation),
            mf.stages.GroupedGemm(mf.stages.GemmRole.DOWN, getattr(layer, "down"),
                                  apply_routing_weights=routing_weights_in_epilogue),
        ]


class NoStagesMethod(OwnStagesMethod):
    def expert_stages(self, layer: torch.nn.Module, **kwargs: Any) -> list[mf.Stage[Any, Any]]:
        return []


# -- apply_without_routing_weights == the full forward ------------------------------------------------


def _stage(layer: mf.MoELayer, kind: mf.StageKind) -> mf.Stage[Any, Any]:
    return next(stage for stage in layer.pipeline.stages if kind in stage.kinds)


def _dispatched(layer: mf.MoELayer, x: torch.Tensor) -> ExpertRows:
    """Run the layer's own top-k (+ quantize) + dispatch stages."""
    payload: Any = mf.MoEInput(x, layer.router_logits(x))
    for stage in layer.pipeline.stages:
        payload = stage(payload)
        if mf.StageKind.DISPATCH in stage.kinds:
            assert isinstance(payload, ExpertRows)
            return payload
    raise AssertionError("no dispatch stage")


def _combine(layer: mf.MoELayer, rows: ExpertRows, expert_out: torch.Tensor) -> torch.Tensor:
    """The caller's combine: un-permute and apply the routing weights (and a pending factor)."""
    routing = layer.routing
    factor = None
    if routing.routed_scaling_factor != 1.0 and not routing.scaling_in_weights:
        factor = routing.routed_scaling_factor
    if isinstance(rows, SortedRows):
        return rows.plan.combine(expert_out, True, factor, layer.dtype)
    assert isinstance(rows, PaddedRows)
    flat = expert_out.reshape(-1, expert_out.shape[-1])
    return rows.plan.combine(flat, True, factor, layer.dtype)


def _apply(layer: mf.MoELayer, rows: ExpertRows, group_list_type: Union[mf.GroupListType, int],
           group_list: Optional[torch.Tensor] = None) -> torch.Tensor:
    if group_list is None:
        group_list = rows.group_list if isinstance(rows, SortedRows) else rows.masked_m  # type: ignore[attr-defined]
    return layer.quant.apply_without_routing_weights(layer, rows.x.data, rows.x.scale, group_list_type,
                                                     group_list, layer.dtype)


SORTED_CASES = [
    pytest.param(mf.GroupListType.COUNT, mf.GroupListType.COUNT, id="count-enum"),
    pytest.param(mf.GroupListType.COUNT, 1, id="count-int"),
    pytest.param(mf.GroupListType.CUMSUM, mf.GroupListType.CUMSUM, id="cumsum-enum"),
    pytest.param(mf.GroupListType.CUMSUM, 0, id="cumsum-int"),
]


@pytest.mark.parametrize("group_list_type, passed_type", SORTED_CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [mf.ActivationKind.SWIGLU, mf.ActivationKind.GPT_OSS_SWIGLU,
                                        mf.ActivationKind.RELU2])
@torch.no_grad()
def test_apply_without_routing_weights_on_sorted_rows_equals_the_forward(
    group_list_type: mf.GroupListType, passed_type: Union[mf.GroupListType, int], bias: bool,
    activation: mf.ActivationKind,
) -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={}, expert_bias=bias,
                        activation=mf.ActivationConfig(activation),
                        dispatcher=mf.SortedDispatch(E, group_list_type=group_list_type))
    _randomize(layer, seed=3)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(4))
    rows = _dispatched(layer, x)
    assert isinstance(rows, SortedRows) and rows.group_list_type is group_list_type
    expert_out = _apply(layer, rows, passed_type)
    assert expert_out.shape == rows.x.data.shape and expert_out.dtype == torch.float32
    out = _combine(layer, rows, expert_out)
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
    assert _rel(out, layer_reference(layer, x)) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_apply_without_routing_weights_on_padded_rows_equals_the_forward(bias: bool) -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={}, expert_bias=bias, dispatcher="padded")
    _randomize(layer, seed=5)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(6))
    rows = _dispatched(layer, x)
    assert isinstance(rows, PaddedRows)
    for passed_type in (mf.GroupListType.COUNT, 1):
        expert_out = _apply(layer, rows, passed_type)
        assert expert_out.shape == rows.x.data.shape
        out = _combine(layer, rows, expert_out)
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)
        assert _rel(out, layer_reference(layer, x)) < 1e-5


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_method_with_its_own_stages_gets_apply_without_routing_weights_from_them(
    dispatcher: str, out_dtype: torch.dtype,
) -> None:
    """The base class runs the method's own torch expert stages: a method that defines only its weights
    and stages answers expert-grouped callers with what the layer's forward computes."""
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={}, quant=OwnStagesMethod(),
                        dispatcher=dispatcher)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(9))
    rows = _dispatched(layer, x)
    group_list = rows.group_list if isinstance(rows, SortedRows) else rows.masked_m  # type: ignore[attr-defined]
    expert_out = layer.quant.apply_without_routing_weights(layer, rows.x.data, None, 1, group_list, out_dtype)
    assert expert_out.shape == rows.x.data.shape and expert_out.dtype == out_dtype
    out = _combine(layer, rows, expert_out.float())
    tol = dict(rtol=1e-5, atol=1e-6) if out_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, layer(x), **tol)  # type: ignore[arg-type]


def test_a_method_whose_stages_hold_no_gemm_must_override_apply() -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={}, quant=OwnStagesMethod())
    with pytest.raises(TypeError, match="override apply_without_routing_weights"):
        NoStagesMethod().apply_without_routing_weights(layer, torch.randn(16, H), None, 1,
                                                       torch.full((E,), 2, dtype=torch.int64), torch.float32)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_apply_rejects_an_output_dtype_that_is_not_float(layer: mf.MoELayer, dtype: torch.dtype) -> None:
    with pytest.raises(mf.InputError, match="output_dtype"):
        layer.quant.apply_without_routing_weights(layer, torch.randn(16, H), None, 1,
                                                  torch.full((E,), 2, dtype=torch.int64), dtype)


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@torch.no_grad()
def test_apply_without_routing_weights_with_a_pending_scaling_factor_and_bf16(dispatcher: str) -> None:
    routing = mf.RoutingConfig(scoring=mf.Scoring.SIGMOID, routed_scaling_factor=2.5,
                               scaling_in_weights=False)
    layer = mf.MoELayer(E, K, H, I, dtype=torch.bfloat16, routing=routing, environ={},
                        dispatcher=dispatcher)
    _randomize(layer, seed=7)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    rows = _dispatched(layer, x)
    expert_out = _apply(layer, rows, mf.GroupListType.COUNT)
    assert expert_out.dtype == torch.bfloat16
    out = _combine(layer, rows, expert_out)
    # the pipeline rounds the gate/up output to bf16, apply_without_routing_weights keeps it in fp32
    assert _rel(out, layer(x)) < 2e-2
    assert _rel(out, layer_reference(layer, x)) < 2e-2


@torch.no_grad()
def test_apply_without_routing_weights_with_empty_experts_and_no_rows() -> None:
    layer = mf.MoELayer(E, 1, H, I, dtype=torch.float32, environ={})
    _randomize(layer, seed=9)
    x = torch.randn(5, H)
    logits = torch.full((5, E), -5.0)
    logits[:, 2] = 5.0  # every token on expert 2: all other groups are empty
    rows = mf.SortedDispatch(E)(_stage(layer, mf.StageKind.TOPK)(mf.MoEInput(x, logits)))
    assert rows.group_list.tolist() == [0, 0, 5, 0, 0, 0, 0, 0]
    out = _combine(layer, rows, _apply(layer, rows, 1))
    torch.testing.assert_close(out, layer(x, logits), rtol=1e-5, atol=1e-6)
    # no rows at all
    empty = layer.quant.apply_without_routing_weights(layer, torch.empty(0, H), None, 1,
                                                      torch.zeros(E, dtype=torch.int64), torch.float32)
    assert empty.shape == (0, H)


# -- bad inputs ---------------------------------------------------------------------------------------


@pytest.fixture
def layer() -> mf.MoELayer:
    return mf.MoELayer(E, K, H, I, dtype=torch.float32, environ={})


def _call(layer: mf.MoELayer, hidden: torch.Tensor, scale: Optional[torch.Tensor] = None,
          group_list_type: Any = 1, group_list: Optional[torch.Tensor] = None) -> torch.Tensor:
    if group_list is None:
        group_list = torch.full((E,), hidden.shape[0] // E, dtype=torch.int64)
    return layer.quant.apply_without_routing_weights(layer, hidden, scale, group_list_type, group_list,
                                                     torch.float32)


def test_apply_rejects_a_scale(layer: mf.MoELayer) -> None:
    with pytest.raises(mf.InputError, match="hidden_states_scale"):
        _call(layer, torch.randn(16, H), scale=torch.ones(16, 1))


@pytest.mark.parametrize("length", [E - 1, E + 1, 1])
def test_apply_rejects_a_group_list_of_the_wrong_length(layer: mf.MoELayer, length: int) -> None:
    with pytest.raises(mf.InputError, match="group_list"):
        _call(layer, torch.randn(16, H), group_list=torch.full((length,), 2, dtype=torch.int64))
    with pytest.raises(mf.InputError, match="group_list"):
        _call(layer, torch.randn(E, 4, H), group_list=torch.full((length,), 2, dtype=torch.int64))


def test_apply_rejects_a_2d_group_list(layer: mf.MoELayer) -> None:
    with pytest.raises(mf.InputError, match="group_list"):
        _call(layer, torch.randn(16, H), group_list=torch.full((E, 1), 2, dtype=torch.int64))


@pytest.mark.parametrize("group_list_type, group_list", [
    (1, [2, 2, 2, 2, 2, 2, 2, 1]),  # counts cover 15 of 16 rows
    (1, [2, 2, 2, 2, 2, 2, 2, 3]),  # 17 rows
    (1, [4, 4, 4, 4, 4, -2, 0, -2]),  # sums to 16 but negative
    (0, [2, 4, 6, 8, 10, 12, 14, 15]),  # cumsum ends at 15
    (0, [2, 4, 6, 8, 10, 12, 14, 16][::-1]),  # cumsum not monotone
    (mf.GroupListType.CUMSUM, [2, 2, 2, 2, 2, 2, 2, 2]),  # counts passed as cumsum
])
def test_apply_rejects_counts_that_do_not_cover_the_rows(
    layer: mf.MoELayer, group_list_type: Any, group_list: list[int]
) -> None:
    with pytest.raises(mf.InputError, match="group_list"):
        _call(layer, torch.randn(16, H), group_list_type=group_list_type,
              group_list=torch.tensor(group_list, dtype=torch.int64))


def test_apply_rejects_padded_rows_with_cumsum(layer: mf.MoELayer) -> None:
    with pytest.raises(mf.InputError, match="group_list_type"):
        _call(layer, torch.randn(E, 4, H), group_list_type=0,
              group_list=torch.full((E,), 2, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(16,), (1, E, 2, H)])
def test_apply_rejects_the_wrong_rank(layer: mf.MoELayer, shape: tuple[int, ...]) -> None:
    with pytest.raises(mf.InputError, match="hidden_states"):
        _call(layer, torch.randn(shape), group_list=torch.full((E,), 2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float64])
def test_apply_rejects_non_float_or_unsupported_dtypes(layer: mf.MoELayer, dtype: torch.dtype) -> None:
    with pytest.raises(mf.InputError, match="hidden_states"):
        _call(layer, torch.randn(16, H).to(dtype))


@pytest.mark.parametrize("shape", [(16, H + 1), (E, 4, H - 1), (E + 1, 4, H)])
def test_apply_rejects_hidden_states_that_do_not_fit_the_weights(
    layer: mf.MoELayer, shape: tuple[int, ...]
) -> None:
    with pytest.raises(mf.InputError, match="hidden_states"):
        _call(layer, torch.randn(shape), group_list=torch.full((E,), 2, dtype=torch.int64))


@pytest.mark.parametrize("group_list_type", [2, -1, "count"])
def test_apply_rejects_an_unknown_group_list_type(layer: mf.MoELayer, group_list_type: Any) -> None:
    with pytest.raises(mf.InputError, match="group_list_type"):
        _call(layer, torch.randn(16, H), group_list_type=group_list_type)


# -- a quant method that contributes its own stages ---------------------------------------------------


class Fp8DispatchMethod(mf.UnquantizedMethod):
    """Unquantized weights, FP8 per-token activations on the wire: the method's config requires FP8
    dispatch (rule 3) and its GEMMs accept FP8 rows with per-token scales."""

    accepts: ClassVar[frozenset[mf.DType]] = FLOAT_DTYPES | {mf.DType.FP8_E4M3}
    accepts_scales: ClassVar[frozenset[mf.ScaleLayout]] = frozenset(
        {mf.ScaleLayout.NONE, mf.ScaleLayout.PER_TOKEN})

    def required_dispatch_dtype(self) -> Optional[mf.DispatchDtype]:
        return mf.DispatchDtype.FP8

    def expert_stages(self, layer: torch.nn.Module, *, activation: mf.ActivationConfig,
                      routing_weights_in_epilogue: bool,
                      **backend: Any) -> list[mf.Stage[ExpertRows, ExpertRows]]:
        stages = super().expert_stages(layer, activation=activation,
                                       routing_weights_in_epilogue=routing_weights_in_epilogue, **backend)
        gate_up = stages[0]
        assert isinstance(gate_up, mf.GroupedGemm)
        compute = mf.DType.from_torch(getattr(layer, "dtype"))
        # a GEMM consuming quantized rows must say what it produces
        stages[0] = mf.GroupedGemm(gate_up.role, gate_up.weight, gate_up.bias,
                                   accepts_dtypes=self.accepts, accepts_scales=self.accepts_scales,
                                   out_dtype=compute)
        return stages


@pytest.mark.parametrize("dispatcher", ["sorted", "padded"])
@torch.no_grad()
def test_a_quant_method_contributes_its_quantizer_and_gemms(dispatcher: str) -> None:
    layer = mf.MoELayer(E, K, H, I, dtype=torch.float32, quant=Fp8DispatchMethod(), environ={},
                        dispatcher=dispatcher, debug=True)
    assert layer.dispatch_decision == mf.DispatchDecision(mf.DispatchDtype.FP8, mf.DispatchRule.QUANT_METHOD)
    assert "dispatch fp8 (rule 3: quant method)" in layer.describe()
    quantize = _stage(layer, mf.StageKind.QUANTIZE)
    assert isinstance(quantize, mf.QuantizeTokens)
    assert quantize.quantizer == mf.PerTokenQuantizer(mf.DType.FP8_E4M3)
    _randomize(layer, seed=11)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(12))
    assert _rel(layer(x), layer_reference(layer, x)) < 6e-2


def test_a_quant_method_without_fp8_gemms_cannot_take_fp8_dispatch() -> None:
    class Broken(mf.UnquantizedMethod):
        def required_dispatch_dtype(self) -> Optional[mf.DispatchDtype]:
            return mf.DispatchDtype.FP8

    with pytest.raises(mf.ContractError) as info:
        mf.MoELayer(E, K, H, I, quant=Broken(), environ={})
    assert info.value.field == "dtype"
    assert "rule 3: quant method" in info.value.producer
    assert "Broken" in info.value.consumer


def test_a_method_builds_its_reference_stages_and_leaves_other_backends_to_the_selector() -> None:
    """QuantMethod.expert_stages is the method's reference (torch) computation; a faster backend's stages are the
    selector's choice (moeforge.selector.expert_stages), not a second selector inside the method."""
    from moeforge.errors import BackendUnavailableError
    from moeforge.selector import expert_stages

    layer = mf.MoELayer(4, 2, 32, 16, quant=mf.Fp8W8A8Method(), backend="torch", environ={})
    stages = layer.quant.expert_stages(layer, activation=layer.activation, routing_weights_in_epilogue=False)
    assert [type(stage).__name__ for stage in stages] == ["QuantizeRows", "W8A8GroupedGemm", "ActivateQuantize",
                                                          "W8A8GroupedGemm"]
    with pytest.raises(BackendUnavailableError, match="moeforge.selector.expert_stages"):
        layer.quant.expert_stages(layer, activation=layer.activation, routing_weights_in_epilogue=False,
                                  backend=mf.Backend.TRITON)
    same = expert_stages(layer.quant, layer, backend=mf.Backend.TORCH, activation=layer.activation,
                         routing_weights_in_epilogue=False)
    assert [type(stage) for stage in same] == [type(stage) for stage in stages]


def test_the_selector_passes_over_experts_that_cannot_compute_the_records_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """selector.expert_stages (no LayerConfig at hand) asks each candidate's weights_problem of the record."""
    from moeforge.errors import BackendUnavailableError
    from moeforge.quant.unquantized import TorchUnquantizedExperts
    from moeforge.selector import expert_stages

    layer = mf.MoELayer(4, 2, 32, 16, backend="torch", environ={})
    seen: list[Any] = []

    def refuses(cls: Any, weights: Any) -> str:
        seen.append(weights)
        return "not these tensors"

    monkeypatch.setattr(TorchUnquantizedExperts, "weights_problem", classmethod(refuses))
    with pytest.raises(BackendUnavailableError, match="no torch experts"):
        expert_stages(layer.quant, layer, backend=mf.Backend.TORCH, activation=layer.activation,
                      routing_weights_in_epilogue=False)
    assert seen and seen[0].gate_up.weight.get() is layer.w13_weight
