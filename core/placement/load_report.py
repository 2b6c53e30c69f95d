"""What a load did, in words: the bytes resident and streamed, what a budget too small for the model is missing,
and what the out-of-memory guard did (``core.placement.engine`` makes it; logs, node texts and the VRAM Report read
it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..devices.tensors import HOST, label_of
from ..units import format_bytes
from .plan import Plan


@dataclass
class LoadReport:
    """What a load did, for logs and node outputs."""

    target: str
    asked: int
    plan: Plan
    total_bytes: int
    resident_bytes: int
    moved_in: int = 0
    moved_out: int = 0
    oom: str | None = None

    @property
    def streamed_bytes(self) -> int:
        """Bytes that stay in host memory and stream."""
        return self.total_bytes - self.resident_bytes

    def summary(self) -> str:
        """``3.20 GiB: 1.20 GiB resident on sim:0, 2.00 GiB streamed from cpu (412 layers, 9 in row slices)``,
        what a budget too small for the model is missing, and what the out-of-memory guard did."""
        text = f"{format_bytes(self.total_bytes)}: {format_bytes(self.resident_bytes)} resident on {self.target}"
        if self.streamed_bytes:
            sliced = f", {len(self.plan.slices)} in row slices" if self.plan.slices else ""
            text += (
                f", {format_bytes(self.streamed_bytes)} streamed from {label_of(HOST)} "
                f"({self.plan.streamed_layers} layers{sliced})"
            )
        if self.plan.over_budget:
            text += f"; {_short_of(self.plan)}"
        if self.oom:
            text += f"; {self.oom}"
        return text


def _short_of(plan: Plan) -> str:
    """What a budget that cannot hold even what cannot stream plus the streaming reserve is missing."""
    budget, fixed, reserve = (format_bytes(n) for n in (plan.budget, plan.fixed_bytes, plan.reserve_bytes))
    needed, over = format_bytes(plan.needed_bytes), format_bytes(plan.needed_bytes - plan.budget)
    what = f"the {fixed} of this model that cannot stream plus the {reserve} it needs to stream the rest"
    return f"the budget {budget} cannot hold {what}: it needs at least {needed}, so it runs {over} over its budget"
