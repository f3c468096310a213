"""The self-spec policy: how much each step drafts, chosen from the measured forward cost and acceptance.

The mechanism (decoders, runner, rows, rules) runs whatever `bdcore.decode.layout.Layout` it is given; this
package chooses it where a request leaves the choice to the engine (`--draft-len auto`,
`--self-spec-canvases auto`, `--tree auto`), and measures what the choice needs.

- `state.py`: the engine's policy state (`Speculation`): the driver asks it to plan and tells it what happened;
- `request.py`: one request's policy state (`RequestPolicy`), the one policy object its decoder holds;
- `speculation.py`: the layouts a request may take and the one each of a forward's sequences takes;
- `acceptance.py`: how often drafts are right (per request, pooled), argmax and side candidates;
- `tree_policy.py`: the draft trees the policy weighs and what one tree verify yields;
- `cost.py`: the forward's measured cost by rows and batch size (calibration, cache, live timings);
- `tuning.py`: the policy's tuning constants, written once;
- `draft_quality.py`, `tree_acceptance.py`: the drafting metric (one forward per held-out answer), whose figures
  are the policy's prior and the trainer's and benchmark's drafting figures.
"""
