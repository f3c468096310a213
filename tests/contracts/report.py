"""Pass/fail bookkeeping of the engine contract checks (`make sglang-contract`, `make vllm-contract`).

Stdlib only: each check runs in its engine's own environment with the repository on PYTHONPATH."""


class Report:
    def __init__(self):
        self.failures: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
            print(f"FAIL {what}", flush=True)
