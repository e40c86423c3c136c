"""The live loop's orchestration: start the policy server, the proxy, the scorer and the user driver for
`train.py`, wire them from the composed config, and stop them in order. Above `rollout/`, `scoring/`,
`evaluation/` and `skills/`; only `metaclaw.training` imports it."""
