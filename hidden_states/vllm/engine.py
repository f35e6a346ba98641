"""HiddenStatesEngine: the engine interface (hidden_states/interface.py) on vLLM's AsyncLLM.

Vectors are computed in the engine's dtype and returned as float32. A flagged request's rows
are captured on the device (capture.py), filed and put on its outputs by the scheduler
(scheduler.py), and taken off by the frontend (extraction.py); the final token's row comes from
the tail step, or else the extraction step (a prefill-only request, priority one ahead).
Ways in: `complete()`/`extract_layers()`, vLLM's OpenAI serving (openai.py, tagged through
`collecting()`), and beam search (`extraction.extract_beams`). A LoRA request's vectors are its
adapter's (the extraction step carries it, extraction.Origin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from hidden_states import steering
from hidden_states.heads import HeadConfigError, HeadSpec, load_heads
from hidden_states.interface import Completion, ExtractionStats, SamplingOptions, VectorObservers, finished_choice
from hidden_states.media import media_parts
from hidden_states.models.builtin import DEFAULT_MODEL, resolve_model
from hidden_states.params import (
    DEFAULT_MAX_HIDDEN_STATES_BYTES,
    HiddenStatesFields,
    HiddenStatesRequestError,
    UnknownModelError,
    absolute_layer,
    check_layers,
    check_model,
    resolve_heads,
    resolve_stop,
    spec_of,
)
from hidden_states.preflight import EngineStartupError, check_architecture, check_cpu_memory, check_model_folder
from hidden_states.protocol import with_capture_layers
from hidden_states.vllm import (
    VERIFIED_LAYER_ARCHS,
    WORKER_EXTENSION,
    VLLMIncompatibleError,
    check_vllm_version,
    verified_families,
)
from hidden_states.vllm.cpu import cpu_start_up, on_cpu
from hidden_states.vllm.engine_args import refuse, with_defaults
from hidden_states.vllm.frontend.extraction import Extraction, Origin, make_async_llm_class
from hidden_states.vllm.patches import install
from hidden_states.vllm.patches.mm_prefix_attention import image_span_refusal

logger = logging.getLogger(__name__)

EXTRACTION_PRIORITY = -1  # lower runs first under vLLM's priority policy; requests default to 0


def _preflight(model: str, engine_args: dict[str, Any]) -> str:
    """The model's local path, after the checks that give a start-up failure its real cause."""
    try:
        path = resolve_model(model)
    except Exception as e:
        raise EngineStartupError(f"the built-in model {model} could not be built: {e}") from e
    cfg = check_model_folder(path)
    if cfg is not None:
        from vllm.model_executor.models import ModelRegistry

        check_architecture(cfg, path, set(ModelRegistry.get_supported_archs()))
    if on_cpu():
        check_cpu_memory(path, engine_args.get("kv_cache_memory_bytes"))
    return path


def _execution_mode(cfg: Any) -> dict[str, Any]:
    """What decides how the runner hook runs (patch ledger): logged and in stats."""
    comp = cfg.compilation_config
    return {
        "enforce_eager": bool(cfg.model_config.enforce_eager),
        "async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "compilation_mode": str(getattr(comp, "mode", getattr(comp, "level", None))),
        "v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "1",
    }


def _static_layers(
    capture_layers: Sequence[int] | None, heads: Sequence[HeadSpec], vectors: dict, num_layers: int, compiled: bool
) -> list[int] | None:
    """The decoder layers the engine's forward captures and steers at, fixed at start (traced.py):
    `capture_layers` (in `hidden_states_layers` numbering; the last layer, L or -1, is always served)
    with the intermediate heads' and the registered steering vectors' layers added; None on an eager
    engine started without `capture_layers` (there the layer hooks serve every layer)."""
    if capture_layers is None and not compiled:
        return None
    layers = set()
    for l in capture_layers or ():
        absolute = absolute_layer(int(l), num_layers)
        if not 0 <= absolute <= num_layers:
            raise EngineStartupError(
                f"capture_layers: layer {l} out of range (0..{num_layers}, or -1..-{num_layers + 1})"
            )
        if absolute != num_layers:
            layers.add(absolute)
    layers |= {h.layer for h in heads if h.layer != num_layers}
    layers |= {l for by_layer in vectors.values() for l in by_layer}
    return sorted(layers)


def _sender(installed: list[dict]) -> dict | None:
    """The install result of the worker whose outputs reach the engine core (the last pipeline stage's)."""
    return next((w for w in installed if w.get("attaches")), installed[0] if installed else None)


