"""The decode core shared by the native engine, the SGLang and vLLM adapters and the trainer's rollouts.

- `config.py`: the decode modes and settings (`DecodeConfig`), defaults filled from the checkpoint;
- `sampling.py`: logits -> distribution -> token (temperature, top-k, top-p, the `<|mask|>` ban);
- `rules.py`: the commit rule, the denoise step, acceptance (greedy and rejection sampling), stops;
- `rows.py`: the rows of one decode forward (`Forward`) and their mask (from `bdcore.attention_rule`);
- `sequence.py`: one request's state (`Sequence`): sampling, token sink, cache, stats;
- `modes.py`: the causal, diffusion and self-spec decoders (state machines over forwards);
- `runner.py`: the model forward over the next rows of one or more sequences;
- `driver.py`: the one decode loop (admit, forward, take, retire) and its step (layout choice, timing);
- `speculation.py`: self-spec layouts and the policy that picks them from cost and acceptance;
- `acceptance.py`: how often drafts are right (per request, pooled), argmax and side candidates;
- `tree.py`, `tree_policy.py`: draft trees (a verify over each slot's top candidates) and what they yield;
- `cost.py`: the forward's measured cost by rows and batch size (calibration, cache, live timings);
- `gated_delta_layers.py`: gated-delta layers in decode forwards (the runner keeps their state).
"""
