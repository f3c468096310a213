"""Configuration: the block-diffusion training semantics (docs/design.md sections 2-4) and the job config of a run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import ClassVar

from bdcore.decode.config import DecodeConfig
from bdcore.sidecar import CANVAS_FILLS, Sidecar

LOSS_WEIGHTINGS = ("uniform", "inverse_rate")
# What a drafting slot learns from: the data's token (ce), the verifier's distribution at the clean-stream row
# that predicts the same token (kl: KL(verifier || drafter), the row self-spec verifies against), or both (mix).
DRAFT_LOSSES = ("ce", "kl", "mix")
# two_stream: clean stream + noised views, shifted targets, an AR head (docs/design.md section 2);
# single_stream: one stream masked in place, unshifted targets, no AR head (train/single_stream.py).
OBJECTIVES = ("two_stream", "single_stream")
# What a run trains (train/recipes.py): block-diffusion SFT, plain AR SFT, on-policy distillation, RL.
RECIPES = ("sft", "ar_sft", "opd", "rl")


class FlagError(ValueError):
    """A run that cannot start or go on because of what a command-line flag names.

    Library code raises it; `train.py` prints it as one line (`train.py: error: <flag>: <problem and fix>`).
    """

    def __init__(self, flag: str, problem: str):
        super().__init__(f"{flag}: {problem}")
        self.flag = flag


@dataclass(frozen=True)
class BlockDiffusionConfig:
    """What a training row means. Everything that builds rows, masks or losses reads this.

    `clean_causal=None` resolves to `ar_loss_weight > 0`: the clean stream keeps the AR model's
    causal attention exactly when something (the AR loss) trains it as an AR model.
    `views=0` is plain AR SFT (the `--recipe ar_sft` baseline): clean stream only, AR loss only.
    `objective="single_stream"` masks the one stream in place (`views` is 1, no AR loss, block-causal).
    """

    bd_size: int = 32
    views: int = 2
    ar_loss_weight: float = 0.2
    clean_causal: bool | None = None
    within_block_causal: bool = False
    loss_weighting: str = "uniform"
    prefix_gamma: float = 0.0
    draft_loss: str = "ce"
    draft_kl_mix: float = 0.5  # draft_loss mix: kl_mix * KL + (1 - kl_mix) * CE
    draft_temperature: float = 1.0  # both distributions at this temperature (KL scaled by its square)
    # weight each drafting slot by the drafter's own probability that the slots before it in its block are
    # accepted (detached): the first slot a draft is likely to fail at weighs most, the slots past it little
    chain_weights: bool = False
    min_rate: float = 1e-3
    objective: str = "two_stream"
    # "noise": every noised slot holds a uniform random id (no <|mask|>, no partial reveal), the draft layout of
    # SGLang's UNO; drafts for self-spec only, since nothing marks a slot as undecided for diffusion mode
    canvas_fill: str = "mask"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}: choose one of {OBJECTIVES}")
        if self.single_stream and (self.views != 1 or self.ar_loss_weight or self.within_block_causal):
            raise ValueError(
                "objective=single_stream has one stream (views=1), no AR loss (ar_loss_weight=0) and bidirectional "
                "blocks (within_block_causal=False)"
            )
        if self.bd_size < 2:
            raise ValueError(
                f"bd_size={self.bd_size}: a block needs a seed and at least one token to denoise; use >= 2"
            )
        if self.views < 0:
            raise ValueError(f"views={self.views}: use 2 (complementary masks), 1, or 0 for plain AR SFT")
        if self.views == 0 and self.ar_loss_weight <= 0:
            raise ValueError("views=0 (plain AR SFT) trains only the AR loss: set ar_loss_weight > 0")
        if self.ar_loss_weight < 0:
            raise ValueError(f"ar_loss_weight={self.ar_loss_weight} must be >= 0")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={self.loss_weighting!r}: choose one of {LOSS_WEIGHTINGS}")
        if self.prefix_gamma < 0:
            raise ValueError(f"prefix_gamma={self.prefix_gamma} must be >= 0 (0: every draft position weighs the same)")
        if self.draft_loss not in DRAFT_LOSSES:
            raise ValueError(f"draft_loss={self.draft_loss!r}: choose one of {DRAFT_LOSSES}")
        if not 0.0 <= self.draft_kl_mix <= 1.0 or not self.draft_temperature > 0:
            raise ValueError("draft_kl_mix must lie in [0, 1] and draft_temperature be > 0")
        if self.draft_loss != "ce" and (self.single_stream or self.views == 0):
            raise ValueError(
                f"draft_loss={self.draft_loss} distils from the clean stream's rows, which only the two-stream "
                "objective with noised views has: use draft_loss=ce"
            )
        if self.canvas_fill not in CANVAS_FILLS:
            raise ValueError(f"canvas_fill={self.canvas_fill!r}: choose one of {CANVAS_FILLS}")
        if self.canvas_fill == "noise" and (self.single_stream or self.views != 1):
            raise ValueError(
                "canvas_fill=noise noises every slot of a block, so its views would all be alike: use one view "
                "(views=1) of the two-stream objective"
            )
        if not 0.0 < self.min_rate < 1.0:
            raise ValueError(f"min_rate={self.min_rate} must lie in (0, 1)")
        if self.clean_causal is None:
            object.__setattr__(self, "clean_causal", self.ar_loss_weight > 0)
        if self.draft_loss != "ce" and not self.clean_causal:
            raise ValueError(
                f"draft_loss={self.draft_loss} takes its teacher from the clean stream's AR rows, which are an AR "
                "model only when the clean stream is causal: give ar_loss_weight > 0 or a draft adapter"
            )
        if self.ar_loss_weight > 0 and not self.clean_causal:
            raise ValueError(
                "ar_loss_weight > 0 needs clean_causal=True: the AR loss trains the clean stream as a causal LM"
            )

    @property
    def ar_only(self) -> bool:
        return self.views == 0

    @property
    def single_stream(self) -> bool:
        return self.objective == "single_stream"

    def sidecar(self, mask_id: int, *, draft_adapter: str | None = None) -> Sidecar:
        """The block_diffusion.json of a checkpoint of these rows, less the run's record (base model, step):
        what the checkpoint writes, and what the student decodes as before it is written (train/rollout.py)."""
        return Sidecar(
            bd_size=self.bd_size,
            mask_id=mask_id,
            ar_loss_weight=self.ar_loss_weight,
            shift=not self.single_stream,  # a single-stream slot predicts its own token
            clean_causal=self.clean_causal,
            within_block_causal=self.within_block_causal,
            views=self.views,
            draft_adapter=draft_adapter,
            canvas_fill=self.canvas_fill,
        )

    def to_dict(self) -> dict:
        return asdict(self)


# What a resumed run must share with the run that wrote the checkpoint: these shape the rows, the
# noise and the data order, so a change would silently train on a different stream. A recipe's own
# fields are its section's RESUME_MUST_MATCH (below).
_RESUME_MUST_MATCH_COMMON = (
    "recipe",
    "dataset",
    "max_response_length",
    "objective",
    "bd_size",
    "views",
    "within_block_causal",
    "canvas_fill",
    "max_length",
    "pack",
    "multiturn",
    "seed",
    "micro_batch_size",
    "grad_accum",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "draft_adapter",
)
# What shapes the learning-rate schedule: a resume may change these only with --allow_schedule_change.
SCHEDULE_FLAGS = ("max_steps", "lr", "warmup", "lr_min_ratio")


@dataclass(frozen=True)
class ModelSection:
    model_id: str
    trust_remote_code: bool = False
    dtype: str = "auto"  # compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32
    router_aux_loss_coef: float | None = None  # mixture of experts (None: the model config's coefficient)


@dataclass(frozen=True)
class DataSection:
    dataset: str
    max_length: int = 4096
    max_response_length: int | None = None
    length_buckets: tuple[int, ...] | None = None
    pack: bool = False
    multiturn: bool = False


@dataclass(frozen=True)
class TrainingSection:
    recipe: str = "sft"  # one of RECIPES (train/recipes.py), which maps the older switches (--ar_only ...) here
    micro_batch_size: int = 1  # rows per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 1000  # optimizer steps
    seed: int = 0  # data order and noise


@dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-5
    warmup: int = 0
    lr_min_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping
    max_nonfinite_steps: int = 3  # a non-finite step is skipped; this many in a row stop the run


@dataclass(frozen=True)
class CheckpointSection:
    save_dir: str
    save_every: int = 0
    resume: str | None = None
    allow_schedule_change: bool = False


@dataclass(frozen=True)
class LoggingSection:
    log_every: int = 1
    wandb: str | None = None
    tensorboard: bool = False


@dataclass(frozen=True)
class EfficiencySection:
    activation_checkpointing: bool = False
    activation_offload: bool = False
    fused_ce: str = "auto"
    compile: bool = False


@dataclass(frozen=True)
class LoraSection:
    """LoRA conversion (`bdcore/draft_adapter.py`): off unless `lora_rank` > 0."""

    lora_rank: int = 0
    lora_alpha: float | None = None  # resolved to 2 x rank
    lora_targets: str = "all-linear"
    draft_adapter: bool = False  # the adapter acts only at drafting rows; the clean stream is the base model
    draft_step: str = "cached"  # draft adapter: clean stream once without grad (cached) or in the joint forward

    def spec(self):
        from bdcore.draft_adapter import LoraSpec

        if self.lora_rank == 0:
            return None
        return LoraSpec(self.lora_rank, self.lora_alpha, self.lora_targets, self.draft_adapter)


@dataclass(frozen=True)
class OPDSection:
    """The flags of `--recipe opd`, on-policy distillation (`train/opd.py`)."""

    # what a resume of an OPD run must share: the draws of each step depend on them
    RESUME_MUST_MATCH: ClassVar = (
        "opd_prompts_per_step",
        "opd_states_per_block",
        "opd_slots",
        "opd_rollout",
        "opd_draft_states",
    )
    ROLLOUTS: ClassVar = ("diffusion", "self-spec")
    DRAFT_STATES: ClassVar = ("decode", "walk")

    # diffusion: the student's own answers, KL at its commits (train/opd.py); self-spec: Draft-OPD, the drafts
    # the served self-spec decoder verified, forward KL where accepted, reverse at the first rejection
    # (train/draft_opd.py)
    opd_rollout: str = "diffusion"
    # self-spec rollouts: weight of the reverse KL at each first rejected slot; 0.1 by measurement (SmolLM2, 26
    # steps from one SFT checkpoint: at 1 the rejected slots' 6-7 nats swamped the accepted ones and drafting fell)
    opd_reject_weight: float = 0.1
    # self-spec rollouts: decode the prompts, or walk greedy self-spec along the dataset's answers (one scoring
    # forward a sample; exact where the answers are the verifier's own greedy ones: self-distilled data)
    opd_draft_states: str = "decode"
    opd_teacher: str | None = None  # the frozen AR teacher (default: --model_id as loaded, before conversion)
    opd_threshold: float = DecodeConfig.threshold  # rollout commit threshold (the server's default)
    opd_temperature: float = 0.0  # rollout sampling temperature (0: greedy, the server's default)
    opd_max_new_tokens: int = 128
    opd_prompts_per_step: int = 4  # rollouts per rank per optimizer step
    opd_states_per_block: int = 1  # canvas states revisited per block (0: every one)
    opd_slots: str = "committed"  # KL at the slots a revisited state committed, or at every slot it masked
    opd_ar_weight: float = 1.0  # weight of the KL on the clean stream's AR rows (0 where they are block-causal)
    opd_sft_weight: float = 0.0  # weight of the two-stream SFT loss on dataset rows (0: OPD alone)


@dataclass(frozen=True)
class RLSection:
    """The flags of `--recipe rl`: GRPO/DAPO on the student's rollouts (`train/rl_trainer.py`, `train/grpo.py`)."""

    # what a resume of an RL run must share: the draws and the rollout batches depend on them
    RESUME_MUST_MATCH: ClassVar = ("rl_rollout_mode", "rl_group_size", "rl_prompts_per_step", "rl_updates_per_batch")

    rl_reward: str = "exact"  # exact | gsm8k | package.module:function (train/rewards.py)
    rl_group_size: int = 8  # rollouts per prompt (the GRPO group)
    rl_prompts_per_step: int = 2  # prompts per rank per rollout batch
    rl_updates_per_batch: int = 1  # optimizer steps per rollout batch
    rl_rollout_mode: str = "diffusion"  # diffusion | self-spec | causal: the decode mode of the rollouts
    rl_temperature: float = 1.0  # rollout sampling temperature
    rl_threshold: float = DecodeConfig.threshold  # rollout commit threshold (the server's default)
    rl_max_new_tokens: int = 128
    rl_clip_low: float = 0.2  # ratio clipped to [1 - low, 1 + high]; DAPO's clip-higher: high > low (0.28)
    rl_clip_high: float = 0.2
    rl_token_level: bool = False  # DAPO: average the loss over all tokens (default: per trajectory, then over them)
    rl_dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    rl_kl_weight: float = 0.0  # k3 KL to the frozen starting checkpoint (0: no reference model loaded)
    rl_sft_weight: float = 0.0  # weight of the two-stream SFT loss on dataset rows (0: RL alone)


