"""The block-diffusion training semantics as one small config (DESIGN sections 2-4)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

LOSS_WEIGHTINGS = ("uniform", "inverse_rate")


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
    `views=0` is plain AR SFT (the `--ar_only` baseline): clean stream only, AR loss only.
    """

    bd_size: int = 32
    views: int = 2
    ar_loss_weight: float = 0.2
    clean_causal: bool | None = None
    within_block_causal: bool = False
    loss_weighting: str = "uniform"
    min_rate: float = 1e-3

    def __post_init__(self) -> None:
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
        if not 0.0 < self.min_rate < 1.0:
            raise ValueError(f"min_rate={self.min_rate} must lie in (0, 1)")
        if self.clean_causal is None:
            object.__setattr__(self, "clean_causal", self.ar_loss_weight > 0)
        if self.ar_loss_weight > 0 and not self.clean_causal:
            raise ValueError(
                "ar_loss_weight > 0 needs clean_causal=True: the AR loss trains the clean stream as a causal LM"
            )

    @property
    def ar_only(self) -> bool:
        return self.views == 0

    def to_dict(self) -> dict:
        return asdict(self)