def check_traced_stages(static: Sequence[int], installed: list[dict], num_layers: int) -> None:
    """The engine's static set (`capture_layers` with its heads' and vectors' layers) must each be traced by a
    worker: under pipeline parallelism by the stage that runs decoder layer L (traced.install), whose rows the
    last stage receives; a layer no stage traced stops the start, naming capture_layers and what is possible."""
    traced = {int(l) for w in installed for l in w.get("traced_layers") or ()}
    missing = [l for l in static if l not in traced]
    if missing:
        stages = sorted({tuple(w.get("stage_layers") or ()) for w in installed})
        runs = ", ".join(f"{a}..{b - 1}" for a, b in stages if b > a) or "none"
        raise EngineStartupError(
            f"capture_layers: layer(s) {missing} are traced by no pipeline stage (the stages run decoder layers "
            f"{runs} and trace {sorted(traced)}): capture_layers may name a layer L in 0..{num_layers - 1} whose "
            f"decoder layer a stage runs (it is traced there), or the last layer ({num_layers} or -1)"
        )


def _check_head_layers(specs: Sequence[HeadSpec], installed: list[dict], num_layers: int) -> None:
    """Heads at an intermediate layer need the decoder-layer hooks the workers installed."""
    for h in specs:
        if h.layer != num_layers and not all(w["layer_capture"] for w in installed):
            raise EngineStartupError(
                f"heads: head {h.name!r} reads layer {h.layer}, an intermediate layer, which this engine cannot "
                f"capture ({installed[0]['layer_capture_reason']}); serve it on an eager engine (enforce_eager: true)"
            )