@dataclass(frozen=True)
class EvalSection:
    """Held-out drafting metric during training (`train/evaluation.py`): off unless `eval_data`."""

    eval_data: str | None = None  # chat JSONL whose records end with the assistant's answer
    eval_every: int = 0  # steps between evaluations (0: at the end only)
    eval_samples: int = 32  # answers scored per evaluation


# The CLI flags `diffusion` holds; the rest of BlockDiffusionConfig (clean_causal, min_rate) is derived or fixed.
DIFFUSION_FLAGS = (
    "objective",
    "bd_size",
    "ar_loss_weight",
    "within_block_causal",
    "loss_weighting",
    "prefix_gamma",
    "draft_loss",
    "draft_kl_mix",
    "draft_temperature",
    "chain_weights",
    "views",
    "canvas_fill",
)
RESUME_MUST_MATCH = _RESUME_MUST_MATCH_COMMON + OPDSection.RESUME_MUST_MATCH + RLSection.RESUME_MUST_MATCH


@dataclass(frozen=True)
class JobConfig:
    """One training run, section by section; every flag of `train.py` lives in exactly one section."""

    model: ModelSection
    diffusion: BlockDiffusionConfig
    data: DataSection
    training: TrainingSection
    optim: OptimSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    efficiency: EfficiencySection
    lora: LoraSection
    evaluation: EvalSection
    opd: OPDSection
    rl: RLSection

    @classmethod
    def from_args(cls, args) -> JobConfig:
        """From the validated `train.py` namespace (`train.cli.parse_args`)."""
        flags = vars(args)

        def section(kind):
            return kind(**{f.name: flags[f.name] for f in fields(kind)})

        buckets = flags["length_buckets"]
        config = cls(
            model=section(ModelSection),
            diffusion=BlockDiffusionConfig(
                bd_size=flags["bd_size"],
                views=flags["views"],
                ar_loss_weight=flags["ar_loss_weight"],
                within_block_causal=flags["within_block_causal"],
                loss_weighting=flags["loss_weighting"],
                prefix_gamma=flags["prefix_gamma"],
                draft_loss=flags["draft_loss"],
                draft_kl_mix=flags["draft_kl_mix"],
                draft_temperature=flags["draft_temperature"],
                chain_weights=flags["chain_weights"],
                objective=flags["objective"],
                canvas_fill=flags["canvas_fill"],
                # a draft adapter's clean stream is the base model, which is causal
                clean_causal=True if flags.get("draft_adapter") else None,
            ),
            data=replace(section(DataSection), length_buckets=None if buckets is None else tuple(buckets)),
            training=section(TrainingSection),
            optim=section(OptimSection),
            checkpoint=section(CheckpointSection),
            logging=section(LoggingSection),
            efficiency=section(EfficiencySection),
            lora=section(LoraSection),
            evaluation=section(EvalSection),
            opd=section(OPDSection),
            rl=section(RLSection),
        )
        unplaced = set(flags) - set(config.flags())
        if unplaced:  # a flag added to the parser but to no section would be silently ignored
            raise ValueError(f"flags in no JobConfig section: {sorted(unplaced)}")
        return config

    def flags(self) -> dict:
        """The resolved flags by name, as run_config.json and the checkpoint's trainer state record them."""
        out = {**asdict(self.model), **{k: getattr(self.diffusion, k) for k in DIFFUSION_FLAGS}}
        parts = (self.data, self.training, self.optim, self.checkpoint, self.logging, self.efficiency, self.lora)
        for part in (*parts, self.evaluation, self.opd, self.rl):
            out.update(asdict(part))
        if out["length_buckets"] is not None:
            out["length_buckets"] = list(out["length_buckets"])
        return out

    def resume_flags(self) -> dict:
        """What a checkpoint records so that a resume can be checked against the run that wrote it."""
        flags = self.flags()
        return {k: flags[k] for k in RESUME_MUST_MATCH + SCHEDULE_FLAGS}
