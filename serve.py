"""Serve: `python serve.py` (policy server) or `python serve.py app=training_server` (seed 000's API).

The same as `metaclaw serve ...` (`metaclaw.cli.serve_main`, config tree `src/metaclaw/conf`).
"""

from metaclaw.cli import hydra_setup, serve_main

if __name__ == "__main__":
    hydra_setup("serve")  # resolvers; the overrides checked; private umask before Hydra creates the run dir
    serve_main()
