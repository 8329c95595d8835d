"""LanguageModelModule: next-token training of the model stack; what `nanotrain fit` trains.

Here: its options, the model it builds on the strategy's mesh (and pretrained weights), the
optimizer and LR schedule, FLOP accounting and sampling. Its forward, steps and loss
accounting are in `nanotrain.language_model_steps`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any

import torch

from nanotrain.data.model_checks import check_data_fits_model, data_eod_id
from nanotrain.interop import weights as model_io
from nanotrain.language_model_steps import LanguageModelSteps
from nanotrain.models.compile import (
    check_compile_options,
    compile_layers,
    compile_model,
    compile_options,
    uses_cuda_graphs,
)
from nanotrain.models.documents import DocumentMask, set_document_mask
from nanotrain.models.expert_compute import set_fp8_dispatch, set_fp8_expert_activations
from nanotrain.models.fp8_saves import check_flag, check_fp8_expert_activations
from nanotrain.models.recompute import check_full_layers, check_recompute
from nanotrain.models.transformer import set_recompute
from nanotrain.module import NanoModule
from nanotrain.parallel.schedules import V_SHAPED_SCHEDULES
from nanotrain.runtime.optim_kernels import adamw_kernel_kwargs


class LanguageModelModule(LanguageModelSteps, NanoModule):
    """Train a DeepSeek-V3-style or dense model (`nanotrain.models`) on token batches.

    Batches are dicts with "input_ids" and "labels" ([micro_batch, seq_len] int64, labels
    already shifted; -100 = ignore), as `nanotrain.data.TokenDataModule` produces.

    The objective is `lm_loss + aux_loss + mtp_loss_weight · mtp_loss`, each term a mean over
    its own count in the global batch (`loss_counts`): the LM loss over tokens with a label,
    the balance loss over sequences, each MTP depth over its own targets; so the gradient and
    every number logged are the same under any layout. Under the nanotrain Trainer the terms'
    global means are logged as `train/lm_loss`, `train/aux_loss`, `train/mtp_loss` (and
    `train/bpb`, the LM loss in bits per byte when the data knows its bytes per token) next to
    the Trainer's `train/loss` (the total objective). Validation logs `val/loss` (next-token
    cross-entropy, nats/token), `val/ppl` and `val/bpb` (bits per byte, comparable across
    tokenizers).

    Args:
        model: a preset name (`nanotrain.models.presets.names()`), a DeepSeekConfig /
            DenseConfig, or the path of a pretrained folder to start from (a transformers
            checkpoint folder, or what `nanotrain import` writes).
        model_overrides: config fields to change on the preset, e.g. {"num_layers": 4}.
        vocab_size: the model's vocabulary; None takes the datamodule's `vocab_size` (the
            preset's when there is no datamodule).
        lr, min_lr, warmup_steps, decay_steps: linear warmup to `lr`, then cosine decay to
            `min_lr` over `decay_steps` (None: the Trainer's max_steps; without one, constant).
        weight_decay, betas, eps: AdamW settings; weight decay applies to matrices only
            (not norms, biases or the router's correction bias).
        optimizer_impl: AdamW's kernel: "auto" (fused when all parameters are on CUDA, torch's
            default otherwise), "fused", "foreach" or "loop" (`nanotrain.runtime.optim_kernels`).
        recompute: activation recomputation per decoder layer: None, "light", "selective" or
            "full" (`nanotrain.models.recompute`, docs/performance.md).
        recompute_full_layers: the first N decoder layers of each pipeline chunk recompute
            "full", the others `recompute` (Megatron's block method; 0: none).
        fp8_expert_activations: keep what the routed experts save for backward of their
            rows and of their SwiGLU's inputs in fp8 with 1 x 128 tile scales, as
            DeepSeek-V3 does (`nanotrain.models.fp8_saves`): about half of a MoE layer's
            activations under recompute "light", with the loss unchanged and gradients that
            read the rounded values. Not with torch.compile.
        fp8_dispatch: send the routed copies to their experts in fp8 with 1 x 128 tile
            scales (DeepSeek-V3's dispatch: about half the bytes of bf16; the experts then
            compute on the rounded rows, under every layout); False leaves it to the
            precision ("fp8-emulated" dispatches in fp8).
        compile_layers: torch.compile each decoder layer (`nanotrain.models.compile`): True,
            or a dict of `torch.compile` arguments (e.g. ``{"backend": "aot_eager"}``).
        compile_model: torch.compile the whole model (embedding, layers, head and loss) as one
            graph instead, the faster choice when the model is not split into pipeline
            stages (pp=1); same values as `compile_layers`, and only one of the two.
            ``{"mode": "reduce-overhead"}`` also replays the graphs as CUDA graphs (one GPU,
            `SingleDeviceStrategy` or a one-rank `MegatronStrategy`; refused at fit start
            elsewhere, see `nanotrain.models.compile`).
        document_mask: attention stays inside each document of a packed window and rotary
            positions restart at each document, as Megatron's ``--reset-attention-mask
            --reset-position-ids`` (`nanotrain.models.documents`); boundaries are read from
            the end-of-document token in input_ids.
        eod_mask_loss: ignore labels that predict across a document boundary (the token
            after each end-of-document token; for MTP every target in a later document),
            as Megatron's ``--eod-mask-loss``. Independent of `document_mask`.
        eod_token_id: the end-of-document id; None takes the data's (its tokenizer's EOS).

    Raises:
        ValueError: for an invalid setting (at construction); at fit start, with
            `document_mask` or `eod_mask_loss`, when neither `eod_token_id` nor the data
            names an end-of-document id, or it lies outside the vocabulary.
    """

    def __init__(
        self,
        model: str | Any = "tiny",
        model_overrides: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        lr: float = 3e-3,
        min_lr: float = 3e-4,
        warmup_steps: int = 20,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        optimizer_impl: str = "auto",
        recompute: str | None = None,
        recompute_full_layers: int = 0,
        fp8_expert_activations: bool = False,
        fp8_dispatch: bool = False,
        compile_layers: bool | dict[str, Any] = False,
        compile_model: bool | dict[str, Any] = False,
        document_mask: bool = False,
        eod_mask_loss: bool = False,
        eod_token_id: int | None = None,
    ) -> None:
        super().__init__()
        adamw_kernel_kwargs(optimizer_impl, [])  # validate before any work
        check_recompute(recompute)
        check_full_layers(recompute_full_layers, recompute)
        check_compile_options(compile_layers, compile_model)
        check_fp8_expert_activations(fp8_expert_activations, compile_layers or compile_model)
        check_flag("fp8_dispatch", fp8_dispatch)
        check_flag("document_mask", document_mask)
        check_flag("eod_mask_loss", eod_mask_loss)
        if eod_token_id is not None:
            DocumentMask(eod_token_id)  # validates the id
        if lr <= 0 or min_lr < 0 or min_lr > lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={lr}, min_lr={min_lr}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.save_hyperparameters(ignore=["model"] if not isinstance(model, str) else None)
        self._model_spec = model
        self._pretrained: dict[str, Any] | None = None  # name -> LazyTensor
        self.config = self._resolve_config(vocab_size) if vocab_size is not None else None
        self.model: torch.nn.Module | None = None
        # the last optimizer step's routing statistics (a MoEStats; None for dense models)
        self.last_moe_stats: Any = None
        self._seq_len: int | None = None
        self._cuda_graphs = False
        self.documents: DocumentMask | None = None  # set in configure_model

    # -- model -------------------------------------------------------------------------------
    def _resolve_config(self, vocab_size: int | None, from_data: bool = False) -> Any:
        """The model config: preset, given config or pretrained folder, plus overrides. A
        vocabulary taken from the data yields to one set explicitly or by pretrained weights."""
        from nanotrain.models import presets

        overrides = dict(self.hparams.get("model_overrides") or {})
        spec = self._model_spec
        pretrained = isinstance(spec, str) and model_io.is_pretrained_folder(spec)
        explicit_vocab = "vocab_size" in overrides or pretrained
        if vocab_size is not None and not (from_data and explicit_vocab):
            overrides["vocab_size"] = vocab_size
        if pretrained:
            # nothing but headers yet: each rank reads its own slices in _load_pretrained
            config, self._pretrained = model_io.open_pretrained(spec)
            return dataclasses.replace(config, **overrides)
        if isinstance(spec, str):
            return presets.get(spec, **overrides)
        return dataclasses.replace(spec, **overrides)

    def _datamodule(self) -> Any:
        trainer = getattr(self, "_trainer", None)
        return getattr(trainer, "datamodule", None) if trainer is not None else None

    def configure_model(self) -> None:
        """Build this rank's share of the model (on the strategy's mesh) once."""
        if self.model is not None:
            return
        data = self._datamodule()
        data_vocab = getattr(data, "vocab_size", None)
        if self.config is None:
            self.config = self._resolve_config(data_vocab, from_data=True)
        if data_vocab is not None and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {data_vocab} token ids but the model's vocab_size is "
                f"{self.config.vocab_size}; set vocab_size >= {data_vocab} (or leave it unset "
                "to take the data's)"
            )
        self._seq_len = getattr(data, "seq_len", None)
        check_data_fits_model(data, self.config)
        from nanotrain.models import build_model

        # Megatron sequence parallelism is the strategy's choice (None outside nanotrain's Trainer)
        strategy = getattr(self._nano_trainer, "strategy", None)
        sequence_parallel = bool(getattr(strategy, "sequence_parallel", False))
        mesh = self.mesh
        pp_size = mesh.pp_size if mesh is not None else 1
        check_compile_options(
            self.hparams.get("compile_layers", False),
            self.hparams.get("compile_model", False),
            pp_size,
            getattr(strategy, "schedule", None),
        )
        self._cuda_graphs = uses_cuda_graphs(
            self.hparams.get("compile_layers", False), self.hparams.get("compile_model", False)
        )
        refusal = strategy.cuda_graphs_refusal() if self._cuda_graphs and strategy else None
        if refusal is not None:
            raise ValueError(refusal)
        seeded = getattr(self._nano_trainer, "model_init_rng", contextlib.nullcontext)
        with seeded():  # the same weights on every rank, your RNG stream untouched
            if pp_size > 1:
                from nanotrain.models.stages import build_pipeline_stage

                # only this rank's pipeline stage; the strategy runs the schedule over the stages
                self.model = build_pipeline_stage(
                    self.config,
                    mesh,
                    virtual_pp=getattr(strategy, "virtual_pp", 1),
                    layout=getattr(strategy, "pipeline_layout", None),
                    device="cpu",
                    sequence_parallel=sequence_parallel,
                    v_shape=getattr(strategy, "schedule", None) in V_SHAPED_SCHEDULES,
                    paired_chunks=getattr(strategy, "overlap_forward_backward", False),
                )
            else:
                self.model = build_model(
                    self.config, mesh=mesh, device="cpu", sequence_parallel=sequence_parallel
                )
        self._warn_replicated_experts(mesh, sequence_parallel)
        set_recompute(
            self.model, self.hparams.get("recompute"), self.hparams.get("recompute_full_layers", 0)
        )
        set_fp8_expert_activations(self.model, self.hparams.get("fp8_expert_activations", False))
        set_fp8_dispatch(self.model, self.hparams.get("fp8_dispatch", False))
        self.documents = self._document_mask(data)
        set_document_mask(self.model, self.documents)
        if self.hparams.get("compile_layers"):
            compile_layers(self.model, **compile_options(self.hparams["compile_layers"]))
        if self.hparams.get("compile_model"):
            compile_model(self.model, **compile_options(self.hparams["compile_model"]))
        if self._pretrained is not None:
            self._load_pretrained()

    def _document_mask(self, data: Any) -> DocumentMask | None:
        """The `DocumentMask` the options ask for (None without `document_mask` and
        `eod_mask_loss`), with the end-of-document id given or the data's."""
        hp = self.hparams
        attention, loss = bool(hp.get("document_mask")), bool(hp.get("eod_mask_loss"))
        if not (attention or loss):
            return None
        eod = hp.get("eod_token_id")
        if eod is None:
            eod = data_eod_id(data)
        if eod is None:
            raise ValueError(
                "document_mask / eod_mask_loss read document boundaries from the "
                "end-of-document token, but the data names none; set "
                "--model.init_args.eod_token_id (LanguageModelModule(eod_token_id=...))"
            )
        if eod >= self.config.vocab_size:
            raise ValueError(
                f"eod_token_id={eod} lies outside the model's vocabulary "
                f"[0, {self.config.vocab_size}); set the id your tokenizer appends after "
                "each document"
            )
        return DocumentMask(int(eod), mask_loss=loss, mask_attention=attention)

    def _warn_replicated_experts(self, mesh: Any, sequence_parallel: bool) -> None:
        """Warn (global rank 0) when the layout repeats the routed experts on every tp rank."""
        from nanotrain.models.build import replicated_expert_compute

        tp_size = mesh.tp_size if mesh is not None else 1
        message = replicated_expert_compute(self.config, tp_size, sequence_parallel)
        if message is not None and mesh.rank == 0:
            warnings.warn(message, stacklevel=2)

    def _load_pretrained(self) -> None:
        """Copy the pretrained folder's full tensors into the model just built: under a
        sharded layout (tp, ep, sequence parallel, pipeline stages) each rank takes only its
        own slice of the parameters it holds (`nanotrain.models.sharding`), and reads only
        that slice from the folder's files, one tensor at a time."""
        from nanotrain.models.sharding import load_full_state_dict

        load_full_state_dict(self.model, self._pretrained, strict=True)
        self._pretrained = None  # closes the files

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the model config so that `nanotrain export` can rebuild the model."""
        checkpoint["model_config"] = model_io.config_to_dict(self.config)

    # -- accounting --------------------------------------------------------------------------
    def flops_per_token(self) -> float | None:
        """Training FLOPs per token (6·active matmul params + attention), at the data's
        sequence length."""
        if self.config is None or self._seq_len is None:
            return None
        from nanotrain.models.accounting import flops_per_token

        return flops_per_token(self.config, self._seq_len)

    def active_parameter_count(self) -> int:
        """Parameters one token passes through (routed experts: only the top-k)."""
        from nanotrain.models.accounting import active_params

        return active_params(self.config, include_mtp=True)

    # -- optimization ------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (decay on matrices only) + warmup/cosine LR stepped every optimizer step."""
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        # named: LearningRateMonitor logs lr/decay and lr/no_decay
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]
        kernel = adamw_kernel_kwargs(hp.get("optimizer_impl", "auto"), decay + no_decay)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, **kernel)
        decay_steps = hp.decay_steps
        trainer = self._nano_trainer
        if decay_steps is None and trainer is not None:
            decay_steps = trainer.settings.max_steps
        schedule = warmup_cosine(hp.warmup_steps, decay_steps, hp.min_lr / hp.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    # -- generation --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend `input_ids` [B, T] by `max_new_tokens` tokens → [B, T + n].

        temperature 0 is greedy decoding; otherwise samples from softmax(logits / temperature).
        Recomputes the whole prefix each token (no KV cache): meant for short samples while
        training, not for serving.
        """
        if self.mesh is not None and self.mesh.pp_size > 1:
            raise NotImplementedError(
                "generate() runs the whole model in one process; under pipeline parallelism "
                "export the checkpoint and sample with a single-device strategy"
            )
        if getattr(self.mesh, "cp_size", 1) > 1:
            raise NotImplementedError(
                "generate() runs whole sequences; under context parallelism (cp > 1) each "
                "rank's model holds chunks of them: export the checkpoint and sample with a "
                "single-device strategy"
            )
        was_training = self.training
        self.eval()
        ids = input_ids
        window = getattr(self.config, "max_seq_len", None)
        for _ in range(max_new_tokens):
            context = ids if window is None else ids[:, -window:]
            logits = self.model(context).logits[:, -1, : self.config.vocab_size].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, next_id], dim=1)
        self.train(was_training)
        return ids


def warmup_cosine(warmup_steps: int, decay_steps: int | None, min_ratio: float):
    """LR multiplier for LambdaLR: linear warmup over `warmup_steps` (from 1/warmup), then
    cosine from 1 to `min_ratio` until `decay_steps`, `min_ratio` after; constant 1 after
    warmup when decay_steps is None."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay_steps is None:
            return 1.0
        span = max(1, decay_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier
