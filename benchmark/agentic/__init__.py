"""Agentic benchmark harnesses (BFCL v4, tau2-bench, SWE-bench via mini-swe-agent, Terminal-Bench) pointed
at bdstack's OpenAI-compatible server: a compatibility probe and per-harness configuration generators.
The harnesses themselves are installed in their own environments (see README.md beside this file)."""
