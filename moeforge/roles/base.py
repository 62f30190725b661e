"""The three roles a layer is assembled from, and the configuration they are chosen for.

* a :class:`Router` builds the top-k stage;
* a :class:`Dispatcher` builds the dispatch stage and the combine that takes its rows home (the rows'
  plan is its business alone);
* an :class:`Experts` implementation computes one weight format on one row layout: the quantization
  before the dispatch, and the stages from dispatched rows to expert outputs.

Each implementation is a class that says what it serves as data — its ``backend`` and the row
``layout`` it reads or delivers — and why it cannot serve a layer (:meth:`Role.supports`, ``None``
when it can). :func:`moeforge.selector.select` picks the first one of each role, in the order of its
candidate lists (fastest first), that can serve the layer; the layer itself knows none of them.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

import attrs
import torch
from typing_extensions import Self

from moeforge.backend import Backend
from moeforge.dispatch_dtype import DispatchDecision, DispatchDtype
from moeforge.expert_weights import ExpertWeights
from moeforge.kernels.config import ConfigTable
from moeforge.payloads import MoEInput, RoutedTokens
from moeforge.spec import DType, Layout, RoutingWeights
from moeforge.stage import Stage
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig

if TYPE_CHECKING:
    from moeforge.distributed.group import ExpertParallel
    from moeforge.quant.base import QuantMethod


@attrs.frozen
class LayerConfig:
    """Everything the roles are chosen for and built from: the layer's sizes, semantics, weight format,
    device and dispatch dtype, and the user's preferences (``backend``: ``None`` for "auto";
    ``dispatcher``: a name, a dispatch stage the user built, or a :class:`Dispatcher` instance with its
    settings)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    routing: RoutingConfig
    activation: ActivationConfig
    quant: QuantMethod
    dtype: torch.dtype
    device: torch.device
    dispatch: DispatchDecision
    expert_parallel: Optional[ExpertParallel] = None
    backend: Optional[Backend] = None
    dispatcher: Union[str, Stage[Any, Any], Dispatcher] = "auto"
    batch_invariant: bool = False  # tiles that reduce alike for every token count (moeforge.batch_invariant)

    @property
    def local_experts(self) -> int:
        return self.expert_parallel.local_experts if self.expert_parallel is not None else self.num_experts

    @property
    def weights_on_input(self) -> bool:
        return self.routing.apply_weights is RoutingWeights.ON_INPUT

    @property
    def weights_in_epilogue(self) -> bool:
        return self.routing.apply_weights is RoutingWeights.IN_GEMM_EPILOGUE

    @property
    def compute_dtype(self) -> DType:
        return DType.from_torch(self.dtype)

    def combine_options(self) -> dict[str, Any]:
        """What the combine applies: the routing weights when the router puts them there, the routed
        scaling factor when the top-k leaves it pending, and the layer's dtype."""
        routing = self.routing
        folded = routing.scaling_in_weights or routing.routed_scaling_factor == 1.0
        return dict(apply_routing_weights=routing.apply_weights is RoutingWeights.IN_COMBINE,
                    routed_scaling_factor=None if folded else routing.routed_scaling_factor,
                    out_dtype=self.compute_dtype)

    def triton_problem(self) -> Optional[str]:
        """Why the triton kernels cannot run for this layer (``None`` when they can)."""
        if self.device.type != "cuda":
            return f"the layer is on {self.device}, the triton kernels need a CUDA device"
        if self.dtype == torch.float64 or self.dispatch.dtype is DispatchDtype.FP64:
            return ("the triton kernels compute in bf16, fp16 or fp32, not float64 (float64 layers run on the "
                    "torch backend)")
        from moeforge.backend import triton_installed

        if not triton_installed():
            return "the 'triton' package is not installed"
        return None

    def kernel_configs(self) -> ConfigTable:
        """The triton GEMMs' launch table for this shape and device, shared by the block-aligned dispatch
        and the GEMMs (they must align alike)."""
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        if self.batch_invariant:
            from moeforge.batch_invariant import family_checked_on, invariant_table

            tuned = ConfigTable.load(name, self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
                                     self.compute_dtype.value) if family_checked_on(self.device) else None
            return invariant_table(self.num_experts, self.top_k, self.quant.max_block_m, tuned,
                                   self.dtype.itemsize)
        return ConfigTable.load(name, self.num_experts, self.top_k, self.hidden_size, self.intermediate_size,
                                self.compute_dtype.value, max_block_m=self.quant.max_block_m,
                                dequant_blocks=self.quant.dequant_blocks, weight_format=self.quant.table_key)


