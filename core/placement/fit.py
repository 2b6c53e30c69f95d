"""Will it fit? The memory each component needs on the device and in the dtype chosen for it, before loading.

A device gets the sum of what is placed on it. On an accelerator a margin stays free for activations
(``headroom``); what does not fit can still run partially loaded, with the rest streamed from RAM at every
step, so that rest is added to what the CPU side must hold. On the CPU, what does not fit in available RAM
does not fit at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from ..detection.components import CANDIDATE_DTYPES, Component
from ..devices.backends import DeviceInfo
from ..units import format_bytes

DEFAULT_HEADROOM = 512 * 1024**2
_STORED_TO_CANDIDATE = {"F32": "fp32", "F64": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


@dataclass(frozen=True)
class Choice:
    """Where a component goes and in which storage dtype (``fp32``, ``fp16``, ``bf16``, ``fp8``)."""

    device: DeviceInfo
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in CANDIDATE_DTYPES:
            raise ValueError(f"unknown storage dtype {self.dtype!r}; use one of {', '.join(CANDIDATE_DTYPES)}.")


@dataclass(frozen=True)
class ComponentPlan:
    """One component's placement and the bytes it needs there."""

    component: str
    device: str
    dtype: str
    bytes: int


@dataclass(frozen=True)
class DevicePlan:
    """What one device must hold, what stays resident, what would stream, and the verdict."""

    device: str
    name: str
    free: int | None
    needed: int
    resident: int
    streamed: int
    fits: bool
    verdict: str


@dataclass(frozen=True)
class FitPlan:
    """The whole plan: per component, per device, and overall."""

    components: tuple[ComponentPlan, ...]
    devices: tuple[DevicePlan, ...]

    @property
    def fits(self) -> bool:
        """True when every component fits fully on its device."""
        return all(d.fits for d in self.devices)

    @property
    def streamed(self) -> int:
        """Bytes that would have to stream from RAM at each step."""
        return sum(d.streamed for d in self.devices)

    @property
    def summary(self) -> str:
        """One line per device."""
        return "\n".join(f"{d.device}: {d.verdict}" for d in self.devices)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "fits": self.fits,
            "streamed": self.streamed,
            "components": [asdict(c) for c in self.components],
            "devices": [asdict(d) for d in self.devices],
        }


def default_dtype(component: Component) -> str:
    """The candidate dtype matching how most of the component is stored (fp16 when unsure)."""
    stored = [d for d in component.stored_dtypes if d in _STORED_TO_CANDIDATE]
    return _STORED_TO_CANDIDATE[stored[0]] if len(stored) == 1 else "fp16"


def plan_fit(
    components: Iterable[Component], choices: Mapping[str, Choice], *, headroom: int = DEFAULT_HEADROOM
) -> FitPlan:
    """Plan where each component goes and whether it fits.

    Args:
        components: from a :class:`~core.detection.Detection`.
        choices: by component name (``"text_encoder:clip_l"``) or role (``"diffusion_model"``,
            ``"text_encoder"``, ``"vae"``); components without a choice are not loaded and not counted.
        headroom: bytes kept free on accelerators for activations and workspace.
    """
    planned, devices = _place(components, choices)
    needed: dict[str, int] = {}
    for part in planned:
        needed[part.device] = needed.get(part.device, 0) + part.bytes
    plans = [_device_plan(device, needed[device.id], headroom) for device in devices.values() if device.is_accelerator]
    spill = sum(p.streamed for p in plans)
    host = next((d for d in devices.values() if not d.is_accelerator), None)
    if host is not None or spill:  # what does not fit on a GPU streams from RAM, which must hold it
        plans.append(_device_plan(host or _UNLISTED_HOST, needed.get("cpu", 0) + spill, 0, spill))
    return FitPlan(tuple(planned), tuple(plans))


#: The host, when no component was placed there but some must stream from it.
_UNLISTED_HOST = DeviceInfo("cpu", "cpu", "CPU", "cpu", None, None)


def _place(
    components: Iterable[Component], choices: Mapping[str, Choice]
) -> tuple[list[ComponentPlan], dict[str, DeviceInfo]]:
    """Each chosen component on its device in its dtype, and the devices chosen (by id)."""
    planned: list[ComponentPlan] = []
    devices: dict[str, DeviceInfo] = {}
    for component in components:
        choice = choices.get(component.name) or choices.get(component.name.split(":")[0])
        if choice is not None:
            size = component.bytes_by_dtype[choice.dtype]
            planned.append(ComponentPlan(component.name, choice.device.id, choice.dtype, size))
            devices[choice.device.id] = choice.device
    return planned, devices


def _device_plan(device: DeviceInfo, needed: int, headroom: int, from_streaming: int = 0) -> DevicePlan:
    free = device.free
    base = {"device": device.id, "name": device.name, "free": free, "needed": needed}
    if free is None:
        verdict = f"needs {format_bytes(needed)}; this backend does not report free memory, so the fit is unknown"
        return DevicePlan(**base, resident=needed, streamed=0, fits=True, verdict=verdict)
    available = max(0, free - headroom)
    extra = f" (incl. {format_bytes(from_streaming)} streamed to GPUs)" if from_streaming else ""
    if needed <= available:
        verdict = f"fits: {format_bytes(needed)}{extra} of {format_bytes(free)} free"
        return DevicePlan(**base, resident=needed, streamed=0, fits=True, verdict=verdict)
    if not device.is_accelerator:
        verdict = f"does not fit: needs {format_bytes(needed)}{extra}, {format_bytes(free)} of RAM available"
        return DevicePlan(**base, resident=available, streamed=0, fits=False, verdict=verdict)
    streamed = needed - available
    verdict = (
        f"fits partially: {format_bytes(available)} resident, {format_bytes(streamed)} streamed from RAM at each step "
        f"(needs {format_bytes(needed)}, {format_bytes(free)} free, {format_bytes(headroom)} kept for activations)"
    )
    return DevicePlan(**base, resident=available, streamed=streamed, fits=False, verdict=verdict)
