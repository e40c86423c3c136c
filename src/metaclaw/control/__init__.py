"""Control the running service: `python -m metaclaw status|pause|resume|train-now|rollback STEP`.

`plane.ControlPlane` (what the commands act on), `api.mount_control` (`/control/*` on the proxy's port),
`cli.main` (the command; it imports no torch, so it answers in a blink). Nothing is imported here, so the
command stays light.
"""
