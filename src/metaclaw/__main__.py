"""`python -m metaclaw status|pause|resume|train-now|rollback STEP` (see `metaclaw.control.cli`)."""

from metaclaw.control.cli import main

raise SystemExit(main())
