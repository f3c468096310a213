"""A reward for the RL tests (`--rl_reward tests.rl_task:digit_share`): a task the untrained demo model fails."""


def digit_share(answer: str, reference: str) -> float:
    """The share of the answer's characters that are digits (0 for an empty answer)."""
    return sum(c.isdigit() for c in answer) / len(answer) if answer else 0.0


# Rewards a user could get wrong (tests/test_nonfinite_guard.py): each must stop the run with one line.
def nan_reward(answer: str, reference: str) -> float:
    return float("nan")


def text_reward(answer: str, reference: str) -> str:
    return "1.0"


def raising_reward(answer: str, reference: str) -> float:
    return {"good": 1.0}[answer]
