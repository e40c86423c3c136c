"""`python -m metaclaw.skills ...`: see `metaclaw.skills.cli`."""

from metaclaw.skills.cli import main

raise SystemExit(main())
