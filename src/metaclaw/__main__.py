"""`python -m metaclaw ...`: the `metaclaw` command (`metaclaw.cli`)."""

from metaclaw.cli import main

raise SystemExit(main())
