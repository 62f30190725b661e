"""``MoELayer``: a ``torch.nn.Module`` that owns the weights and runs a validated pipeline."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from moeforge.adapters import ExpertAdapter, adapt, create_adapter_weights
from moeforge.arguments import flag, instance_of, positive_int
from moeforge.backend import Backend, resolve_backend
from moeforge.decode_graphs import DecodeGraphs, DecodeGraphSettings
from moeforge.device_guard import on_device_of
from moeforge.dispatch_dtype import DispatchDecision, DispatchDtype, resolve_dispatch_dtype
from moeforge.distributed.exchange import ExchangeDispatch
from moeforge.distributed.group import ExpertParallel
from moeforge.errors import BackendUnavailableError, CheckpointNamesError, InputError
from moeforge.expert_naming import checkpoint_names
from moeforge.inputs import check_hidden_states, check_router_logits
from moeforge.payloads import ExpertRows, MoEInput, MoEOutput, RoutedTokens
from moeforge.presets import layer_arguments, settings
from moeforge.pipeline import Pipeline
from moeforge.quant.base import QuantMethod
from moeforge.quant.unquantized import UnquantizedMethod
from moeforge.replaced_stages import ReplacedStage, record
from moeforge.roles.base import Dispatcher, LayerConfig
from moeforge.selector import select
from moeforge.shared_experts import Linear, SharedExperts, SharedExpertsConfig
from moeforge.spec import DType, RoutingWeights, accumulation_dtype, input_spec
from moeforge.stage import Stage
from moeforge.stages.activation import ActivationConfig
from moeforge.stages.topk import RoutingConfig

DispatcherChoice = Union[str, Stage[RoutedTokens, ExpertRows], Dispatcher]


class MoELayer(nn.Module):
    """A Mixture-of-Experts layer whose forward is a validated :class:`~moeforge.Pipeline`.

    Args:
        num_experts, top_k, hidden_size, intermediate_size: the layer's sizes (``intermediate_size``
            is one expert's width I; gated activations use ``2 * I`` gate/up rows).
        routing: the routing math (:class:`~moeforge.RoutingConfig`), including where the routing
            weights are applied and the routed scaling factor.
        activation: the expert activation (:class:`~moeforge.ActivationConfig`).
        quant: the quant method that owns the expert weights (default: unquantized).
        dispatcher: ``"auto"`` (block-aligned on the triton backend, expert-sorted on torch),
            ``"sorted"`` (expert-sorted rows), ``"padded"`` (``[E, capacity, H]``), ``"aligned"``
            (triton only), ``"fused_ep"`` (the quant method's fused dispatch -> combine stage; a
            ``ContractError`` for a method that offers none), a dispatch stage instance, or an instance of a
            :class:`~moeforge.roles.Dispatcher` with settings of its own (its fields).
        dispatch_dtype: ``"auto"`` or a :class:`~moeforge.DispatchDtype` / name; resolved once by
            :func:`~moeforge.resolve_dispatch_dtype` (see ``describe()`` for the deciding rule).
        shared_experts: a :class:`~moeforge.SharedExpertsConfig`, or ``None``.
        expert_bias: whether the experts' two GEMMs have biases (GPT-OSS).
        router: whether the layer owns the router linear; without it, ``forward`` needs
            ``router_logits``: ``[T, E]`` for hidden states ``[T, H]``; ``[B, S, E]`` or ``[B * S, E]`` (a router
            applied to the flattened tokens) for ``[B, S, H]``; any other shape is an ``InputError``.
        backend: ``"auto"`` (triton on CUDA when Triton is installed, else torch), ``"torch"`` or
            ``"triton"``.
        dtype, device: of the parameters and of the activations the layer takes (bf16, fp16, fp32; float64
            on the torch backend with the unquantized method, for ``torch.autograd.gradcheck``); as in
            ``torch.nn``, ``dtype=None`` is ``torch.get_default_dtype()`` and ``device=None`` the CPU. The layer
            follows ``.to()``, ``.half()``, ``.cuda()``, ``.to_empty()`` like any module (quantized
            weights keep their format: see :meth:`QuantMethod.keeps_dtype`), and rebuilds its
            pipeline for the new dtype and device. A layer built on ``device="meta"`` holds no data: calling
            it is an :class:`~moeforge.InputError` until ``to_empty`` and loading have given it weights.
        expert_parallel: an :class:`~moeforge.distributed.ExpertParallel`: this rank holds only its
            experts' weights and the dispatcher exchanges rows with the other ranks (``dispatcher``
            ``"auto"`` / ``"all_to_all"``: :class:`~moeforge.distributed.AllToAllDispatch`; or a
            :class:`~moeforge.distributed.LowLatencyDispatch` instance). With the triton backend the
            all-to-all rows arrive block-aligned for the triton GEMMs; the low-latency dispatcher's
            padded rows run on the torch stages.
        debug: check every payload against its spec (values included) and reject non-finite hidden
            states, router logits and routing weights (these checks synchronise with the device).
        batch_invariant: each token's output bitwise independent of the rest of the batch and of its
            size (tiles picked by token count only among those that reduce in the same order, the router
            and shared experts through the same kernel; needs the triton backend). See
            :mod:`moeforge.batch_invariant`.
        environ: where the process default ``MOEFORGE_DISPATCH_DTYPE`` is read (default
            ``os.environ``; only read, never written).
        adapter: an :class:`~moeforge.adapters.ExpertAdapter`: a LoRA update of the experts' GEMMs, its matrices
            parameters of the layer (``w13_lora_a`` ...; ``B`` zero, so the output starts as without it). On float
            rows, on either backend; over a quantized base ``"auto"`` picks the torch stages, where the adapter
            trains. With ``count > 1`` a stack the tokens choose from (``forward(..., adapter_ids=...)``). See
            :mod:`moeforge.adapters`.
        decode_graphs: a :class:`~moeforge.decode_graphs.DecodeGraphSettings` to replay the experts' forward as a
            CUDA graph, captured once per batch size up to its ``max_tokens`` (eager calls at decode sizes, where
            launching the kernels costs more than running them; inference only: a call autograd records, a CPU
            layer, ``torch.compile`` and debug mode launch as without it; with ``expert_parallel``, where the
            dispatcher reads nothing on the host: ``SymmetricDispatch`` or ``LowLatencyDispatch`` with a bound no
            batch exceeds or ``overflow=DROP``). See :mod:`moeforge.decode_graphs`.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        routing: RoutingConfig = RoutingConfig(),
        activation: ActivationConfig = ActivationConfig(),
        quant: Optional[QuantMethod] = None,
        dispatcher: DispatcherChoice = "auto",
        dispatch_dtype: Union[DispatchDtype, str] = "auto",
        shared_experts: Optional[SharedExpertsConfig] = None,
        expert_bias: bool = False,
        router: bool = True,
        backend: Union[Backend, str] = "auto",
        dtype: Optional[torch.dtype] = None,
        device: Union[torch.device, str, None] = None,
        debug: bool = False,
        environ: Optional[Mapping[str, str]] = None,
        expert_parallel: Optional[ExpertParallel] = None,
        batch_invariant: bool = False,
        adapter: Optional[ExpertAdapter] = None,
        decode_graphs: Optional[DecodeGraphSettings] = None,
    ) -> None:
        super().__init__()
        if adapter is not None and not isinstance(adapter, ExpertAdapter):
            raise InputError(f"adapter must be an ExpertAdapter (e.g. ExpertAdapter(rank=16)) or None, got {adapter!r}")
        self.adapter = adapter
        if decode_graphs is not None and not isinstance(decode_graphs, DecodeGraphSettings):
            raise InputError(f"decode_graphs must be a DecodeGraphSettings or None, got {decode_graphs!r}")
        self.decode_graphs = DecodeGraphs(decode_graphs) if decode_graphs is not None else None
        if not isinstance(batch_invariant, bool):
            raise InputError(f"batch_invariant must be a bool, got {batch_invariant!r}")
        self.batch_invariant = batch_invariant
        for name, value in (("num_experts", num_experts), ("top_k", top_k),
                            ("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            positive_int(name, value)
        for name, setting in (("expert_bias", expert_bias), ("router", router), ("debug", debug)):
            flag(name, setting)
        instance_of("routing", routing, RoutingConfig, "RoutingConfig(scoring='sigmoid')")
        instance_of("activation", activation, ActivationConfig, "ActivationConfig('swiglu')")
        if quant is not None:
            instance_of("quant", quant, QuantMethod, "Fp8W8A8Method()")
        if shared_experts is not None and not isinstance(shared_experts, SharedExpertsConfig):
            # A bare width is the common slip: say it goes into the config.
            width = shared_experts if isinstance(shared_experts, int) and not isinstance(shared_experts, bool) else 1024
            example = f"SharedExpertsConfig({width})"
            raise InputError(f"shared_experts must be a SharedExpertsConfig (e.g. {example}) or None, got "
                             f"{type(shared_experts).__name__} {shared_experts!r}")
        if top_k > num_experts:
            raise InputError(f"top_k={top_k} exceeds num_experts={num_experts}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.activation = activation
        self.quant = quant if quant is not None else UnquantizedMethod()
        self.dispatcher = dispatcher
        self.dispatch_dtype_setting = dispatch_dtype
        self.backend_setting = backend
        self._check_compute_dtype(dtype, "dtype")
        self.debug = debug
        self._environ = environ
        # The compute dtype and device follow .to() / .half() / .cuda() / .to_empty() (see _apply);
        # what depends on them (backend, dispatch dtype, stages) is rebuilt when they change.
        self._dtype = dtype
        # As the tensors will report it ("cuda" becomes "cuda:0"), for the input device checks.
        self._device = torch.empty(0, device=device).device
        self.expert_parallel = expert_parallel
        if expert_parallel is not None and expert_parallel.num_experts != num_experts:
            raise InputError(f"expert_parallel.num_experts={expert_parallel.num_experts} differs from "
                             f"num_experts={num_experts}")
        self._backend_preference(self._device)  # an unknown or unusable backend fails here, before any weight
        device = self._device

        self.router: Optional[nn.Linear] = None
        if router:
            self.router = nn.Linear(hidden_size, num_experts, bias=routing.router_bias, dtype=dtype,
                                    device=device)
        if routing.selection_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.quant.create_weights(self, num_experts=self.local_experts, hidden_size=hidden_size,
                                  intermediate_size=intermediate_size, gated=activation.gated,
                                  bias=expert_bias, dtype=dtype, device=device)
        if adapter is not None:
            create_adapter_weights(self, adapter, num_experts=self.local_experts, hidden_size=hidden_size,
                                   intermediate_size=intermediate_size, gated=activation.gated, dtype=dtype,
                                   device=device)
        self.shared_experts: Optional[SharedExperts] = None
        if shared_experts is not None:
            self.shared_experts = SharedExperts(hidden_size, shared_experts, dtype=dtype, device=device)
        self.replaced_stages: list[ReplacedStage] = []
        self.dispatch_decision: DispatchDecision
        self.pipeline: Pipeline[MoEInput, MoEOutput]
        self.rebuild_pipeline()

    # -- building ---------------------------------------------------------------------------------

    def _check_compute_dtype(self, dtype: object, what: str) -> None:
        """The dtypes a layer computes in: bf16, fp16, fp32, and float64 where every stage computes it — the
        torch backend, with a method whose experts take float64 rows (the unquantized one)."""
        if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise InputError(f"{what} must be torch.bfloat16, torch.float16 or torch.float32 (the dtypes the "
                             f"layer computes in; torch.float64 on the torch backend), got {dtype}; weights in "
                             "an integer or fp8 format are a quant method's (e.g. quant=mf.Int8W8A8Method(), or "
                             "moeforge.quant.w8a8.quantize_layer(layer, mf.Int8W8A8Method()))")
        if dtype != torch.float64:
            return
        if DType.FP64 not in self.quant.accepts:
            raise InputError(f"{what} torch.float64 needs experts that compute in float64: {self.quant.name} "
                             "computes bf16, fp16 or fp32 (float64 layers use the unquantized method, on the torch "
                             "backend)")
        setting = self.backend_setting
        if setting is Backend.TRITON or (isinstance(setting, str) and setting.strip().lower() == "triton"):
            raise BackendUnavailableError(f"{what} torch.float64: the triton backend computes bf16, fp16 or fp32; "
                                          "a float64 layer runs on backend='torch' (or 'auto')")

    def _backend_preference(self, device: torch.device) -> Optional[Backend]:
        """The backend asked for (``None``: "auto"), checked against ``device``: an explicit one that cannot
        run there raises :class:`~moeforge.BackendUnavailableError` saying why."""
        setting = self.backend_setting
        auto = not isinstance(setting, Backend) and isinstance(setting, str) and setting.lower() == "auto"
        if self.batch_invariant:
            # Only the triton kernels fix their reduction order for every token count.
            if not auto and resolve_backend(setting, device) is not Backend.TRITON:
                raise InputError(f"batch_invariant=True needs the triton backend, got backend={setting!r}: the torch "
                                 "backend's matmuls pick their reduction by batch size")
            try:
                return resolve_backend(Backend.TRITON, device)
            except BackendUnavailableError as error:
                raise BackendUnavailableError(f"batch_invariant=True needs the triton backend: {error}") from error
        if self.adapter is not None and auto and self.quant.row_gradients:
            # A float adapter over a quantized base trains on the torch stages, whose GEMMs pass gradients to their
            # rows through the frozen weights; the quantized triton GEMMs have no backward (moeforge.adapters).
            return Backend.TORCH
        if auto:
            return None
        return resolve_backend(setting, device)

    def to(self, *args: Any, **kwargs: Any) -> MoELayer:
        """``nn.Module.to``; a dtype the layer cannot compute in (an integer dtype, fp8) is refused by
        :meth:`_apply` naming the float dtypes, before ``nn.Module.to`` would refuse an integer dtype with
        a ``TypeError`` that says neither."""
        dtype = torch._C._nn._parse_to(*args, **kwargs)[1]  # the parser of nn.Module.to: the same arguments
        if dtype is not None and not dtype.is_floating_point:
            self._check_compute_dtype(dtype, f"{type(self).__name__}'s new dtype")
        super().to(*args, **kwargs)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> MoELayer:
        """``nn.Module``'s conversion hook (``.to``, ``.half``, ``.cuda``, ``.to_empty``, ...): converts
        the tensors, keeping the dtype of those whose dtype is part of a quantized format (they only
        move), then follows the new compute dtype and device and rebuilds the pipeline."""
        # What fn does to a tensor in the compute dtype tells the new compute dtype and device; what
        # cannot follow them is refused before any tensor is converted.
        probe = fn(torch.empty(0, dtype=self._dtype, device=self._device))
        if probe.dtype != self._dtype:
            self._check_compute_dtype(probe.dtype, f"{type(self).__name__}'s new dtype")
        changed = (probe.dtype, probe.device) != (self._dtype, self._device)
        self._backend_preference(probe.device)
        keep = {id(tensor) for name, tensor in self.named_tensors_with_fixed_dtype()}

        def convert(tensor: torch.Tensor) -> torch.Tensor:
            converted: torch.Tensor = fn(tensor)
            if id(tensor) in keep and converted.dtype != tensor.dtype:
                return tensor.to(device=converted.device)
            return converted

        super()._apply(convert, recurse)  # type: ignore[no-untyped-call]
        if changed:
            self._dtype, self._device = probe.dtype, probe.device
            self.rebuild_pipeline()
        return self

    def named_tensors_with_fixed_dtype(self) -> list[tuple[str, torch.Tensor]]:
        """The layer's tensors that keep their dtype when the layer's dtype changes: the quant method's
        format tensors (e.g. FP8 weights and fp32 scales) and the fp32 selection bias."""
        names = [name for name in self.quant.expert_parameter_names(self) if self.quant.keeps_dtype(name)]
        if self.routing.selection_bias:
            names.append("e_score_correction_bias")  # routing runs in fp32
        return [(name, getattr(self, name)) for name in names]

    def rebuild_pipeline(self) -> None:
        """Resolve the dispatch dtype and build + validate the pipeline from the current settings.

        Stages swapped in with :meth:`replace_stage` are put back, in order, at the same place of the
        forward (what the replaced stage read and produced, and its kinds: the index or name may differ
        now) and validated again; one that no longer fits raises
        :class:`~moeforge.errors.ReplacedStageError` naming it."""
        self.dispatch_decision = resolve_dispatch_dtype(
            self.dispatch_dtype_setting,
            experts_accept=self.quant.accepts,
            activation_dtype=self.dtype,
            quant_requires=self.quant.required_dispatch_dtype(),
            quant_prefers=self.quant.prefers,
            device=self._device,
            environ=self._environ,
            experts_name=f"experts ({self.quant.name})",
            weights_on_input=self.routing.apply_weights is RoutingWeights.ON_INPUT,
        )
        config = LayerConfig(
            num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, routing=self.routing, activation=self.activation,
            quant=self.quant, dtype=self.dtype, device=self._device, dispatch=self.dispatch_decision,
            expert_parallel=self.expert_parallel, backend=self._backend_preference(self._device),
            dispatcher=self.dispatcher, batch_invariant=self.batch_invariant)
        self.selection = select(config)
        self.backend = self.selection.backend
        stages = self.selection.stages(self, config)
        if self.adapter is not None:
            stages = adapt(stages, self, self.adapter)
        spec = input_spec(self.hidden_size, self.dtype, self.num_experts)
        notes = [self.dispatch_decision.explain(), f"backend {self.backend.value}"]
        if self.adapter is not None:
            notes.append(self.adapter.summary())
        if self.expert_parallel is not None:
            notes.append(self.expert_parallel.summary())
        notes += self.selection.describe()
        # An adapter over a base whose GEMMs pass gradients to their rows trains (its base stays frozen).
        trains_adapter = self.adapter is not None and self.quant.row_gradients and self.backend is Backend.TORCH
        pipeline: Pipeline[MoEInput, MoEOutput] = Pipeline(stages, spec, debug=self.debug, notes=notes,
                                                           no_backward=None if trains_adapter
                                                           else self.quant.backward_problem())
        built_for = f"{self.quant.name}, backend {self.backend.value}, {DType.from_torch(self.dtype).value}"
        for replaced in self.replaced_stages:
            pipeline = replaced.put_back(pipeline, built_for)
        self.pipeline = pipeline
        if self.decode_graphs is not None:
            self.decode_graphs.clear()  # they replay the old pipeline's kernels

    @property
    def local_experts(self) -> int:
        """Experts whose weights this layer holds: all of them, or this rank's under expert parallelism."""
        return self.expert_parallel.local_experts if self.expert_parallel is not None else self.num_experts

    @property
    def expert_range(self) -> range:
        """The global ids of the experts this layer holds."""
        if self.expert_parallel is not None:
            return self.expert_parallel.expert_range
        return range(self.num_experts)

    @classmethod
    def from_preset(cls, family: str, **kwargs: Any) -> MoELayer:
        """A layer with a model family's exact semantics: ``MoELayer.from_preset("deepseek_v3",
        num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048, n_group=8,
        topk_group=4, ...)``. Family options and any ``MoELayer`` argument go in ``kwargs``; see
        :mod:`moeforge.families`."""
        return cls(**settings(family, kwargs, layer_arguments(cls)))

    def replace_stage(self, which: Union[int, str], stage: Stage[Any, Any]) -> None:
        """Swap one stage of this layer's pipeline (validated again) — e.g. a custom activation.

        The replacement is remembered (:attr:`replaced_stages`): :meth:`rebuild_pipeline` (and so
        :meth:`process_weights_after_loading`, a conversion, ``quantize_layer``) puts it back at the same
        place of the forward."""
        pipeline = self.pipeline.replace(which, stage)
        self.replaced_stages = record(self.pipeline, self.replaced_stages, which, stage)
        self.pipeline = pipeline

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, which takes the layer's own names (``layer.state_dict()``). With
        ``strict``, a state dict holding a Hugging Face checkpoint's names for an MoE block
        (``experts.0.w1.weight``, ``experts.gate_up_proj``, ``gate.weight``, ...) raises
        :class:`~moeforge.errors.CheckpointNamesError` before anything is copied, pointing to
        :func:`moeforge.checkpoint.load_weights`, which reads them; ``strict=False`` behaves as in torch."""
        if strict:
            own = self.state_dict().keys()
            names, prefix = checkpoint_names(key for key in state_dict if key not in own)
            if names:
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                raise CheckpointNamesError(
                    f"{type(self).__name__}.load_state_dict: '{names[0]}'{more} is a checkpoint's name for an MoE "
                    f"block's tensors, not one of this layer's ({', '.join(repr(key) for key in list(own)[:3])}, ...): "
                    f"read the checkpoint with moeforge.checkpoint.load_weights(layer, state_dict, prefix={prefix!r}), "
                    "which maps its names (and fuses per-expert tensors) to the layer's")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def process_weights_after_loading(self) -> None:
        """Let the quant method repack loaded weights, then rebuild the pipeline."""
        self.quant.process_weights_after_loading(self)
        self.rebuild_pipeline()

    def describe(self) -> str:
        """Every part of the layer: the router, the pipeline table (with the dispatch-dtype decision
        and the backend), and the shared experts."""
        if self.router is None:
            router = "router: none (forward() takes router_logits)"
        else:
            router = (f"router: Linear({self.hidden_size} -> {self.num_experts}"
                      f"{', bias' if self.router.bias is not None else ''}, "
                      f"logits in {DType.from_torch(self._router_dtype()).value})")
        lines = [router, self.pipeline.describe()]
        if self.shared_experts is not None:
            lines.append(f"shared experts: {self.shared_experts.summary()}, added to the output")
        return "\n".join(lines)

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype the layer computes in and takes its activations in."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    # -- running ----------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor] = None,
                adapter_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states [T, H]`` or ``[B, S, H]`` -> same shape. ``router_logits`` (``[T, E]`` or
        ``[B, S, E]``) are computed by the layer's router when not given. ``adapter_ids`` (``[T]`` or ``[B, S]``,
        int32 or int64): each token's adapter of a stack (``ExpertAdapter(count=...)``), ``-1`` for none; required
        with a stack, refused without one.

        Under ``torch.autocast`` for the layer's device type the layer computes in its own dtype, as
        autocast's float32 ops do: float hidden states are cast to it, autocast is off inside (so the
        router, the experts and the shared experts compute as they do without it, on every backend), and
        the output is in the layer's dtype. An fp32 layer between autocast layers (fp32 master weights)
        trains; a bf16 layer computes its experts in bf16. On a CUDA device other than the current one it runs with
        its device current (:mod:`moeforge.device_guard`)."""
        with on_device_of(hidden_states if isinstance(hidden_states, torch.Tensor) else None):
            if self._device.type in ("cpu", "cuda") and torch.is_autocast_enabled(self._device.type):
                if isinstance(hidden_states, torch.Tensor) and hidden_states.is_floating_point():
                    hidden_states = hidden_states.to(self._dtype)
                with torch.autocast(self._device.type, enabled=False):
                    return self._forward(hidden_states, router_logits, adapter_ids)
            return self._forward(hidden_states, router_logits, adapter_ids)

    def _forward(self, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor],
                 adapter_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        device = self._device
        check_hidden_states(hidden_states, self.hidden_size, self.dtype, device, self.debug)
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_logits is None:
            router_logits = self.router_logits(x)
        logits = check_router_logits(router_logits, hidden_states.shape, self.num_experts, device, self.debug)
        ids = self._adapter_ids(adapter_ids, hidden_states.shape)
        inputs = (x, logits) if ids is None else (x, logits, ids)
        out = None
        if self.decode_graphs is not None and not self.debug:
            out = self.decode_graphs.run(self._experts, inputs,
                                         itertools.chain(self.parameters(recurse=False), self.buffers(recurse=False)),
                                         owner=self.pipeline, refusal=self._replay_refusal)
        if out is None:
            out = self._experts(*inputs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, self._linear())
        return out.view(hidden_states.shape)

    def _replay_refusal(self) -> Optional[str]:
        """Why a decode graph would not replay what the last call did: an expert-parallel dispatcher's answer
        (:meth:`~moeforge.distributed.exchange.ExchangeDispatch.replay_refusal`), ``None`` on one process."""
        for stage in self.pipeline.stages:
            if isinstance(stage, ExchangeDispatch):
                return stage.replay_refusal(self._device)
        return None

    def _adapter_ids(self, adapter_ids: Optional[torch.Tensor], shape: torch.Size) -> Optional[torch.Tensor]:
        """The tokens' adapter ids, flat, checked: required with a stack of adapters, refused without one; their
        range where reading it costs no synchronisation (a CPU tensor, or debug mode) — elsewhere an id outside the
        stack gives its token NaN (``adapters.stack_ids``)."""
        stack = self.adapter.count if self.adapter is not None and self.adapter.stacked else 0
        if adapter_ids is None:
            if stack:
                raise InputError(f"this layer's adapter is a stack of {stack}: pass adapter_ids, each token's adapter "
                                 "(-1 for none)")
            return None
        if not stack:
            raise InputError("adapter_ids choose among a stack of adapters (ExpertAdapter(count=...)); this layer has "
                             + ("one adapter" if self.adapter is not None else "none"))
        if not isinstance(adapter_ids, torch.Tensor) or adapter_ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"adapter_ids must be an int32 or int64 tensor, got {adapter_ids!r}")
        if tuple(adapter_ids.shape) != tuple(shape[:-1]):
            raise InputError(f"adapter_ids must be {tuple(shape[:-1])} (one per token), got {tuple(adapter_ids.shape)}")
        if adapter_ids.device.type == "cpu" or self.debug:
            if adapter_ids.numel() and (int(adapter_ids.min()) < -1 or int(adapter_ids.max()) >= stack):
                raise InputError(f"adapter_ids must lie in [-1, {stack}) (-1: no adapter), got "
                                 f"[{int(adapter_ids.min())}, {int(adapter_ids.max())}]")
        return adapter_ids.reshape(-1).to(self._device)

    def _experts(self, x: torch.Tensor, logits: torch.Tensor, adapter_ids: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
        # The forward's checks cover what the pipeline would check of its input, with the layer's words.
        out: torch.Tensor = self.pipeline.run(MoEInput(x, logits, adapter_ids), input_checked=True).hidden_states
        return out

    def _linear(self) -> Linear:
        """How the router and the shared experts multiply: one fixed reduction order per row when the
        layer is batch-invariant."""
        if self.batch_invariant:
            from moeforge import batch_invariant

            return batch_invariant.linear
        return nn.functional.linear

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.router is None:
            raise InputError("this layer has no router (router=False): pass router_logits to forward()")
        weight: torch.Tensor = self.router.weight
        bias: Optional[torch.Tensor] = self.router.bias
        if self.routing.router_in_fp32:
            dtype = self._router_dtype()
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None
        elif not self.batch_invariant:
            logits: torch.Tensor = self.router(x)  # the module itself: its hooks (and wrappers) run
            return logits
        return self._linear()(x, weight, bias)

    def _router_dtype(self) -> torch.dtype:
        """The router's compute dtype: the layer's, or at least fp32 with ``router_in_fp32`` (a float64
        layer's router stays in float64)."""
        return accumulation_dtype(self.dtype) if self.routing.router_in_fp32 else self.dtype

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, quant={self.quant.name}, "
                f"{self.dispatch_decision.explain()}")
