"""DirectML on Windows (the ``torch-directml`` package): devices torch calls ``privateuseone``.

DirectML reports no memory figures, so they stay unknown and a budget on it must be given in bytes.
"""

from __future__ import annotations

from .base import DeviceBackend, DeviceInfo, dtypes_from, installed


class DirectMLBackend(DeviceBackend):
    """The DirectML devices."""

    name = "directml"

    def available(self) -> bool:
        return installed("torch_directml")

    def devices(self) -> list[DeviceInfo]:
        import torch_directml  # only present on DirectML installs

        found = []
        for index in range(torch_directml.device_count()):
            name = torch_directml.device_name(index)
            native = f"privateuseone:{index}"
            found.append(DeviceInfo("", "directml", name, native, None, None, dtypes=dtypes_from(True, False, False)))
        return found
