"""The exception hierarchy of Device Control.

Every error the pack raises on purpose derives from :class:`DeviceControlError`, and its message names
the problem *and* the fix, so that a user who sees it in ComfyUI's error dialog knows what to do next.
Running out of device memory is not one of these: it is an expected outcome, reported as a value or as
the backend's own exception (``torch.OutOfMemoryError``, or a runtime's ``torch.AcceleratorError``; see
``core.devices.sim.device``), which ``core.devices.memory.is_out_of_memory`` recognises.
"""

from __future__ import annotations


class DeviceControlError(Exception):
    """Base class of every deliberate error raised by Device Control."""


class InvalidDeviceSpecError(DeviceControlError, ValueError):
    """A device string could not be parsed (for example ``"gpu:x"`` or ``"tpu:0"``)."""


class DeviceNotFoundError(DeviceControlError, LookupError):
    """A well-formed device string names a device that this machine does not have.

    ``problem`` (what is missing, and what the machine has) and ``fix`` (what to choose instead) are kept apart:
    a node that falls back to another device reports the problem with its own fix, never by cutting this
    message's text.
    """

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


class InvalidSizeError(DeviceControlError, ValueError):
    """A memory size or budget string could not be parsed, or is out of range."""


class InvalidAllocationError(DeviceControlError, ValueError):
    """An allocation of one model over several devices could not be parsed, or cannot hold the model."""


class ModelFileError(DeviceControlError, ValueError):
    """A model file is missing, damaged, or of a format we do not read."""


class UnsafePickleError(ModelFileError):
    """A pickle that ``torch.load(weights_only=True)`` refuses: it could run code, so it is never loaded."""


class UnknownModelError(DeviceControlError, LookupError):
    """No family signature matches a file; the message lists the closest candidates and why they failed."""


class PatchError(DeviceControlError, ValueError):
    """A weight patch of a kind we do not apply, or one that cannot apply to its weight."""


#: The module name our exception types show: ComfyUI imports the pack under its folder's path, so its error
#: dialog would otherwise print ``/home/.../custom_nodes/comfyui-device-control.core.errors.ModelFileError``.
PUBLIC_MODULE = "device_control"
for _error in (
    DeviceControlError,
    InvalidDeviceSpecError,
    DeviceNotFoundError,
    InvalidSizeError,
    InvalidAllocationError,
    ModelFileError,
    UnsafePickleError,
    UnknownModelError,
    PatchError,
):
    _error.__module__ = PUBLIC_MODULE


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for messages that quote it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
