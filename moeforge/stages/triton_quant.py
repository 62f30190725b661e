"""The Triton path for quantized experts: quantization and quantized grouped GEMMs on block-aligned rows.

These stages extend :mod:`moeforge.stages.triton` (read it first) to the quantized formats of
``/docs/kernels.md``; the quant methods build them in ``expert_stages(backend=TRITON)``:

* :class:`FusedQuantGroupedGemm` — FP8 / INT8 W8A8 or W4A16 grouped GEMM with the bias, activation
  and routing-weight epilogue; the gate/up GEMM can also quantize its activated output for the
  down GEMM (``output_quantizer``), in its epilogue when it can (FP8 per 128-group).
* :class:`QuantizeAligned` — quantize block-aligned rows (after the dispatch: the ``T`` token rows,
  not the ``T * top_k`` copies; or between the GEMMs).
* :class:`ActivateQuantizeAligned` — the activation fused with the quantization of its output.
* :class:`TritonQuantizeTokens` — :class:`~moeforge.stages.quantize.QuantizeTokens` by the kernel
  (before the dispatch; :class:`~moeforge.stages.triton.AlignDispatch` passes quantized tokens
  through untouched).

The kernels produce what the torch quantizers produce (bit-identical for the same float input).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import attrs
import torch

from moeforge.errors import InputError
from moeforge.expert_weights import ProjectionWeights
from moeforge.kernels.config import ConfigTable, GemmConfig
from moeforge.kernels.formats import WeightFormat, weight_operand
from moeforge.kernels.grouped_gemm_call import (GemmEpilogue, GemmRows, GemmUpdate, GemmWeight,
                                                grouped_gemm)
from moeforge.kernels import shuffle
from moeforge.kernels.scale_bound import ScaleCodeBound
from moeforge.payloads import GROUP_SIZE, Activations, AlignedRows, BlockAlignment, ExpertRows, RoutedTokens
from moeforge.spec import (
    FLOAT_DTYPES,
    Accepts,
    DType,
    Layout,
    PayloadKind,
    ScaleLayout,
    Spec,
)
from moeforge.stage import Mismatch, Stage, StageKind
from moeforge.stages.activation import ActivationConfig, GateUpLayout
from moeforge.stages.activate_quantize import ActivateQuantize
from moeforge.stages.triton import activation_args, kernel_ops
from moeforge.stages.gemm import GemmRole, expert_gemm_accepts, expert_gemm_output_spec
from moeforge.stages.quantize import PerGroupQuantizer, PerTokenQuantizer, QuantizeTokens, Quantizer
from moeforge.tensor_ref import TensorSource, resolve

FLOAT_TORCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def default_quant_config(weight_format: WeightFormat, block_m: int, *, wide_n: bool = False,
                         two_accumulators: bool = False, shuffled: bool = False) -> GemmConfig:
    """A launch configuration for ``weight_format`` keeping the dispatch's ``block_m``.

    Few rows per block are bound by reading the weights: narrow tiles, a deep pipeline. Many rows: a
    gate/up GEMM (``two_accumulators``: gate and up tiles side by side) with per-128 K-step scales
    spills registers beyond ``64 x 64`` tiles on 4 warps, so it stays at 64 x 64, or 64 x 128 on 8 warps
    when ``wide_n`` (a ``block_n`` multiple of 128 for FP8 per-group quantization in the epilogue) asks for
    it; a single accumulator (the down GEMM) takes 64 x 256 tiles on 8 warps. ``shuffled`` (4-bit weights in
    the pre-shuffled layout): swapped tiles of 64 or 128 weight rows. The tiles come from sweeps
    (docs/notes/kernels-log.md, "One grouped GEMM for every weight format", "The pre-shuffled 4-bit layout")."""
    if shuffled:
        if block_m <= 32:
            return GemmConfig(block_m, 64, 128, group_m=1 if block_m <= 16 else 8, num_warps=4, num_stages=3,
                              swap=True)
        if two_accumulators:
            return GemmConfig(block_m, 64 if block_m >= 128 else 128, 64, group_m=8, num_warps=4, num_stages=3,
                              swap=True)
        return GemmConfig(block_m, 128, 64, group_m=8, num_warps=8 if block_m >= 128 else 4, num_stages=3, swap=True)
    if weight_format is WeightFormat.INT4 and block_m <= 16:
        # Narrow 32-column tiles for 16-row blocks (the weights' bytes bound them).
        return GemmConfig(block_m, 32, 128, group_m=1, num_warps=4, num_stages=3)
    if weight_format.packed:
        # W4A16 beyond 16-row blocks, and FP4, with the packed decoding (benchmarks/sweep_fp4_tiles.py): 16-row
        # blocks take 128 columns; larger blocks take 64 columns for the gate/up GEMM (two weight tiles per step)
        # and 128 for the down GEMM, 4 warps, except the 128-row down GEMM, 8.
        four_bit_n = 128 if block_m <= 16 or not two_accumulators else 64
        warps = 8 if block_m >= 128 and not two_accumulators else 4
        return GemmConfig(block_m, four_bit_n, 64, group_m=1 if block_m <= 16 else 8, num_warps=warps,
                          num_stages=3)
    block_k = 128  # one 128-group per K-step for FP8 group/block scales
    wide = 128 if wide_n else 64
    if block_m <= 32:
        return GemmConfig(block_m, wide, block_k, group_m=1 if block_m <= 16 else 8, num_warps=4, num_stages=4)
    if two_accumulators:
        return GemmConfig(block_m, wide, block_k, group_m=8, num_warps=8 if wide_n else 4, num_stages=3)
    return GemmConfig(block_m, 256, block_k, group_m=8, num_warps=8, num_stages=4)


def kernel_supports(quantizer: Quantizer) -> bool:
    """Whether the quantization kernels compute ``quantizer`` (else use the torch stage)."""
    return isinstance(quantizer, PerGroupQuantizer) or (
        isinstance(quantizer, PerTokenQuantizer) and quantizer.dtype in (DType.FP8_E4M3, DType.INT8))


def kernel_format(quantizer: Quantizer) -> tuple[torch.dtype, bool]:
    """``(dtype, per_group)`` of the quantization kernel computing ``quantizer``."""
    if isinstance(quantizer, PerGroupQuantizer):
        return torch.float8_e4m3fn, True
    if isinstance(quantizer, PerTokenQuantizer):
        return quantizer.dtype.torch_dtype, False
    raise InputError(f"the triton quantization kernels compute PerTokenQuantizer (fp8/int8) and "
                     f"PerGroupQuantizer; got {quantizer!r} (use the torch stage for it)")


@attrs.frozen(eq=False)
class FusedQuantGroupedGemm(Stage[AlignedRows, AlignedRows]):
    """A quantized grouped GEMM on block-aligned rows (the one kernel of
    :mod:`moeforge.kernels.moe_gemm`), with the epilogue of
    :class:`~moeforge.stages.triton.FusedGroupedGemm` (bias, fused activation, routing weights).

    ``weight`` is ``[E, N, K]`` fp8 / int8 (W8A8) or packed uint8 ``[E, N, K / 2]`` (the 4-bit schemes;
    MXFP4's ``[E, N, K / 32, 16]`` blocks are read as that). ``weight_scale`` is fp32 ``[E, N]`` (per
    channel) or ``[E, ceil(N / 128), ceil(K / 128)]`` (128x128 blocks) for W8A8; ``[E, N, K / G]`` in
    the activation dtype for W4A16, with optional ``weight_zero`` uint8 ``[E, N, K / G]`` (else the zero
    point is 8); uint8 E8M0 ``[E, N, K / 32]`` for MXFP4; float8_e4m3fn ``[E, N, K / 16]`` for NVFP4,
    with fp32 ``weight_global`` ``[E]``. An NVFP4 GEMM with ``input_global_scale`` also takes NVFP4
    rows (quantized before the dispatch with that static scale). ``out_dtype`` is the layer's float
    dtype (and the compute dtype of the 4-bit schemes). With ``output_quantizer`` (gate/up GEMM with a
    fused ``activation``) the activated rows come out quantized for the down GEMM: FP8 per 128-group in
    the epilogue when the tile is a multiple of 128 wide, else by the quantization kernel after the
    GEMM (from rows rounded to ``out_dtype``). ``configs`` is the table shared with the dispatch (for
    ``block_m``); the tiles are :func:`default_quant_config`'s unless ``use_table_tiles`` or the table
    was tuned for this weight format (``ConfigTable.weight_format``).
    """

    role: GemmRole
    weight_format: WeightFormat
    weight: TensorSource
    weight_scale: TensorSource
    configs: ConfigTable
    weight_zero: Optional[TensorSource] = None
    bias: Optional[TensorSource] = None
    activation: Optional[ActivationConfig] = None
    apply_routing_weights: bool = False
    out_dtype: DType = DType.BF16
    output_quantizer: Optional[Quantizer] = None
    use_table_tiles: bool = False
    weight_global: Optional[TensorSource] = None
    input_global_scale: Optional[float] = None
    weight_shuffled: bool = False
    # Fixed when built (shapes and settings do not change), not worked out again in every forward.
    _act: tuple[int, bool, bool, float, float] = attrs.field(init=False, repr=False)
    _fp8_epilogue: bool = attrs.field(init=False, repr=False)
    _sms: int = attrs.field(init=False, repr=False)
    # MXFP4: the largest E8M0 code of the weight's scales, taken again whenever they change (see scale_bound)
    _scale_bound: Optional[ScaleCodeBound] = attrs.field(init=False, repr=False)
    # The format's launch configurations by (aligned block_m, narrow decode tiles, without the fused gated activation),
    # made once for every block_m the table can align by: a forward creates no record (and torch.compile traces a
    # lookup, not a constructor).
    _planned: dict[tuple[int, bool, bool], GemmConfig] = attrs.field(init=False, repr=False)

    @classmethod
    def of(cls, role: GemmRole, weight_format: WeightFormat, projection: ProjectionWeights, configs: ConfigTable,
           **options: Any) -> FusedQuantGroupedGemm:
        """The GEMM of one projection of an :class:`~moeforge.expert_weights.ExpertWeights` record (its weight,
        scales, zero points, global scales, bias and layout); ``options``: the epilogue's and launch's fields."""
        if projection.scale is None:
            raise InputError(f"{weight_format.label} expert weights need their scales (the record names none)")
        return cls(role, weight_format, projection.weight, projection.scale, configs,
                   weight_zero=projection.zero_point, bias=projection.bias, weight_global=projection.global_scale,
                   weight_shuffled=projection.layout.shuffled, **options)

    def __attrs_post_init__(self) -> None:
        self._validate()
        kernel_ops()
        object.__setattr__(self, "_act", activation_args(self.activation))
        object.__setattr__(self, "_fp8_epilogue", not self.weight_format.packed and isinstance(
            self.output_quantizer, PerGroupQuantizer) and self.out_features % GROUP_SIZE == 0)
        object.__setattr__(self, "_scale_bound", ScaleCodeBound() if self.weight_format is WeightFormat.MXFP4 else None)
        weight = self._weight()
        object.__setattr__(self, "_sms", torch.cuda.get_device_properties(weight.device).multi_processor_count
                           if weight.is_cuda else 132)
        object.__setattr__(self, "_planned", {
            (block_m, narrow, unfused): self._rule_config(block_m, narrow, glu=False if unfused else None)
            for block_m in self.configs.block_ms() for narrow in (False, True) for unfused in (False, True)})

    # -- build-time checks ------------------------------------------------------------------------

    def _weight(self) -> torch.Tensor:
        weight = resolve(self.weight)
        return weight.flatten(2) if self.weight_format.packed and weight.dim() == 4 else weight

    def _validate(self) -> None:
        weight = self._weight()
        where = f"FusedQuantGroupedGemm({self.weight_format.label}, {self.role.value})"
        if self.out_dtype not in FLOAT_DTYPES:
            raise InputError(f"{where}: out_dtype must be bf16/fp16/fp32, got {self.out_dtype.value}")
        if (self.weight_global is None) == (self.weight_format is WeightFormat.NVFP4):
            raise InputError(f"{where}: NVFP4 weights need weight_global (their per-expert global scales)")
        if self.input_global_scale is not None and self.weight_format is not WeightFormat.NVFP4:
            raise InputError(f"{where}: input_global_scale is for NVFP4 rows")
        # The rows' dtype: 8-bit for W8A8, the scales' for W4A16 (a float dtype), else the layer's.
        scale_dtype = resolve(self.weight_scale).dtype
        storage = self.weight_format.storage_dtype
        if storage is None:
            raise InputError(f"{where}: float weights are FusedGroupedGemm's (this stage computes quantized formats)")
        rows = (storage if self.weight_format.eight_bit
                else scale_dtype if self.weight_format is WeightFormat.INT4 and scale_dtype in FLOAT_TORCH_DTYPES
                else self.out_dtype.torch_dtype)
        try:  # the kernel's own check of its weight operand
            weight_operand(self.weight_format, weight, resolve(self.weight_scale),
                           resolve(self.weight_zero) if self.weight_zero is not None else None,
                           resolve(self.weight_global) if self.weight_global is not None else None,
                           rows_dtype=rows)
        except ValueError as error:
            raise InputError(f"{where}: {error}") from None
        if self.weight_shuffled:
            paired = self.activation is not None and self.activation.gated and \
                self.activation.gate_up is GateUpLayout.INTERLEAVED
            try:
                if not self.weight_format.packed:
                    raise ValueError(f"the shuffled layout is for 4-bit weights, not {self.weight_format.label}")
                shuffle.check_shape(weight, paired=paired)
            except ValueError as error:
                raise InputError(f"{where}: {error}") from None
        experts, n_w = int(weight.shape[0]), int(weight.shape[1])
        if self.bias is not None and tuple(resolve(self.bias).shape) != (experts, n_w):
            raise InputError(f"{where}: bias must be [{experts}, {n_w}], got {tuple(resolve(self.bias).shape)}")
        if self.activation is not None and self.role is not GemmRole.GATE_UP:
            raise InputError(f"{where}: only the gate/up GEMM can fuse the activation")
        if self.activation is not None and self.activation.gated and n_w % 2:
            raise InputError(f"{where}: a gated activation needs an even gate/up width, got {n_w}")
        if self.output_quantizer is not None:
            if self.activation is None:
                raise InputError(f"{where}: output_quantizer quantizes the activated rows: it needs the "
                                 "fused activation")
            kernel_format(self.output_quantizer)
            problem = self.output_quantizer.check_width(self.out_features)
            if problem is not None:
                raise InputError(f"{where}: output_quantizer: {problem}")

    # -- contract -----------------------------------------------------------------------------------

    @property
    def in_features(self) -> int:
        k = int(self._weight().shape[2])
        return 2 * k if self.weight_format.packed else k

    @property
    def out_features(self) -> int:
        n_w = int(self._weight().shape[1])
        return n_w // 2 if self.activation is not None and self.activation.gated else n_w

    @property
    def kinds(self) -> tuple[StageKind, ...]:  # type: ignore[override]
        kinds = [StageKind.GEMM]
        if self.activation is not None:
            kinds.append(StageKind.ACTIVATION)
        if self.output_quantizer is not None:
            kinds.append(StageKind.QUANTIZE)
        return tuple(kinds)

    def _activation_dtypes(self) -> frozenset[DType]:
        if self.weight_format is WeightFormat.FP8:
            return frozenset({DType.FP8_E4M3})
        if self.weight_format is WeightFormat.INT8:
            return frozenset({DType.INT8})
        if self.weight_format is WeightFormat.INT4:
            return frozenset({DType.from_torch(resolve(self.weight_scale).dtype)})
        if self.input_global_scale is not None:
            return frozenset({self.out_dtype, DType.NVFP4})
        return frozenset({self.out_dtype})

    def summary(self) -> str:
        text = (f"FusedQuantGroupedGemm(triton, {self.weight_format.label}, {self.role.value}, "
                f"{self.in_features}->{int(self._weight().shape[1])}")
        if self.weight_format is WeightFormat.INT4:
            text += f", g{self.in_features // int(resolve(self.weight_scale).shape[2])}"
            text += ", zero points" if self.weight_zero is not None else ""
        elif not self.weight_format.packed:
            text += ", block scales" if resolve(self.weight_scale).dim() == 3 else ", channel scales"
        if self.input_global_scale is not None:
            text += f", nvfp4 rows (global {self.input_global_scale:g})"
        if self.activation is not None:
            text += f" + {self.activation.summary()}"
        if self.output_quantizer is not None:
            text += f" -> {self.output_quantizer.summary()}"
        if self.bias is not None:
            text += ", bias"
        if self.apply_routing_weights:
            text += ", weights in epilogue"
        if self.weight_shuffled:
            text += ", shuffled weight"
        return text + ")"

    def accepts(self) -> Accepts:
        return expert_gemm_accepts(self.role, dtypes=self._activation_dtypes(), scales=self.weight_format.input_scales,
                                   in_features=self.in_features, num_experts=int(self._weight().shape[0]),
                                   apply_routing_weights=self.apply_routing_weights, layouts=Layout.BLOCK_ALIGNED,
                                   alignment=self.configs.alignment(), slot_order=True)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            want = "/".join(sorted(d.value for d in self._activation_dtypes()))
            if self.weight_format.packed:
                return (f"the {self.weight_format.label} GEMM takes {want} rows (the layer's dtype"
                        + (", or NVFP4 rows quantized with its input global scale)" if self.input_global_scale
                           is not None else ")"))
            return (f"the {self.weight_format.label} GEMM takes {want} rows with "
                    f"{'/'.join(sorted(s.value for s in self.weight_format.input_scales))} scales: quantize them "
                    "before it (QuantizeAligned after the dispatch, or the gate/up GEMM's output_quantizer)")
        return None

    def output_spec(self, spec: Spec) -> Spec:
        out = expert_gemm_output_spec(spec, self.role, out_features=self.out_features,
                                      apply_routing_weights=self.apply_routing_weights, out_dtype=self.out_dtype)
        return self.output_quantizer.output_spec(out) if self.output_quantizer is not None else out

    # -- run ----------------------------------------------------------------------------------------

    def gemm_config(self, alignment: BlockAlignment, unfused: bool = False) -> GemmConfig:
        """The launch configuration for rows aligned by ``alignment`` (before the kernel's own fitting): the
        table's tiles where it was tuned for the format, else the format's rules on the table's block_m (a
        batch-invariant table's never split K). ``unfused``: the gate/up GEMM without its gated activation
        (:meth:`pre_activation`), one accumulator over the gate and up rows."""
        glu = self.role is GemmRole.GATE_UP and self.activation is not None and self.activation.gated
        if self.use_table_tiles or self.configs.weight_format is not None:
            if self.role is GemmRole.DOWN:
                return alignment.config.down
            return alignment.config.gate_up_apart(glu) if unfused else alignment.config.gate_up
        narrow = False
        if self.weight_format.packed and not self.weight_shuffled and alignment.block_m <= 16:
            busy = min(alignment.num_tokens * alignment.copies_per_row, self.configs.num_experts)
            narrow = busy * -(-self.out_features // 64) < 4 * self._sms  # programs of 64-column tiles vs 4 per SM
        unfused = unfused and glu
        planned = self._planned.get((alignment.block_m, narrow, unfused))
        return planned if planned is not None else self._rule_config(alignment.block_m, narrow,
                                                                     glu=False if unfused else None)

    def _rule_config(self, block_m: int, narrow: bool, glu: Optional[bool] = None) -> GemmConfig:
        """The format's configuration for ``block_m``-row blocks; ``narrow``: few experts busy at decode, where
        64-column tiles leave most SMs idle through a long, latency-bound dequantizing K-loop and narrow, deep
        tiles make 2x the programs with half the K-steps (docs/notes/kernels-log.md, "One grouped GEMM for every
        weight format"); ``glu``: two accumulators, gate and up (default: whether the stage fuses a gated
        activation)."""
        if glu is None:
            glu = self.role is GemmRole.GATE_UP and self.activation is not None and self.activation.gated
        if narrow and not self.configs.batch_invariant:
            config = GemmConfig(block_m, 32, 128, group_m=1, num_warps=4, num_stages=3)
        else:
            # wide_n: the epilogue itself quantizes to FP8 per 128-group (else a kernel runs after the GEMM).
            config = default_quant_config(self.weight_format, block_m, wide_n=self._fp8_epilogue, two_accumulators=glu,
                                          shuffled=self.weight_shuffled)
        return attrs.evolve(config, split_k=1) if self.configs.batch_invariant else config

    def __call__(self, x: AlignedRows) -> AlignedRows:
        return self.run(x)

    def run(self, x: AlignedRows, update: Optional[GemmUpdate] = None) -> AlignedRows:
        """The forward, with ``update`` (a low-rank update on float rows, an adapter's: :mod:`moeforge.adapters`)
        added to the product before the epilogue where given."""
        config = self.gemm_config(x.alignment)
        fp8_out = self._fp8_epilogue and config.block_n % GROUP_SIZE == 0
        rows = self._launch(x, config, self._act, fp8_out, update)
        if rows.x.scale is not None or self.output_quantizer is None:
            return rows
        return self._quantized(rows, activation_args(None))  # the epilogue activated them

    def pre_activation(self, x: AlignedRows) -> AlignedRows:
        """The GEMM with its bias (and the routing weights where its epilogue applies them) but without its
        activation or output quantization: ``[copies, N_w]`` rows in ``out_dtype``, one per copy; :meth:`activate`
        finishes the forward (an adapter, :mod:`moeforge.adapters`, adds its update in between)."""
        if self._act[0] != 0 and self.apply_routing_weights:
            raise ValueError(f"{self.summary()}: its epilogue applies the routing weights after the activation")
        return self._launch(x, self.gemm_config(x.alignment, unfused=True), activation_args(None), False)

    def activate(self, rows: AlignedRows) -> AlignedRows:
        """The activation of :meth:`pre_activation`'s rows as its own op (``moeforge::activate_rows``), or with the
        output quantizer the activation and the quantization in one kernel (``moeforge::quantize_rows``); the rows
        themselves where the stage has neither."""
        if self.output_quantizer is not None:
            return self._quantized(rows, self._act)
        if self._act[0] == 0:
            return rows
        return dataclasses.replace(rows, x=Activations(kernel_ops().activate_rows(rows.x.data, *self._act)))

    def _quantized(self, rows: AlignedRows, act_args: tuple[int, bool, bool, float, float]) -> AlignedRows:
        """``rows`` activated as ``act_args`` say and quantized by the output quantizer, in one kernel."""
        assert self.output_quantizer is not None
        dtype, per_group = kernel_format(self.output_quantizer)
        q, scale = kernel_ops().quantize_rows(rows.x.data, dtype, per_group, *act_args)
        return dataclasses.replace(rows, x=Activations(q, scale))

    def _launch(self, x: AlignedRows, config: GemmConfig, act_args: tuple[int, bool, bool, float, float],
                fp8_out: bool, update: Optional[GemmUpdate] = None) -> AlignedRows:
        alignment = x.alignment
        nvfp4_rows = x.x.data.dtype == torch.uint8
        weight_scale = resolve(self.weight_scale)
        scale_max = self._scale_bound.max_code(weight_scale) if self._scale_bound is not None else None
        rows_global = self.input_global_scale if nvfp4_rows and self.input_global_scale is not None else 1.0
        act, glu, interleaved, alpha, limit = act_args
        out, out_scale = grouped_gemm(
            GemmRows(x.x.data, x.x.scale, global_scale=rows_global,
                     rows_per_a=1 if x.copy_major else alignment.copies_per_row),
            GemmWeight(self._weight(), self.weight_format, weight_scale,
                       zero=resolve(self.weight_zero) if self.weight_zero is not None else None,
                       global_scale=resolve(self.weight_global) if self.weight_global is not None else None,
                       shuffled=self.weight_shuffled, scale_max=scale_max),
            alignment.route(),
            GemmEpilogue(self.out_dtype.torch_dtype, bias=resolve(self.bias) if self.bias is not None else None,
                         routing_weights=x.copy_weights if self.apply_routing_weights else None, act=act, glu=glu,
                         interleaved=interleaved, alpha=alpha, limit=limit, fp8_out=fp8_out),
            config, update,
        )
        return dataclasses.replace(x, x=Activations(out, out_scale), copy_major=True)  # keeps a subclass's fields


class _QuantizeAlignedBase:
    quantizer: Quantizer

    def _format(self) -> tuple[torch.dtype, bool]:
        return kernel_format(self.quantizer)

    def hint(self, field: str, have: object) -> Optional[str]:
        if field in ("dtype", "scale_layout"):
            return "these rows are already quantized: quantize once, from float rows"
        return None


@attrs.frozen(eq=False)
class QuantizeAligned(_QuantizeAlignedBase, Stage[AlignedRows, AlignedRows]):
    """Quantize block-aligned float rows by the kernel (``PerTokenQuantizer`` FP8/INT8 or
    ``PerGroupQuantizer``): after the dispatch it quantizes the ``T`` token rows the first GEMM
    gathers from (once per token, not once per copy)."""

    kinds: ClassVar = (StageKind.QUANTIZE,)
    quantizer: Quantizer

    def __attrs_post_init__(self) -> None:
        self._format()
        kernel_ops()

    def summary(self) -> str:
        return f"QuantizeAligned(triton, {self.quantizer.summary()})"

    def accepts(self) -> Accepts:
        # (per row: rows in slot order quantize alike, those past the last run to what no GEMM reads)
        return Accepts(kind={PayloadKind.DISPATCHED, PayloadKind.EXPERT_HIDDEN}, layout=Layout.BLOCK_ALIGNED,
                       dtype=FLOAT_DTYPES, scale_layout=ScaleLayout.NONE, slot_order={False, True})

    def check(self, spec: Spec) -> list[Mismatch]:
        found = super().check(spec)
        problem = self.quantizer.check_width(spec.width)
        if problem is not None:
            found.append(Mismatch("width", spec.width, "a multiple of 128", problem))
        return found

    def output_spec(self, spec: Spec) -> Spec:
        return self.quantizer.output_spec(spec)

    def __call__(self, x: AlignedRows) -> AlignedRows:
        dtype, per_group = self._format()
        q, scale = kernel_ops().quantize_rows(x.x.data, dtype, per_group, 0, False, False, 1.0, 0.0)
        return x.with_x(Activations(q, scale))


@attrs.frozen(eq=False)
class ActivateQuantizeAligned(_QuantizeAlignedBase, ActivateQuantize):
    """The activation fused with the quantization of its output, on the first GEMM's float rows
    (``2 * I`` wide for a gated activation): one pass, the activated rows never reach memory in a
    float dtype. The counterpart of the torch ``ActivateQuantize``; the activation is computed in
    fp32 by the kernels' formulas (as in the GEMM epilogue)."""

    _act: tuple[int, bool, bool, float, float] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._format()
        kernel_ops()
        object.__setattr__(self, "_act", activation_args(self.config))  # once, not per call

    def summary(self) -> str:
        return f"ActivateQuantizeAligned(triton, {self.config.summary()} -> {self.quantizer.summary()})"

    def accepts(self) -> Accepts:
        return attrs.evolve(super().accepts(), layout=Layout.BLOCK_ALIGNED, slot_order={False, True})  # per row

    def __call__(self, x: ExpertRows) -> ExpertRows:
        if not isinstance(x, AlignedRows):
            raise TypeError(f"ActivateQuantizeAligned cannot consume {type(x).__name__}")
        dtype, per_group = self._format()
        q, scale = kernel_ops().quantize_rows(x.x.data, dtype, per_group, *self._act)
        return x.with_x(Activations(q, scale))


@attrs.frozen(eq=False)
class TritonQuantizeTokens(QuantizeTokens):
    """:class:`~moeforge.stages.quantize.QuantizeTokens` computed by the quantization kernel (same
    results, bit for bit): quantize token-major activations before the dispatch on the GPU."""

    def __attrs_post_init__(self) -> None:
        kernel_format(self.quantizer)
        kernel_ops()

    @classmethod
    def supports(cls, quantizer: Quantizer) -> bool:
        """Whether the kernel computes ``quantizer`` (else keep the torch ``QuantizeTokens``)."""
        return kernel_supports(quantizer)

    def summary(self) -> str:
        return f"TritonQuantizeTokens({self.quantizer.summary()})"

    def __call__(self, x: RoutedTokens) -> RoutedTokens:
        dtype, per_group = kernel_format(self.quantizer)
        q, scale = kernel_ops().quantize_rows(x.x.data, dtype, per_group, 0, False, False, 1.0, 0.0)
        return x.with_x(Activations(q, scale))
