"""The decode core shared by the native engine, the SGLang and vLLM adapters and the trainer's rollouts.

- `config.py`: the decode modes and settings (`DecodeConfig`), defaults filled from the checkpoint;
- `sampling.py`: logits -> distribution -> token (temperature, top-k, top-p, the `<|mask|>` ban);
- `rules.py`: the commit rule, the denoise step, acceptance (greedy and rejection sampling), stops;
- `rows.py`: the rows of one decode forward (`Forward`) and their mask (from `bdcore.attention_rule`);
- `sequence.py`: one request's state (`Sequence`): sampling, token sink, cache, stats;
- `modes.py`: the causal, diffusion and self-spec decoders (state machines over forwards);
- `runner.py`: the model forward over the next rows of one or more sequences;
- `driver.py`: the one decode loop (admit, forward, take, retire) and its step (layout choice, timing);
- `layout.py`: one self-spec step's layout (drafts verified, canvases and the rows they follow);
- `tree.py`: draft trees (a verify over each slot's top candidates);
- `policy/`: the self-spec policy (layouts chosen from cost and acceptance) and the drafting metric;
- `gated_delta_layers.py`: gated-delta layers in decode forwards (the runner keeps their state).
"""
