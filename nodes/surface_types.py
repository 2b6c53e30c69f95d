"""The node API's type templates, used where the running ComfyUI makes them work (tested by what they write).

``io.MatchType`` joins an input and an output with one template: the frontend gives the output the type of
whatever is connected to the input, so a node that passes a MODEL, CLIP or VAE through gives back what it got,
and the editor refuses to wire a CLIP that came out of it into a MODEL input. Not every ComfyUI the pack accepts
makes it work: 0.3.75 offers it, but writes a template's allowed types with no separator (``MODELCLIPVAE``, a type
no output has), does not tell the frontend which output follows which template (``output_matchtypes``), and checks
a link to such an input against the type ``COMFY_MATCHTYPE_V3`` (so no link passes). ComfyUI 0.28.0 and 0.33.0 do
all three. The template is the part a node can test by itself, so a template is used only where it writes its
allowed types as the frontend reads them, one per comma; elsewhere callers keep their fixed types, and nothing is
logged.

Where a template is used, ComfyUI's own check of linked types lets anything into the template's input: a node
that wants a wrong link refused when the prompt is queued (not when it runs) checks it with :func:`link_fits`.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import surface


def _takes(constructor: Any, *names: str) -> bool:
    """Whether ``constructor`` takes all of ``names`` as keyword arguments (their order changed between ComfyUIs)."""
    try:
        parameters = inspect.signature(constructor).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in names)


def match_template(template_id: str, types: list[Any]) -> Any | None:
    """An ``io.MatchType.Template`` allowing ``types`` (ComfyUI types such as ``io.Model``), or ``None`` where the
    running ComfyUI has no working MatchType. Build its input and output by keyword (``id=``, ``template=``).
    """
    match_type = getattr(surface.io, "MatchType", None)
    if match_type is None or not all(_takes(kind, "id", "template") for kind in (match_type.Input, match_type.Output)):
        return None
    try:
        template = match_type.Template(template_id, types)
        allowed = template.as_dict()["allowed_types"]
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    written = allowed.split(",") if isinstance(allowed, str) else []
    return template if len(written) == len(types) and all(written) else None


def link_fits(received: Any, accepted: str) -> bool:
    """Whether an output of type ``received`` may feed an input that takes ``accepted`` (``"MODEL,CLIP,VAE"``), by
    the rule of ComfyUI's own check: a type in common, an output of any type (``*``), or an output whose type
    follows its input (a MatchType: the frontend checked what reaches it)."""
    if not isinstance(received, str):
        return False
    offered = {kind.strip() for kind in received.split(",")}
    anything = {surface.io.AnyType.io_type, surface.io.MatchType.io_type}
    return bool(offered & (set(accepted.split(",")) | anything))
