"""Train the LoRA adapter: `python train.py [method=rl|opd|combine] [model=...] ['devices.train=[0,1]']`.

The same as `metaclaw train ...` (`metaclaw.cli.train_main`, config tree `src/metaclaw/conf`).
"""

from metaclaw.cli import hydra_setup, train_main

if __name__ == "__main__":
    hydra_setup("train")  # resolvers; the overrides checked; private umask before Hydra creates the run dir
    train_main()
