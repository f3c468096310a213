"""The compiled decode step (`bdcore.decode.compiled_step`, `ModelRunner.compile_decode`): decode forwards run
through inductor and compute what the eager runner computes (fp32: logits within 1e-4, greedy tokens the same),
for one sequence and for sequences of different lengths decoding together; a served draft adapter's drafting
forwards run compiled on its drafting twin; prompts and hybrid models stay eager; a machine that cannot compile
says so and how to serve anyway. Compiling a tiny model takes about 25 s a graph on a 2-core CPU (a batch of
one and a batch of many, causal and drafting)."""

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

import bdcore.decode.runner as runner_module
from bdcore.decode.compiled_step import CompiledModels, compile_works
from bdcore.decode.config import DecodeConfig
from bdcore.decode.packed_linear import is_packed, pack_linears, packing_works
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import SequenceCache
from bdcore.draft_adapter_serving import DraftingTwin
from bdcore.loading import load_checkpoint
from benchmark.tiny import draft_checkpoint, tiny_checkpoint, tiny_hybrid_model, tiny_model
from inference.native.engine import Engine

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(compile_works() is not None, reason=f"cannot compile here: {compile_works()}"),
]
PROMPTS = [[5, 9, 14, 3, 7, 22, 8, 11, 30], [4, 17, 2, 9, 40], [12, 6, 31, 25, 19, 7, 2]]
STEPS = 8


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of `prompts` together through `runner`: the tokens per sequence and every step's logits."""
    caches = [SequenceCache() for _ in prompts]
    tokens = [list(p) for p in prompts]
    logits = runner.forward([(c, Forward(Rows().clean(p, 0), len(p))) for c, p in zip(caches, prompts)])
    seen = []
    for _ in range(steps):
        for seq, row in zip(tokens, logits):
            seq.append(int(row[-1].argmax()))
        ops = [Forward(Rows().clean(seq[-1:], len(seq) - 1), 1) for seq in tokens]
        logits = runner.forward(list(zip(caches, ops)))
        seen.append(torch.stack([row[-1] for row in logits]))
    return tokens, seen


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(autouse=True)
def _one_inductor_cache(inductor_cache, monkeypatch):
    """The module's compiles share inductor's disk cache (each test's temp folder would be a cold one):
    the engine's tiny Llama compiles the graphs the runner tests already compiled."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One tiny Llama for the module: its graphs, compiled once, serve the runner's tests and the engine's."""
    directory = tiny_checkpoint(tmp_path_factory.mktemp("compiled") / "ckpt", arch="llama", seed=3)
    return load_checkpoint(directory, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def model(loaded):
    return loaded.model


@pytest.fixture(scope="module")
def compiled(model):
    runner = ModelRunner(model, banned=None)
    runner.serving_only = True
    runner.compile_decode()
    return runner


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one sequence", "three decoding together"])
def test_compiled_decode_computes_what_the_eager_runner_computes(model, compiled, prompts):
    eager = ModelRunner(model, banned=None)
    eager.serving_only = True
    want_tokens, want = greedy(eager, prompts, STEPS)
    got_tokens, got = greedy(compiled, prompts, STEPS)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_only_decode_steps_run_compiled_and_the_model_itself_is_not_changed(model, compiled, monkeypatch):
    calls, ran = [], []
    real = CompiledModels.__call__

    def recorded(self, m):
        calls.append(m)
        ran.append(real(self, m))
        return ran[-1]

    monkeypatch.setattr(CompiledModels, "__call__", recorded)
    greedy(compiled, PROMPTS[:2], 3)
    assert calls == [model] * 3, "the prompt forward runs eager, each of the 3 decode steps compiled"
    assert all(isinstance(m.compiled, torch._dynamo.OptimizedModule) and m.compiled._orig_mod is model for m in ran)
    assert "forward" not in vars(model)
    assert not any(isinstance(m, torch._dynamo.OptimizedModule) for m in model.modules())


def test_the_engine_compiled_at_start_answers_as_the_eager_engine(loaded):
    """`serve.py --compile`: the engine compiles its decode graphs before the first request (`warm_up`)."""
    params = SamplingParams(max_tokens=12)
    prompt = loaded.tokenizer("the cat sat on")["input_ids"]
    want = Engine(loaded).generate(prompt, params)
    torch._dynamo.reset()  # the runner tests' graphs, kept by dynamo for this model's forward: compile anew
    clear_compilation_metrics()
    engine = Engine(loaded, compiled=True)
    assert engine.compile_seconds is not None and engine.runner.compiled is not None
    compiles = get_compilation_metrics()
    assert compiles, "the engine's warm-up compiled its graphs"
    # one trace a graph: a trace restarted (dynamo's floats as symbols, undone later) costs a start twice the time
    assert [m.restart_reasons for m in compiles if m.restart_reasons] == []
    got = engine.generate(prompt, params)
    assert (got.tokens, got.text) == (want.tokens, want.text) and len(got.tokens) == 12


def test_a_hybrid_model_decodes_eager_with_compile_on(monkeypatch):
    runner = ModelRunner(tiny_hybrid_model(seed=1), banned=None)
    runner.serving_only = True
    runner.compile_decode()
    monkeypatch.setattr(CompiledModels, "__call__", lambda self, m: pytest.fail("a hybrid forward was compiled"))
    tokens, _ = greedy(runner, PROMPTS[:1], 2)
    assert len(tokens[0]) == len(PROMPTS[0]) + 2


@pytest.mark.skipif(not packing_works(), reason="this CPU or torch build runs no packed bf16 linear")
def test_a_compiled_step_over_packed_bf16_weights_computes_what_it_does_over_plain_ones(loaded):
    """On a CPU with native bf16 the engine packs its bf16 linears (`packed_linear.py`); inductor cannot lower
    oneDNN's linear over a weight it did not freeze itself (it asserted, and `--compile` stopped at start), so a
    compiled step calls the packed matmul as an op of its own: the logits of the compiled step over the plain
    weights, to oneDNN's rounding (bit for bit on the AMD EPYC where it was written; both bf16, so both differ
    from eager by the compile's own). The same tokens go to both: a bf16 tie could send greedy paths apart."""
    import copy

    plain = copy.deepcopy(loaded.model).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) > 0 and not is_packed(plain)
    runs = []
    for model in (plain, packed):
        runner = ModelRunner(model, banned=None)
        runner.serving_only = True
        runner.compile_decode()
        caches = [SequenceCache() for _ in PROMPTS[:2]]
        runner.forward([(c, Forward(Rows().clean(p, 0), len(p))) for c, p in zip(caches, PROMPTS[:2])])
        steps = []
        for step in range(4):  # decode steps over fixed tokens, each sequence at its own length
            ops = [Forward(Rows().clean([11 + step], len(p) + step), 1) for p in PROMPTS[:2]]
            steps.append(torch.stack([row[-1] for row in runner.forward(list(zip(caches, ops)))]).float())
        runs.append(torch.stack(steps))
    plain_logits, packed_logits = runs
    assert packed_logits.abs().max() > 0.1  # a real output, not zeros from a broken op
    torch.testing.assert_close(packed_logits, plain_logits, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A tiny Qwen3 with a served draft-only adapter (random, rank 4), fp32."""
    return load_checkpoint(draft_checkpoint(tmp_path_factory.mktemp("drafter") / "ckpt"), device="cpu", dtype="fp32")


def drafting_steps(runner: ModelRunner, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    """Self-spec-shaped forwards of `prompts` together: the prompts, then steps of 1 or 2 verify rows and a
    canvas of 4 drafting slots after them (the canvas not kept); every forward's logits per sequence."""
    caches = [SequenceCache() for _ in prompts]
    seen = [runner.forward([(c, Forward(Rows().clean(p, 0), len(p))) for c, p in zip(caches, prompts)])]
    ends = [len(p) for p in prompts]
    for step in range(4):
        ops = []
        for b, n in enumerate(ends):
            clean = [7 + b, 3][: 1 + (step + b) % 2]  # sequences of one forward verify different counts
            ops.append(Forward(Rows().clean(clean, n).canvas([9, 4, 4, 4], n + len(clean)), len(clean)))
            ends[b] += len(clean)
        seen.append(runner.forward(list(zip(caches, ops))))
    return seen


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS[:2]], ids=["one sequence", "two decoding together"])
def test_drafting_forwards_run_compiled_on_the_drafting_twin_as_the_eager_runner(drafter, prompts, monkeypatch):
    """A served draft adapter's drafting forwards run its drafting twin compiled (the LoRA at the gated rows only):
    verify rows and drafting rows computed as eagerly (fp32 within 1e-4, the same greedy tokens)."""
    eager = ModelRunner.for_checkpoint(drafter.model, drafter.capabilities)
    eager.serving_only = True
    want = drafting_steps(eager, prompts)
    runner = ModelRunner.for_checkpoint(drafter.model, drafter.capabilities)
    runner.serving_only = True
    runner.compile_decode()
    calls, real = [], CompiledModels.__call__
    monkeypatch.setattr(CompiledModels, "__call__", lambda self, m: calls.append(m) or real(self, m))
    got = drafting_steps(runner, prompts)
    assert runner._drafter is not None and calls == [runner._drafter.module] * 4, "the prompts eager, 4 steps compiled"
    for step_got, step_want in zip(got[1:], want[1:]):
        for g, w in zip(step_got, step_want):
            finite = torch.isfinite(w)  # <|mask|> is banned: -inf in both
            assert torch.equal(finite, torch.isfinite(g))
            torch.testing.assert_close(g[finite], w[finite], atol=1e-4, rtol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_drafting_forwards_run_eager_where_the_twin_cannot_take_them(drafter, monkeypatch):
    """A runner whose model also trains (rollouts: no served path) and a forward of more rows than the twin's
    gate holds run drafting forwards eager, and compute what they compute eager."""
    monkeypatch.setattr(CompiledModels, "__call__", lambda self, m: pytest.fail("a drafting forward was compiled"))
    training = ModelRunner.for_checkpoint(drafter.model, drafter.capabilities)
    training.compile_decode()
    prompt = PROMPTS[0]
    cache = SequenceCache()
    training.forward([(cache, Forward(Rows().clean(prompt, 0), len(prompt)))])
    (logits,) = training.forward([(cache, Forward(Rows().clean([7], 9).canvas([9, 4, 4], 10), 1))])
    assert logits.shape[0] == 4 and training._drafter is None
    monkeypatch.setattr(DraftingTwin, "ROWS", 3)
    serving = ModelRunner.for_checkpoint(drafter.model, drafter.capabilities)
    serving.serving_only = True
    serving.compile_decode()
    want = drafting_steps(ModelRunner.for_checkpoint(drafter.model, drafter.capabilities), PROMPTS[:1])
    got = drafting_steps(serving, PROMPTS[:1])
    for (g,), (w,) in zip(got, want):
        assert torch.equal(g, w)


def test_a_self_spec_engine_compiles_its_drafting_graphs_at_start(drafter):
    """`serve.py --mode self-spec --compile` on a draft adapter: the warm-up compiles the drafting twin's graphs
    too, so a request compiles nothing, and its answer is the eager engine's (fp32 greedy: the base model's)."""
    params, decode = SamplingParams(max_tokens=16), DecodeConfig(mode="self-spec", draft_len=4)
    prompt = drafter.tokenizer("12 34 56")["input_ids"]  # 16 tokens without a stop on this model
    want = Engine(drafter, decode).generate(prompt, params)
    torch._dynamo.reset()
    engine = Engine(drafter, decode, compiled=True)
    assert engine.runner._drafter is not None, "the warm-up ran drafting forwards"
    clear_compilation_metrics()
    got = engine.generate(prompt, params)
    assert get_compilation_metrics() == [], "the request compiled a graph the warm-up left out"
    assert got.tokens == want.tokens and len(got.tokens) == 16
    assert got.stats.verify_steps > 0


def test_a_machine_that_cannot_compile_says_why_and_how_to_serve(monkeypatch):
    monkeypatch.setattr(runner_module, "compile_works", lambda: "no C++ compiler (apt install g++)")
    runner = ModelRunner(tiny_model("llama"), banned=None)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*without --compile"):
        runner.compile_decode()
    assert runner.compiled is None
