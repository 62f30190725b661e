"""The quant-method interface: a quant method owns the expert weights' format and contributes stages.

Instead of overriding the forward, a method supplies the pieces that depend on its format: the
weights (:meth:`QuantMethod.create_weights`, :meth:`QuantMethod.process_weights_after_loading`), the
activation quantizer that runs before the dispatch, the expert stages (GEMM, activation, GEMM), and
:meth:`QuantMethod.apply_without_routing_weights`, the expert computation on already-dispatched,
expert-grouped rows that NPU-style and fused-EP backends call directly. What it accepts after
dispatch is data on the class (``accepts``, ``accepts_scales``, ``prefers``), read by the
dispatch-dtype resolver and the contract checker.

Two optional hooks: :meth:`QuantMethod.load_checkpoint_experts` reads the method's own checkpoint
format (e.g. FP8 weights with ``weight_scale_inv``, GPTQ ``qweight``/``qzeros``/``scales``), and a
method may offer a fused stage spanning dispatch -> combine (``offers_fused_ep``,
:meth:`QuantMethod.fused_ep_stage`); asking a method without one for it is a ``ContractError`` at
build time.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, Optional, Union

import torch

from moeforge.backend import Backend
from moeforge.dispatch_dtype import DispatchDtype
from moeforge.expert_checkpoint import Projection, read_per_expert
from moeforge.expert_weights import ExpertNames, ExpertWeights, layer_compute_dtype, read_expert_weights
from moeforge.errors import BackendUnavailableError, CheckpointError, ContractError
from moeforge.kernels.config import ConfigTable
from moeforge.kernels.formats import WeightFormat
from moeforge.no_backward import no_backward
from moeforge.payloads import MoEOutput, RoutedTokens
from moeforge.spec import DType, GroupListType, ScaleLayout
from moeforge.stage import Stage
from moeforge.stages.activation import ActivationConfig
from moeforge.quant.expert_grouped import apply_expert_stages
from moeforge.stages.quantize import QuantizeTokens, quantizer_for


# The alignment of the 4-bit methods, whose triton GEMMs decode their weights in every program: 64-row
# blocks from 32 rows per expert, 128-row blocks from 256 (``QuantMethod.dequant_blocks``; one decoded tile
# serves more rows: docs/kernels.md, "How a launch is planned today").
FOUR_BIT_BLOCKS: tuple[tuple[float, int], ...] = ((32.0, 64), (256.0, 128))


class QuantMethod(abc.ABC):
    """Base class of the quant methods.

    Class attributes (capabilities, read by the resolver and the contract checker):

    * ``accepts`` — activation dtypes the expert stages consume after dispatch;
    * ``accepts_scales`` — their scale layouts;
    * ``prefers`` — the dispatch dtype the method prefers when nothing stronger decides (it refines
      rule 6, the library default, of :func:`~moeforge.resolve_dispatch_dtype`); ``None``: no
      preference;
    * ``expert_parameters`` — names of the per-expert tensors ``create_weights`` registers (leading
      dimension = experts): what expert parallelism slices per rank;
    * ``weight_format`` — the format of its expert weights in the one vocabulary the stages, the launcher and
      the kernels share (:class:`~moeforge.kernels.formats.WeightFormat`); ``None`` for a format moeforge's
      GEMMs do not compute (an NPU kernel's);
    * ``tensor_names`` — where a layer of this method keeps each projection's tensors (weight, scale, zero
      point, global scale, bias): what :meth:`expert_weights` reads by default;
    * ``offers_fused_ep`` — whether :meth:`fused_ep_stage` builds a fused dispatch -> combine stage;
    * ``backends`` — (a property) the backends its experts run on: the :mod:`moeforge.selector`'s
      :class:`~moeforge.roles.Experts` candidates that compute it;
    * ``max_block_m`` — caps the rows per block of the block-aligned dispatch for this method's
      triton GEMMs (``None``: the tuned tables decide);
    * ``dequant_blocks`` — ``(rows per expert, block_m)`` steps that set the alignment block of
      batches with that many rows per expert, for triton GEMMs that decode their weights in every
      program (4-bit formats: one decoded tile serves more rows); empty: the tables decide.
    * ``table_key`` — (a property) the name of the method's weight format in the tuned launch tables
      (``benchmarks/tune_moe.py --quant``): a table tuned for it gives its triton GEMMs their tiles and
      alignment; ``None`` (unquantized, or not tuned separately): the compute dtype's table and the
      GEMMs' own rules.
    * ``compute_dtype_parameters`` — the expert tensors held in the layer's compute dtype (biases,
      unquantized weights, W4A16 scales): they follow ``layer.to(dtype)``, the others keep their
      format's dtype (:meth:`keeps_dtype`).
    * ``differentiable`` — whether gradients flow through the method's experts. Only the unquantized
      method's do; a quantized format is inference-only: a layer computing it gives its output a
      backward that raises :class:`~moeforge.errors.InferenceOnlyError` naming the method
      (:meth:`backward_problem`), instead of silently wrong or missing gradients. A method written
      outside moeforge whose stages differentiate sets it to ``True``.
    * ``row_gradients`` — whether the torch stages' GEMMs pass gradients to their float rows through the frozen
      quantized weights (none to the weights, nor to their scales even with ``requires_grad`` set): what an expert
      adapter over this base trains with (:mod:`moeforge.adapters`; the weights decoded as they run do).
    """

    accepts: ClassVar[frozenset[DType]]
    accepts_scales: ClassVar[frozenset[ScaleLayout]]
    prefers: ClassVar[Optional[DispatchDtype]] = None
    expert_parameters: ClassVar[tuple[str, ...]] = ()
    offers_fused_ep: ClassVar[bool] = False
    max_block_m: ClassVar[Optional[int]] = None  # the triton GEMMs' largest useful alignment block
    dequant_blocks: ClassVar[tuple[tuple[float, int], ...]] = ()  # (rows per expert, block_m) steps
    # Expert tensors held in the layer's compute dtype, which follow layer.to(dtype); every other expert
    # tensor's dtype is part of the weight format (FP8 weights, fp32 scales) and stays.
    compute_dtype_parameters: ClassVar[tuple[str, ...]] = ("w13_bias", "w2_bias")
    differentiable: ClassVar[bool] = False
    row_gradients: ClassVar[bool] = False
    tensor_names: ClassVar[ExpertNames] = ExpertNames.of("{}_weight")
    weight_format: ClassVar[Optional[WeightFormat]] = None

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def table_key(self) -> Optional[str]:
        return None

    def backward_problem(self) -> Optional[str]:
        """Why gradients cannot flow back through this method's experts (``None``: they do, by autograd).
        The layer's pipeline raises it as an :class:`~moeforge.errors.InferenceOnlyError` in the backward."""
        if self.differentiable:
            return None
        return (f"{self.name} is inference-only: its quantized expert weights and activations have no gradient "
                "(moeforge trains unquantized layers: train with UnquantizedMethod, then quantize); run it under "
                "torch.no_grad() or torch.inference_mode()")

    def without_backward(self, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """``output`` of a computation on this method's experts from ``inputs``, whose backward raises
        :class:`~moeforge.errors.InferenceOnlyError` with :meth:`backward_problem` (``output`` itself for a
        differentiable method). The layer's pipeline does this for the forward; the direct entry point
        :meth:`apply_without_routing_weights` (and an override of it) calls it on its result."""
        problem = self.backward_problem()
        return output if problem is None else no_backward(problem, output, inputs)

    @abc.abstractmethod
    def create_weights(
        self,
        layer: torch.nn.Module,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        gated: bool,
        bias: bool,
        dtype: torch.dtype,
        device: Union[torch.device, str, None],
    ) -> None:
        """Register the expert parameters on ``layer`` (initialised, never left uninitialised)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack or convert the loaded weights (e.g. into a kernel's layout). Default: nothing."""

    def required_dispatch_dtype(self) -> Optional[DispatchDtype]:
        """The dispatch dtype this method's configuration requires (rule 3), if any."""
        return None

    def keeps_dtype(self, name: str) -> bool:
        """Whether the expert tensor ``name`` keeps its dtype when the layer's dtype changes
        (``layer.to(torch.float16)``): true for the tensors of the weight format (quantized weights,
        their scales), false for those in the compute dtype (``compute_dtype_parameters``)."""
        return name not in self.compute_dtype_parameters

    def expert_parameter_names(self, layer: torch.nn.Module) -> tuple[str, ...]:
        """The per-expert tensors of ``layer`` (those of ``expert_parameters`` it has, not ``None``)."""
        return tuple(name for name in self.expert_parameters if getattr(layer, name, None) is not None)

    def expert_weights(self, holder: torch.nn.Module, names: Optional[ExpertNames] = None, *,
                       dtype: Optional[DType] = None) -> ExpertWeights:
        """The record of ``holder``'s expert tensors that the :class:`~moeforge.roles.Experts` implementations
        build their stages from: by this method's ``tensor_names`` (a ``MoELayer`` of it), or by ``names`` (what
        another holder calls them: a transformers experts module's). ``dtype``: the float dtype the experts
        compute (default :meth:`compute_dtype`). The layout of packed weights is the one the holder recorded
        (:mod:`moeforge.quant.stored_layout`; plain for a holder that recorded none)."""
        from moeforge.quant.stored_layout import stored_layout

        return read_expert_weights(holder, names or self.tensor_names,
                                   dtype if dtype is not None else self.compute_dtype(holder), stored_layout(holder))

    def compute_dtype(self, holder: torch.nn.Module) -> DType:
        """The float dtype the experts of ``holder`` compute in: its ``dtype`` attribute (``MoELayer.dtype``)."""
        return layer_compute_dtype(holder)

    def load_checkpoint_experts(
        self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The method's expert tensors built from a checkpoint in its own format.

        ``tensors`` maps names relative to the block prefix (``"experts.3.gate_proj.weight"``,
        ``"experts.3.gate_proj.weight_scale_inv"``, ...) to tensors, read lazily. Returns, for each of
        ``layer``'s expert tensors (all of them: :func:`moeforge.checkpoint.load_weights` refuses a
        result that leaves one unfilled), the new value (same shape and dtype as the layer's;
        ``load_weights`` copies them only after every check passed).

        Default: the per-expert loop of :func:`moeforge.expert_checkpoint.read_per_expert` (naming,
        the experts an expert-parallel layer holds, gate/up joining, biases, stacking), which asks
        :meth:`read_projection` for each projection. A method whose checkpoints store the experts
        otherwise (GPT-OSS's fused MXFP4 tensors) overrides this instead.
        """
        return read_per_expert(self, layer, tensors)

    def read_projection(self, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                        projection: Projection) -> dict[str, torch.Tensor]:
        """One expert projection's tensors in this method's format: the checkpoint's
        ``{projection.key}.<suffix>`` tensors turned into the layer's, keyed by the layer's expert
        tensor names without their ``w13_`` / ``w2_`` prefix (``{"weight": [N, K], "weight_scale":
        [N]}``), rows first (dim 0 = the projection's output features, or their blocks: the loader
        joins gate and up rows along it). Biases are the loader's. Raise
        :class:`~moeforge.errors.CheckpointError` naming the key of a missing or misshapen tensor.
        Default: this method reads no checkpoint format."""
        raise CheckpointError(f"{self.name} does not read checkpoints: fill its tensors yourself, then call "
                              "layer.process_weights_after_loading()")

    def fused_ep_stage(
        self,
        layer: torch.nn.Module,
        *,
        activation: ActivationConfig,
        apply_routing_weights: bool,
        routed_scaling_factor: Optional[float],
        out_dtype: DType,
        dispatch: DispatchDtype,
    ) -> Stage[RoutedTokens, MoEOutput]:
        """A fused stage spanning dispatch -> combine (kinds DISPATCH, GEMM, ACTIVATION, GEMM,
        COMBINE) for methods whose ``offers_fused_ep`` is true; :class:`~moeforge.MoELayer` calls
        :meth:`prepare_fused_ep_weights` first. It consumes routed tokens in the ``dispatch`` format
        and returns the combined output in ``out_dtype``, applying the routing weights (when
        ``apply_routing_weights``) and ``routed_scaling_factor`` (when not ``None``) itself.
        Default: a :class:`~moeforge.errors.ContractError` (this method offers none)."""
        raise ContractError(
            producer="quantize/top-k",
            consumer=f"fused dispatch->combine stage of {self.name}",
            field="fused_ep",
            have="requested (dispatcher='fused_ep')",
            want=f"a quant method that offers one ({self.name} does not)",
            hint="use dispatcher='auto', 'sorted' or 'padded', or a quant method whose offers_fused_ep is true",
        )

    def prepare_fused_ep_weights(self, layer: torch.nn.Module) -> None:
        """Re-lay out the expert weights for :meth:`fused_ep_stage` (default: nothing)."""

    def quantize_stage(
        self, dispatch: DispatchDtype, compute: DType
    ) -> Optional[Stage[RoutedTokens, RoutedTokens]]:
        """The stage that turns ``compute`` activations into the ``dispatch`` format before the
        dispatch; ``None`` when they already match."""
        quantizer = quantizer_for(dispatch, compute)
        return QuantizeTokens(quantizer) if quantizer is not None else None

    def reference_experts(self) -> Optional[type[Any]]:
        """The torch :class:`~moeforge.roles.Experts` implementation that is this method's reference computation
        (the stages :meth:`expert_stages` builds; ``apply_without_routing_weights`` runs them), or ``None`` for a
        method without one (it overrides :meth:`expert_stages`, or :meth:`apply_without_routing_weights`)."""
        return None

    def builds_own_stages(self) -> bool:
        """Whether the method overrides :meth:`expert_stages` (a method written outside moeforge that builds its
        own stages: the selector then runs those, :class:`~moeforge.roles.MethodOwnExperts`)."""
        return type(self).expert_stages is not QuantMethod.expert_stages

    def expert_stages(
        self,
        layer: torch.nn.Module,
        *,
        activation: ActivationConfig,
        routing_weights_in_epilogue: bool,
        backend: Backend = Backend.TORCH,
        configs: Optional[ConfigTable] = None,
        dispatch: Optional[DispatchDtype] = None,
    ) -> list[Stage[Any, Any]]:
        """The method's reference stages from dispatched rows (sorted or padded by expert) to expert outputs
        (typically GEMM, activation, GEMM) on ``layer``'s expert tensors: those of :meth:`reference_experts`,
        built from :meth:`expert_weights`. ``dispatch`` is the resolved dispatch dtype (``None``: the layer's
        float dtype): a method that computes in a quantized format but receives float rows starts with its own
        ``QuantizeRows`` (quantize after dispatch). ``configs`` is for an override that builds triton stages.

        The stages of a faster implementation are the selector's choice, not the method's:
        :func:`moeforge.selector.expert_stages` (``backend=`` other than torch here raises
        :class:`BackendUnavailableError` saying so). A method written outside moeforge may override this to
        build its own stages (the selector then runs them on the torch backend)."""
        if backend is not Backend.TORCH:
            raise BackendUnavailableError(
                f"{self.name}.expert_stages builds the method's reference (torch) stages; the {backend.value} "
                f"experts are the selector's: moeforge.selector.expert_stages(method, layer, backend=...)")
        experts = self.reference_experts()
        if experts is None:
            raise BackendUnavailableError(f"{self.name} has no reference experts: override expert_stages (or "
                                          "apply_without_routing_weights) to compute it")
        stages: list[Stage[Any, Any]] = experts.stages(
            self, self.expert_weights(layer), activation=activation,
            routing_weights_in_epilogue=routing_weights_in_epilogue, configs=configs, dispatch=dispatch)
        return stages

    def apply_without_routing_weights(
        self,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        hidden_states_scale: Optional[torch.Tensor],
        group_list_type: Union[GroupListType, int],
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """GEMM -> activation -> GEMM on expert-grouped rows, leaving routing weights and
        un-permutation to the caller's combine.

        ``hidden_states`` is ``[R, W]`` with rows grouped by local expert and ``group_list`` (length
        E) in the ``group_list_type`` convention (0 = cumsum, 1 = counts); or ``[E, C, W]`` (padded)
        with ``group_list`` = valid rows per expert (``group_list_type`` must be 1). Float rows come
        without a scale (a method that computes in a quantized format quantizes them as its experts
        do after a float dispatch); rows in one of the method's quantized formats come with the scale
        its quantizer produces (NVFP4: packed ``[..., H // 2]``). Returns the rows' shape (width H) in
        ``output_dtype``.

        Implemented once, here: the method's own torch expert stages
        (:meth:`expert_stages` for ``Backend.TORCH``), checked and run without routing weights
        (:func:`moeforge.quant.expert_grouped.apply_expert_stages`), so it computes what the layer's
        forward computes. Override it only for a fused kernel of the method's own (W4A4 on NPUs).
        """
        return apply_expert_stages(self, layer, hidden_states, hidden_states_scale, group_list_type, group_list,
                                   output_dtype)


def expert_shapes(num_experts: int, hidden_size: int, intermediate_size: int,
                  gated: bool) -> dict[str, tuple[int, int, int]]:
    """The expert matrices every method stores, as ``[E, N, K]``: ``"w13"`` gate/up ``[E, 2I, H]``
    (``[E, I, H]`` when the activation is not gated) and ``"w2"`` down ``[E, H, I]``."""
    gate_up = 2 * intermediate_size if gated else intermediate_size
    return {"w13": (num_experts, gate_up, hidden_size), "w2": (num_experts, hidden_size, intermediate_size)}


def register_expert_biases(layer: torch.nn.Module, shapes: dict[str, tuple[int, int, int]], bias: bool,
                           dtype: torch.dtype, device: Union[torch.device, str, None]) -> None:
    """``w13_bias [E, N13]`` and ``w2_bias [E, H]`` (zeros, float, trainable), or ``None`` for both
    when the experts have no biases; ``shapes`` as :func:`expert_shapes` gives them."""
    for prefix, (experts, rows, _) in shapes.items():
        value = torch.nn.Parameter(torch.zeros(experts, rows, dtype=dtype, device=device)) if bias else None
        layer.register_parameter(f"{prefix}_bias", value)