def on_the_device(stage: Optional[Stage[RoutedTokens, RoutedTokens]]) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
    """``stage`` computed by the triton quantization kernel where it computes that quantizer (the same
    numbers), for the triton experts' quantization before the dispatch."""
    from moeforge.stages.quantize import QuantizeTokens

    if isinstance(stage, QuantizeTokens):
        from moeforge.stages.triton_quant import TritonQuantizeTokens

        if TritonQuantizeTokens.supports(stage.quantizer):
            return TritonQuantizeTokens(stage.quantizer)
    return stage


class FloatRows(enum.Enum):
    """Which float rows an :class:`Experts` implementation reads from the dispatch (the quantized ones are
    its method's ``accepts``)."""

    ANY = "any"  # every float dtype its method accepts: computed in the accumulation dtype, or quantized first
    LAYER_DTYPE = "layer_dtype"  # the layer's own only: GEMMs that read rows in their weights' dtype


class Role(abc.ABC):
    """Base of the implementations of every role: what they serve, as class data."""

    backend: ClassVar[Backend]

    @classmethod
    def name(cls) -> str:
        return cls.__name__

    @classmethod
    @abc.abstractmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        """Why this implementation cannot serve ``config``, or ``None`` when it can."""


class Router(Role):
    """Builds the top-k stage."""

    @classmethod
    @abc.abstractmethod
    def stage(cls, layer: torch.nn.Module, config: LayerConfig) -> Stage[MoEInput, RoutedTokens]:
        """The routing stage (reading the layer's selection bias, if any)."""


class Experts(Role):
    """One weight format's computation on some row layouts: what the quant method's format needs around
    the dispatch (its quantizer before it) and the stages from dispatched rows to expert outputs."""

    method: ClassVar[type[Any]]  # the weight format it computes: its quant method (a QuantMethod subclass)
    layouts: ClassVar[frozenset[Layout]]  # the rows its GEMMs read
    float_rows: ClassVar[FloatRows] = FloatRows.ANY  # the float dispatch dtypes it reads

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        if not isinstance(config.quant, cls.method):
            return f"it computes {cls.method.__name__}'s weights"
        if config.quant.builds_own_stages():
            return "the quant method builds its own expert stages (it overrides expert_stages)"
        if cls.backend is Backend.TRITON:
            problem = config.triton_problem()
            if problem is not None:
                return problem
        return cls.rows_problem(config)

    @classmethod
    def rows_problem(cls, config: LayerConfig) -> Optional[str]:
        """Why it cannot read the rows the layer's dispatch dtype delivers (``float_rows``), or ``None``."""
        rows = config.dispatch.dtype.activation_dtype
        if cls.float_rows is FloatRows.ANY or rows.is_quantized or rows is config.compute_dtype:
            return None
        own = config.compute_dtype.value
        return (f"its GEMMs read {own} rows (the layer's dtype), not {rows.value}: {config.dispatch.explain()}; "
                f"dispatch_dtype={own!r} lets them run")

    @classmethod
    def weights_problem(cls, weights: ExpertWeights) -> Optional[str]:
        """Why it cannot compute these expert tensors (their dtypes, sizes or strides), or ``None``: what
        :func:`moeforge.selector.expert_stages` checks where no :class:`LayerConfig` is at hand. Default: none."""
        return None

    @classmethod
    def quantize_stage(cls, config: LayerConfig) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        """The stage that turns the layer's activations into the dispatch format (``None``: none needed)."""
        return config.quant.quantize_stage(config.dispatch.dtype, config.compute_dtype)

    @classmethod
    def stages_for(cls, method: Any, holder: torch.nn.Module, weights: Optional[ExpertWeights], *,
                   activation: ActivationConfig, routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
                   dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        """:meth:`stages` on ``weights``, or on what ``method`` reads from ``holder`` when it is ``None``."""
        return cls.stages(method, weights if weights is not None else method.expert_weights(holder),
                          activation=activation, routing_weights_in_epilogue=routing_weights_in_epilogue,
                          configs=configs, dispatch=dispatch)

    @classmethod
    @abc.abstractmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        """The stages from dispatched rows to expert outputs for ``method`` (an instance of ``cls.method``) on
        the expert tensors ``weights`` (what the method read from their holder: the stages know no parameter
        name; ``configs``: the launch table shared with a block-aligned dispatch; ``dispatch``: the dispatch
        dtype, ``None`` for the layer's float dtype)."""


class TorchExperts(Experts):
    """Base of the torch experts: the reference stages, on either expert-grouped layout."""

    backend: ClassVar[Backend] = Backend.TORCH
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.EXPERT_SORTED, Layout.EXPERT_PADDED})


