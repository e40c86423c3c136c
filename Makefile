.PHONY: install test test-slow lint bench

install:  ## venv + torch + metaclaw + embedded models, then the main job
	bash scripts/install.sh

test:  ## the fast CPU suite (what CI runs)
	.venv/bin/python -m pytest -q

test-slow:  ## longer CPU tests (real default model, crash/restart)
	.venv/bin/python -m pytest -q -m slow

lint:
	.venv/bin/ruff check .