class HiddenStatesEngine(VectorObservers):
    """A vLLM v1 engine that returns hidden states of finished completions.
    `await HiddenStatesEngine.start(model, **engine_args)` (vLLM's `AsyncEngineArgs`); `shutdown()`.
    """

    def __init__(
        self,
        llm: Any,
        enabled: bool,
        extraction_timeout_s: float = 60.0,
        *,
        tail_enabled: bool = False,
        max_hidden_states_bytes: int = DEFAULT_MAX_HIDDEN_STATES_BYTES,
    ):
        self.llm = llm
        self._enabled = enabled
        self.hidden_size = int(llm.vllm_config.model_config.get_hidden_size())
        self.max_model_len = int(llm.vllm_config.model_config.max_model_len)
        hf = llm.vllm_config.model_config.hf_config
        self.num_layers = int(llm.vllm_config.model_config.hf_text_config.num_hidden_layers)  # a VLM's text stack
        self.architecture = (getattr(hf, "architectures", None) or ["?"])[0]
        self.eager = bool(llm.vllm_config.model_config.enforce_eager)
        # Vectors off the outputs and the extraction step (extraction.py); vLLM's AsyncLLM reaches it too.
        self.extraction = llm.extraction = Extraction(
            llm,
            self.check_spec,
            self.check_layers,
            heads_of=self.heads_of,
            steering_of=self.steering_of,
            stop_of=self.stop_of,
            timeout_s=extraction_timeout_s,
            tail_enabled=tail_enabled,
            priority=EXTRACTION_PRIORITY if llm.vllm_config.scheduler_config.policy == "priority" else 0,
            max_hidden_states_bytes=max_hidden_states_bytes,
        )
        VectorObservers.__init__(self)
        self.layer_capture: dict[str, Any] | None = None  # set by start(): what the workers found at install
        self.startup: dict[str, Any] = {}  # set by start(): what the CPU start-up steps did
        self._workers: list[dict] = []  # the workers' stats when last asked, and the engine's counts then
        self._workers_mark: tuple[int, int] | None = None
        # LoRA adapters by name: vLLM's OpenAI serving registry (its --lora-modules), shared once openai() ran.
        self.served_model_name: str | None = None
        self.adapters: dict[str, Any] = {}
        self.heads: dict[str, HeadSpec] = {}  # registered heads (start(heads=...)), checked against the model
        self.steering_vectors: dict[str, dict[int, Any]] = {}  # registered (start(steering_vectors=...)): layer -> [D]

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def max_hidden_states_bytes(self) -> int:
        """A request's worst case of rows (params.check_rows_budget), as its extraction holds it."""
        return self.extraction.max_hidden_states_bytes

    @classmethod
    async def start(
        cls,
        model: str = DEFAULT_MODEL,
        *,
        enable_return_hidden_states: bool = True,
        extraction_timeout_s: float = 60.0,
        install_timeout_s: float = 120.0,
        prefault_kv_cache: bool = True,
        warm_up_s: float = 10.0,
        malloc_trim_interval_s: float = 5.0,
        tail_step: bool = True,
        ray_metrics: bool = False,
        max_hidden_states_bytes: int = DEFAULT_MAX_HIDDEN_STATES_BYTES,
        heads: Sequence[dict] = (),
        steering_vectors: Sequence[dict] = (),
        capture_layers: Sequence[int] | None = None,
        **engine_args: Any,
    ) -> HiddenStatesEngine:
        """`heads`: [{name, path, layer?, ...}] run on the device (hidden_states/heads.py), checked
        against the model before the engine starts. `capture_layers`: the intermediate layers a
        compiled engine serves and steers at, traced into its forward (worker/traced.py); on an eager
        engine, None serves every layer through hooks."""
        check_vllm_version(drift=True)
        if heads and not enable_return_hidden_states:
            raise EngineStartupError(
                "heads need enable_return_hidden_states: true (a request reads them as it reads hidden states)"
            )
        # Model Runner V1 in every process (ledger point 3); audio at any rate, by soxr in this process (17)
        install("frontend", "start")
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args = with_defaults(engine_args, enable_return_hidden_states, on_cpu())
        if enable_return_hidden_states:
            refuse(engine_args)  # engine arguments hidden states cannot serve, named (engine_args.py)
        engine_args["worker_extension_cls"] = WORKER_EXTENSION
        path = _preflight(model, engine_args)
        try:
            vllm_config = AsyncEngineArgs(model=path, **engine_args).create_engine_config()
            if on_cpu() and (why := image_span_refusal(vllm_config)):
                raise EngineStartupError(f"{model}: {why} (ledger point 18)")
            # tests only: vLLM's async path on CPU (ledger point 12); an image prefilled in one step (point 18)
            install("frontend", "config", vllm_config=vllm_config, model=model)
            tail = False
            mc = vllm_config.model_config
            try:
                head_specs = load_heads(heads, int(mc.hf_text_config.num_hidden_layers), int(mc.get_hidden_size()))
            except HeadConfigError as e:
                raise EngineStartupError(f"heads: {e}") from None
            try:
                vectors = steering.load_vectors(
                    steering_vectors, int(mc.hf_text_config.num_hidden_layers), int(mc.get_hidden_size())
                )
            except HeadConfigError as e:
                raise EngineStartupError(f"steering_vectors: {e}") from None
            static = None
            if enable_return_hidden_states:
                static = _static_layers(
                    capture_layers,
                    head_specs,
                    vectors,
                    int(mc.hf_text_config.num_hidden_layers),
                    compiled=not mc.enforce_eager,
                )
                if static:  # read by every worker at load, before the forward compiles (ledger point 16)
                    with_capture_layers(vllm_config, static)
                refuse(engine_args, vllm_config)  # and however the resolved configuration came to them
                tail = tail_step  # synchronous: the held tail step; async: the step in flight (scheduler.py)
                # the engine core's scheduler class, from the resolved configuration (ledger point 9)
                install("frontend", "scheduler", vllm_config=vllm_config, tail_step=tail_step)
            loggers = None
            if ray_metrics:  # vLLM's engine metrics through Ray's Prometheus endpoint, tagged ReplicaId
                from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

                loggers = [RayPrometheusStatLogger]
            llm = make_async_llm_class().from_vllm_config(vllm_config, stat_loggers=loggers)
        except EngineStartupError:
            raise
        except VLLMIncompatibleError as e:
            raise EngineStartupError(str(e)) from e
        except Exception as e:
            raise EngineStartupError(
                f"the vLLM engine for {model} failed to start ({type(e).__name__}: {e}); vLLM logs the root cause "
                "from its engine-core process just above this error in the replica's log"
            ) from e
        installed = []
        try:
            startup = (
                await cpu_start_up(llm, prefault_kv_cache, warm_up_s, malloc_trim_interval_s, install_timeout_s)
                if on_cpu()
                else {}
            )
            if enable_return_hidden_states:
                installed = await llm.collective_rpc(
                    "hidden_states_install",
                    timeout=install_timeout_s,
                    args=([msgspec.to_builtins(h.for_workers()) for h in head_specs],),
                )
                if static and not all(w["layer_capture"] for w in installed):
                    raise EngineStartupError(
                        f"capture_layers: {installed[0]['architecture']} has no traced layer capture "
                        f"({installed[0]['layer_capture_reason']}); it works on {verified_families()}"
                    )
                if static:
                    check_traced_stages(
                        static, installed, int(vllm_config.model_config.hf_text_config.num_hidden_layers)
                    )
                _check_head_layers(
                    head_specs, installed, int(vllm_config.model_config.hf_text_config.num_hidden_layers)
                )
                logger.info(
                    "hidden-states hook installed on %d worker(s); intermediate layers: %s",
                    len(installed),
                    installed[0]["layer_capture_reason"] or "yes",
                )
        except BaseException:
            llm.shutdown()
            raise
        engine = cls(
            llm,
            enable_return_hidden_states,
            extraction_timeout_s,
            tail_enabled=tail,
            max_hidden_states_bytes=max_hidden_states_bytes,
        )
        engine.heads = {h.name: h for h in head_specs}
        engine.steering_vectors = vectors
        engine.startup = {**startup, **_execution_mode(llm.vllm_config)}
        logger.info("engine execution mode: %s", _execution_mode(llm.vllm_config))
        # What the workers found at install (worker.layer_capture_support); check_layers reads it.
        engine.layer_capture = (
            {**_sender(installed), "layer_capture": all(w["layer_capture"] for w in installed)} if installed else None
        )
        return engine

    def check_spec(self, spec: HiddenStatesFields) -> tuple[int, ...]:
        """A parsed spec against this model (params.check_model, then the layers this engine can
        capture): the layers captured, or HiddenStatesRequestError with the fix."""
        check_model(spec, self.num_layers, self.hidden_size)
        return self.check_layers(spec.capture()[0])

    def heads_of(self, spec: HiddenStatesFields) -> tuple[tuple[str, int], ...]:
        """The spec's heads against this engine's registered ones: (name, k), or a 400 naming the head."""
        return resolve_heads(spec, self.heads) if spec.heads else ()

    def stop_of(self, spec: HiddenStatesFields) -> tuple[list, list]:
        """The spec's stop conditions against this engine's registered heads (params.resolve_stop):
        (monitors, echo), or a 400 naming the condition. A head's layer is served by construction (the
        start checks every registered head's layer)."""
        return resolve_stop(spec, self.heads) if spec.hidden_states_stop else ([], [])

    def steering_of(self, spec: HiddenStatesFields) -> tuple[list, list]:
        """The spec's steering resolved against this model (hidden_states/steering.py): (entries, echo),
        or a 400 naming the entry; steering needs the decoder-layer hooks."""
        if not spec.hidden_states_steering:
            return [], []
        found = self.layer_capture
        if not (found and found["layer_capture"]):
            why = found["layer_capture_reason"] if found else "no hooks installed"
            raise HiddenStatesRequestError(
                f"steering needs the decoder-layer hooks, which this engine lacks ({why})", "hidden_states_steering"
            )
        entries, echo = steering.resolve(spec, self.num_layers, self.hidden_size, self.steering_vectors, self.heads)
        if any(e.when is not None for e in entries) and (cfg := self.llm.vllm_config).scheduler_config.async_scheduling:
            # Async: the worker decides the position after the step in flight from its own verdict of that step's
            # row (PlanEntry.steer_if). Every rank must apply the same steering, and only the rank that sends
            # scores the rows; a draft's row before is in its own step.
            why = (
                "tensor or pipeline parallelism"
                if cfg.parallel_config.world_size > 1
                else "speculative decoding"
                if cfg.speculative_config is not None
                else None
            )
            if why is not None:
                raise HiddenStatesRequestError(
                    f"hidden_states_steering: `when` under async scheduling needs an engine without {why} "
                    "(or async_scheduling: false): the position after the step in flight is decided by the worker "
                    "that scored that step's row",
                    "hidden_states_steering",
                )
        static = found.get("capture_layers")
        if static is not None:  # the traced entries (worker/traced.py): the static set, one ablation per row
            for e in entries:
                if e.layer not in static:
                    raise HiddenStatesRequestError(
                        f"hidden_states_steering: layer {e.layer} is outside this engine's capture_layers {static}: "
                        "a compiled engine steers at the layers it was started with",
                        "hidden_states_steering",
                    )
            ablations: dict[int, list[str]] = {}
            for e in entries:
                if e.op in ("ablate", "clamp", "cap"):
                    seen = ablations.setdefault(e.layer, [])
                    if any("all" in (p, e.positions) or p == e.positions for p in seen):
                        raise HiddenStatesRequestError(
                            f"hidden_states_steering: two ablations/clamps/caps of the same positions at layer "
                            f"{e.layer}: a compiled engine applies one of them per position and layer (adds before "
                            "and after it are fine)",
                            "hidden_states_steering",
                        )
                    seen.append(e.positions)
        return entries, echo

    def check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """The layers, deduplicated, if this model has them and this engine can capture them."""
        layers = check_layers(layers, self.num_layers)
        L = self.num_layers
        if any(absolute_layer(l, L) != L for l in layers):
            # The workers' install result; without one (no engine), the checked architectures.
            found = self.layer_capture
            verified = found["layer_capture_verified"] if found else self.architecture in VERIFIED_LAYER_ARCHS
            if not (verified and (found["layer_structure"] if found else True)):
                why = "" if not verified else f" ({found['layer_capture_reason']})"
                raise HiddenStatesRequestError(
                    "hidden_states_layers: intermediate layers are served on the architectures verified against "
                    f"transformers ({verified_families()}); not on {self.architecture}{why}; ask for the last "
                    "layer (-1) only",
                    "hidden_states_layers",
                )
            static = found.get("capture_layers") if found else None
            if static is not None:
                outside = [l for l in layers if absolute_layer(l, L) not in (*static, L)]
                if outside:
                    raise HiddenStatesRequestError(
                        f"hidden_states_layers {outside} are outside this engine's capture_layers {static} (and "
                        f"the last layer, {L} or -1): a compiled engine captures the layers it was started with",
                        "hidden_states_layers",
                    )
                return layers
            if not self.eager:
                raise HiddenStatesRequestError(
                    "intermediate hidden_states_layers on a compiled engine need capture_layers at start (the "
                    "layers its compiled forward captures), or an eager engine (enforce_eager=True)",
                    "hidden_states_layers",
                )
            if found and not found["layer_capture"]:
                raise HiddenStatesRequestError(
                    f"intermediate hidden_states_layers are unavailable on this engine: "
                    f"{found['layer_capture_reason'] or 'not every worker hooked its decoder layers'}",
                    "hidden_states_layers",
                )
        return layers

    async def complete(
        self,
        prompt: str | Sequence[int] | dict,
        sampling: SamplingOptions | Any = None,
        *,
        return_hidden_states: bool = True,
        layers: Sequence[int] = (-1,),
        position: Any = "completion_end",
        model: str | None = None,
        dtype: str = "float32",
        topk: int | None = None,
        proof: Any = None,
        spec: HiddenStatesFields | None = None,
        heads: Sequence[Any] | None = None,
        steering: Sequence[dict] | None = None,
        stop_conditions: Sequence[dict] | None = None,
    ) -> Completion:
        """One prompt (text, token ids, or an engine input such as `chat_input`'s) to a finished Completion
        with a vector per choice. `sampling`:
        SamplingOptions or vLLM's SamplingParams; `model`: a LoRA adapter; `position`, `dtype`, `topk`,
        `proof`: as the API's fields (rows in the dtype asked: float16 as float16, bfloat16 widened exactly
        to float32; interface.CompletionChoice); `spec`: a parsed spec in place of those keywords."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if sampling is None or isinstance(sampling, SamplingOptions):
            o = sampling or SamplingOptions()
            params = SamplingParams(
                n=o.n,
                max_tokens=o.max_tokens,
                temperature=o.temperature,
                top_p=o.top_p,
                seed=o.seed,
                stop=list(o.stop) or None,
            )
        else:
            params = sampling.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        lora = self.lora_request(model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if isinstance(prompt, str):
            prompt = self.llm.tokenizer.encode(prompt)
        engine_prompt = prompt if isinstance(prompt, dict) else {"prompt_token_ids": list(prompt)}
        final, choices = None, []
        if spec is None:
            spec = spec_of(
                return_hidden_states,
                layers,
                position,
                dtype,
                topk,
                proof,
                heads,
                steering,
                stop_conditions,
                enabled=self.enabled,
            )
        with self.collecting(spec) if spec.wants else contextlib.nullcontext() as collector:
            if collector is not None:
                params.extra_args = collector.tagged(params.extra_args)
            async for out in self.llm.generate(engine_prompt, params, request_id, lora_request=lora):
                final = out
        for o in final.outputs:
            choices.append(finished_choice(self, collector, o.index, o.text, o.token_ids, o.finish_reason))
        return Completion(request_id=request_id, prompt_token_ids=tuple(final.prompt_token_ids), choices=tuple(choices))

    def collecting(self, spec: HiddenStatesFields):
        """A collector for one request's rows (context manager): tag its sampling params with
        `collector.tagged` (SamplingParams.extra_args, or an OpenAI request's `vllm_xargs`)."""
        return self.extraction.collecting(spec)

    async def extract_layers(
        self, token_ids: Sequence[int], layers: Sequence[int] = (-1,), origin: Origin = Origin()
    ) -> tuple[dict[int, Any], ExtractionStats]:
        """The final token's hidden state of `token_ids` at each of `layers` (the extraction step)."""
        return await self.extraction.extract_layers(token_ids, layers, origin)

    async def extract_one(self, token_ids: Sequence[int], origin: Origin = Origin()) -> tuple[Any, ExtractionStats]:
        """The last-layer hidden state of the final token of `token_ids` (float32 [D])."""
        return await self.extraction.extract_one(token_ids, origin)

    def missing(self, what: str) -> Exception:
        """Counts a choice that finished without its vector; the error to fail its request with."""
        return self.extraction.missing(what)

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` with the chat template and generation prompt, as vLLM's chat route
        renders them (a 400 naming `messages` if it cannot)."""
        try:
            return list(
                self.llm.tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        except Exception as e:  # a template that cannot render these messages
            raise HiddenStatesRequestError(f"the chat template cannot render these messages: {e}", "messages") from e

    async def chat_input(self, messages: Sequence[dict]) -> dict:
        """The engine input of chat `messages`: their token ids (`chat_prompt`) or, with image or audio
        parts, vLLM's processed multimodal input, rendered by vLLM's renderer as its chat route renders
        it (a 400 naming `messages` if it cannot)."""
        if next(media_parts({"messages": list(messages)}), None) is None:
            return {"prompt_token_ids": self.chat_prompt(messages)}
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            req = ChatCompletionRequest(model=self.served_model_name or "", messages=list(messages))
            _, (prompt,) = await self.llm.renderer.render_chat_async(
                [req.messages], req.build_chat_params(None, "auto")
            )
        except Exception as e:  # unreadable media, too many items, a template that cannot render them
            raise HiddenStatesRequestError(f"the messages cannot be rendered: {e}", "messages") from e
        return prompt

    def lora_request(self, model: str | None) -> Any:
        """The LoRA adapter a request names by `model`, as vLLM's serving resolves it (None: the base model)."""
        if model is None or model == self.served_model_name:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise UnknownModelError(model, [self.served_model_name or "(the base model: model=None)", *self.adapters])

    # -- operations -----------------------------------------------------------

    async def openai(self, served_model_name: str, replica_id: str, lora_modules: Sequence[dict] = ()):
        """vLLM's own OpenAI serving over this engine, plus the vectors (openai.py); it loads
        `lora_modules` ([{name, path}]) and from then on names this engine's adapters."""
        from hidden_states.vllm.frontend.openai import OpenAIFrontend

        return await OpenAIFrontend.create(self, served_model_name, replica_id, lora_modules)

    def healthy(self) -> bool:
        return not self.llm.errored

    async def stats(self, fresh_workers: bool = True) -> dict:
        """The engine's counters and its workers' (`workers`).

        `fresh_workers=False` asks the workers only if a flagged request came since last asked: asking
        wakes them into up to a second of busy-waiting (vLLM's SpinCondition).
        """
        if not self.enabled:
            workers = []
        else:
            mark = (self.extraction.vector_requests, self.extraction.pending())
            if fresh_workers or mark != self._workers_mark or mark[1] > 0:
                self._workers = await self.llm.collective_rpc("hidden_states_stats", timeout=30)
                self._workers_mark = mark
            workers = self._workers
        return {
            "enabled": self.enabled,
            **self.extraction.counts(),
            "unfinished_requests": self.llm.output_processor.get_num_unfinished_requests(),
            "workers": workers,
            "startup": self.startup,
        }

    def shutdown(self) -> None:
        """Stop the engine, its output handler first (else vLLM logs the core's death as a traceback on
        every clean run). Callable from any thread, more than once."""
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None and not handler.done():
            loop = handler.get_loop()
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop or not loop.is_running():
                handler.cancel()  # delivered before the handler reads anything more from the core
            else:

                async def cancel():
                    handler.cancel()
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(handler, 5)

                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(cancel(), loop).result(10)
        self.llm.shutdown()