class TritonExperts(Experts):
    """Base of the triton experts: fused kernels on block-aligned rows, whose quantization before the
    dispatch runs on the device where a kernel computes it."""

    backend: ClassVar[Backend] = Backend.TRITON
    layouts: ClassVar[frozenset[Layout]] = frozenset({Layout.BLOCK_ALIGNED})

    @classmethod
    def quantize_stage(cls, config: LayerConfig) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        return on_the_device(super().quantize_stage(config))

    @staticmethod
    def launch_table(configs: Optional[ConfigTable]) -> ConfigTable:
        """The launch table shared with the block-aligned dispatch (the GEMMs must align alike)."""
        if configs is None:
            raise ValueError("the triton expert stages need the ConfigTable of the dispatch")
        return configs


class Dispatcher(Role):
    """Builds the dispatch stage and the combine that takes its rows home.

    A dispatcher with settings of its own (a capacity, a buffer bound) is a frozen ``attrs`` subclass whose
    fields are those settings: the user passes an instance (``MoELayer(dispatcher=MyDispatcher(capacity=64))``),
    the selector tries its class, and its :meth:`stages` read the instance from ``config``
    (:meth:`settings`). No other module learns the settings' names."""

    layouts: ClassVar[frozenset[Layout]]  # the layouts it can deliver
    keyword: ClassVar[Optional[str]] = None  # the dispatcher= name that asks for it
    automatic: ClassVar[bool] = True  # whether dispatcher="auto" may pick it
    spans_experts: ClassVar[bool] = False  # a fused stage from routed tokens to the output (no Experts)

    @classmethod
    def layout_problem(cls, config: LayerConfig, layout: Layout) -> Optional[str]:
        """Why it cannot deliver ``layout`` for ``config`` (``None`` when it can)."""
        if layout not in cls.layouts:
            return f"it delivers {', '.join(sorted(item.value for item in cls.layouts))} rows"
        return None

    @classmethod
    def settings(cls, config: LayerConfig) -> Optional[Self]:
        """The instance of this dispatcher the layer was given (``dispatcher=``), holding its settings;
        ``None`` when it was asked for by name or chosen automatically."""
        return config.dispatcher if isinstance(config.dispatcher, cls) else None

    @classmethod
    @abc.abstractmethod
    def stages(cls, layer: torch.nn.Module, config: LayerConfig, layout: Layout, configs: Optional[ConfigTable]
               ) -> tuple[Stage[Any, Any], Optional[Stage[Any, Any]]]:
        """The dispatch stage delivering ``layout`` and the combine (with ``config.combine_options()``);
        a dispatcher that spans the experts returns its one fused stage and ``None``."""


class MethodOwnExperts(TorchExperts):
    """A quant method written outside moeforge that builds its own expert stages (it overrides
    :meth:`~moeforge.QuantMethod.expert_stages`): its torch stages, on either expert-grouped layout."""

    method: ClassVar[type[Any]] = object

    @classmethod
    def supports(cls, config: LayerConfig) -> Optional[str]:
        if not config.quant.builds_own_stages():
            return "the quant method builds no expert stages of its own"
        return None

    @classmethod
    def stages_for(cls, method: Any, holder: torch.nn.Module, weights: Optional[ExpertWeights], *,
                   activation: ActivationConfig, routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
                   dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        """The method's own stages for ``holder`` (it reads its tensors itself: no record is made)."""
        stages: list[Stage[Any, Any]] = method.expert_stages(
            holder, activation=activation, routing_weights_in_epilogue=routing_weights_in_epilogue,
            backend=Backend.TORCH, configs=configs, dispatch=dispatch)
        return stages

    @classmethod
    def stages(cls, method: Any, weights: ExpertWeights, *, activation: ActivationConfig,
               routing_weights_in_epilogue: bool, configs: Optional[ConfigTable],
               dispatch: Optional[DispatchDtype]) -> list[Stage[Any, Any]]:
        return cls.stages_for(method, weights.layer(), None, activation=activation,
                              routing_weights_in_epilogue=routing_weights_in_epilogue, configs=configs,
                              dispatch=dispatch)
