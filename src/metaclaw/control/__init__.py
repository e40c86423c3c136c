"""Control the running service: `python -m metaclaw status|pause|resume|train-now|rollback STEP`."""

from metaclaw.control.api import create_control_app, mount_control
from metaclaw.control.plane import ControlError, ControlPlane, build_control

__all__ = ["ControlError", "ControlPlane", "build_control", "create_control_app", "mount_control"]
