"""The buffers a streaming ring fills on the simulated GPU (its slots), checked as a real device orders them.

A slot is filled by a copy on the side stream and read by computations on the main stream, then filled again with
another group's weights. On a real GPU nothing stops a computation from reading a slot before its copy ended, or a
copy from overwriting a slot the previous computation still reads: both give a wrong image, rarely. Here each is an
error (:class:`~core.devices.sim.host.MissingWaitError`): a read needs the stream it runs on to have waited for the
fill, and a fill on the side stream needs it to have waited for the main stream's last read of the old contents.
Slots are known by their storage, so views of one count as the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .host import MissingWaitError

if TYPE_CHECKING:
    from .link import Link, Pending


class Slots:
    """The slots of one device: the copy that filled each last, and the main stream's position at its last read.

    Args:
        link: the device's link (its streams).
        label: how errors name the device.
    """

    def __init__(self, link: Link, label: str) -> None:
        self.link = link
        self.label = label
        #: Storage -> the copy that filled it last (``None``: a copy on the main stream); empty while no ring runs.
        self.filled: dict[int, Pending | None] = {}
        self._reads: dict[int, int] = {}

    def before_fill(self, key: int) -> None:
        """A copy on the current stream is about to fill slot ``key``.

        Raises:
            MissingWaitError: the copy is on a side stream that did not wait for the main stream's last read of the
                slot's old contents.
        """
        stream, main = self.link.current, self.link.main
        if stream is not main and stream.synced.get(main, 0) < self._reads.get(key, 0):
            raise MissingWaitError(
                f"{self.label}: a copy on the {stream.name} stream overwrote a buffer a computation on the main "
                "stream had read, without waiting for that computation (record an event after the last use and "
                "make the copy wait on it)."
            )

    def read(self, key: int) -> None:
        """A computation on the current stream reads slot ``key`` (nothing for memory no copy filled): the fill must
        be done on that stream (raises :class:`MissingWaitError` otherwise), and the read is recorded."""
        if key not in self.filled:
            return
        pending = self.filled[key]
        if pending is not None:
            self.link.check_ready(pending, self.label)
        main = self.link.main
        if self.link.current is main:
            main.queued += 1  # a position for the read, which an event recorded after it covers
            self._reads[key] = main.queued

    def forget(self, key: int) -> None:
        """Slot ``key``'s memory was freed."""
        self.filled.pop(key, None)
        self._reads.pop(key, None)
