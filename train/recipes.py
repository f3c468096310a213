"""What a run trains, as one choice: `train.py --recipe {sft,ar_sft,opd,rl}`. Imports no torch.

Each recipe names the older switch that chose it (kept working: `--ar_only`, `--opd_on_policy`,
`--rl_diffusion_rollout`) and the config section that holds its own flags (`--opd_*`, `--rl_*`). The flags
of a recipe the run does not train are refused by name. A flag counts as given when its value differs from
its parser default, so `--opd_threshold 0.9` (the default) next to `--recipe sft` passes: it changes nothing.

The step each recipe runs lives with the trainer (`train/trainer.py`, `_build_recipe`); what a resume of it
must share is its section's `RESUME_MUST_MATCH` (train/config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from train.config import RECIPES, OPDSection, RLSection, TrainingSection


@dataclass(frozen=True)
class Recipe:
    name: str  # its --recipe value
    summary: str  # what it trains, for --help and errors
    legacy_flag: str | None  # the boolean that chose it before --recipe (still accepted)
    section: type | None  # the config section of its own flags

    def own_flags(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.section)) if self.section else ()


RECIPE_TABLE = {
    r.name: r
    for r in (
        Recipe("sft", "block-diffusion SFT on the dataset's rows (the default)", None, None),
        Recipe("ar_sft", "plain AR SFT: clean stream only, no <|mask|> token, no sidecar", "--ar_only", None),
        Recipe("opd", "on-policy distillation from a frozen AR teacher", "--opd_on_policy", OPDSection),
        Recipe("rl", "GRPO/DAPO on the student's rollouts (--rl_rollout_mode)", "--rl_diffusion_rollout", RLSection),
    )
}
assert tuple(RECIPE_TABLE) == RECIPES, "train/config.py's RECIPES and this table name the same recipes"


def recipe_help() -> str:
    return "; ".join(f"{r.name}: {r.summary}" for r in RECIPE_TABLE.values())


def resolve_recipe(args, bad: Callable[[str, str], None]) -> str:
    """Set `args.recipe` from `--recipe` and the older switches (which leave the namespace: the recipe is the
    one record of the choice). Returns how the user chose it, for messages (e.g. `--ar_only`)."""
    chosen = [] if args.recipe is None else [(f"--recipe {args.recipe}", args.recipe)]
    for recipe in RECIPE_TABLE.values():
        if recipe.legacy_flag is not None:
            if vars(args).pop(recipe.legacy_flag.removeprefix("--"), False):
                chosen.append((recipe.legacy_flag, recipe.name))
    last, last_name = chosen[-1] if chosen else (None, None)
    for spelling, name in chosen:
        if name != last_name:
            other = spelling if spelling.startswith("--recipe") else f"{spelling} (--recipe {name})"
            bad(last, f"is --recipe {last_name}, but {other} was given too; a run trains one recipe: keep one of them")
    if not chosen:
        args.recipe = TrainingSection.recipe
        return f"--recipe {args.recipe} (the default)"
    args.recipe = chosen[0][1]
    return chosen[0][0]


def refuse_foreign_flags(args, chosen_by: str, default_of: Callable[[str], object], bad) -> None:
    """A flag of another recipe than the run's, given (not at its default), is refused by name: it would be
    silently ignored."""
    run = chosen_by if chosen_by.startswith("--recipe") else f"--recipe {args.recipe} (chosen by {chosen_by})"
    for recipe in RECIPE_TABLE.values():
        if recipe.name == args.recipe:
            continue
        for name in recipe.own_flags():
            if getattr(args, name) != default_of(name):
                bad(
                    f"--{name}",
                    f"is a flag of --recipe {recipe.name} ({recipe.summary}); this run trains {run}, which does "
                    f"not read it: drop it, or train with --recipe {recipe.name}",
                )


def recipe_of_record(saved: dict) -> dict:
    """A checkpoint's recorded flags with `recipe` filled in: checkpoints written before --recipe record the
    older switches instead."""
    if "recipe" in saved or not saved:
        return saved
    for recipe in RECIPE_TABLE.values():
        if recipe.legacy_flag and saved.get(recipe.legacy_flag.removeprefix("--")):
            return {**saved, "recipe": recipe.name}
    return {**saved, "recipe": TrainingSection.recipe}
