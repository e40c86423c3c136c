"""`python -m metaclaw status|pause|resume|train-now|rollback STEP` (see `metaclaw.control.cli`), and
`python -m metaclaw export|import` (see `metaclaw.export.cli`)."""

import sys

if sys.argv[1:2] in (["export"], ["import"]):
    from metaclaw.export.cli import main as export_main

    raise SystemExit(export_main(sys.argv[1:]))

from metaclaw.control.cli import main  # noqa: E402

raise SystemExit(main())
