"""A prompt with a value our nodes refuse is refused whole, with one error on the input at fault, in the user's words.

ComfyUI asks a node's ``validate_inputs`` when a prompt is queued, but it files the node's refusal under every input
the method takes (a budget of ``abc`` read as two errors, one on the device, which was fine), the frontend's toast
shows its own words ("Invalid input") with ours behind a detail, and the outputs that do not depend on the node run
anyway. ComfyUI 0.3.75 does not check a node's list inputs at all (a checkpoint that was never there passes the
queue and fails when the loader runs). So the pack looks at ``POST /prompt`` first (an aiohttp middleware on
ComfyUI's server): for each of our nodes the prompt runs, a value not in its list and whatever its own
``validate_inputs`` refuses become one error on that input, the frontend gets ComfyUI's answer for a prompt that
failed validation (400, the node's outline on the input), the editor a toast in the pack's words naming the node,
and nothing is queued. A model patch or GLIGEN placed on another device than the diffusion model it computes
inside is refused the same way (``nodes.patch_devices``). A prompt we find nothing wrong with goes on to ComfyUI
untouched; so does one this check cannot read (it must never stop a prompt ComfyUI would take). A prompt taken that
will run many minutes on the CPU says so (``nodes.cpu_notice``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from . import cpu_notice, surface
from .device_warnings import quiet, refuse_text
from .patch_devices import patch_device_problems

log = logging.getLogger("device_control")

PROMPT_PATHS = frozenset({"/prompt", "/api/prompt"})
#: ComfyUI's own words for a prompt none of whose outputs validated and for the errors of a node: frontends key
#: their texts on them and show the details (ours) beside them.
FAILED = {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation", "details": ""}
CUSTOM = {"type": "custom_validation_failed", "message": "Custom validation failed for node"}
NOT_IN_LIST = {"type": "value_not_in_list", "message": "Value not in list"}


def not_in_list(name: str, value: object) -> str:
    """The sentence for a value that is not one of a list input's choices."""
    return (
        f"{name}: {value!r} is not one of the choices ComfyUI lists for it. If it is a model file, put it in its "
        "models folder and press R in the editor to refresh the lists; otherwise pick one from the list."
    )


def _options(spec: Any) -> list[Any] | None:
    """The choices of a list input's spec (``None``: not a list input)."""
    kind, info = (spec[0], spec[1] if len(spec) > 1 else {}) if isinstance(spec, (tuple, list)) else (spec, {})
    if isinstance(kind, list):
        return kind
    if kind == "COMBO" and isinstance(info, dict) and isinstance(info.get("options"), list):
        return info["options"]
    return None


def _checked_by_node(node: type) -> list[str]:
    """The inputs the node's ``validate_inputs`` takes (ComfyUI leaves their list check to it)."""
    check = getattr(node, "validate_inputs", None)
    return [name for name in inspect.signature(check).parameters if name != "cls"] if callable(check) else []


def _list_problems(node: type, inputs: dict[str, Any], skip: Iterable[str]) -> list[tuple[str, dict]]:
    """Each list input given a value that is not one of its choices: (the sentence, the error's extra info)."""
    declared = node.INPUT_TYPES()
    problems = []
    for group in ("required", "optional"):
        for name, spec in (declared.get(group) or {}).items():
            value = inputs.get(name)
            options = _options(spec)
            if name in skip or options is None or name not in inputs or isinstance(value, list):
                continue
            if value not in options:
                extra = {"input_name": name, "received_value": value}
                problems.append((not_in_list(name, value), extra))
    return problems


def _own_problem(node: type, inputs: dict[str, Any], checked: list[str]) -> tuple[str, str] | None:
    """What the node's own ``validate_inputs`` refuses, filed under the input its message names."""
    arguments = {name: (None if isinstance(inputs[name], list) else inputs[name]) for name in checked if name in inputs}
    with quiet():  # its warnings are said when ComfyUI validates the prompt, once
        answer = node.validate_inputs(**arguments)
    if answer is True or answer is None:
        return None
    text = str(answer)
    named = text.split(":", 1)[0].strip()
    return (named if named in checked else (checked[0] if checked else "")), text


def _needed(prompt: dict[str, Any], targets: list[str] | None) -> set[str]:
    """The nodes a run of ``targets`` (all outputs: ``None``) uses: the targets and everything they read from."""
    if not targets:
        return set(prompt)
    needed, todo = set(), [str(target) for target in targets]
    while todo:
        node = todo.pop()
        if node in needed or node not in prompt:
            continue
        needed.add(node)
        inputs = prompt[node].get("inputs") or {}
        todo += [str(value[0]) for value in inputs.values() if isinstance(value, list) and len(value) == 2]
    return needed


def _custom(problem: tuple[str, str] | None) -> list[dict[str, Any]]:
    """ComfyUI's error for a refusal of ours (the input at fault, the sentence); none for ``None``."""
    if problem is None:
        return []
    name, text = problem
    return [{**CUSTOM, "details": text, "extra_info": {"input_name": name}}]


def node_errors(body: dict[str, Any], ours: dict[str, type]) -> dict[str, dict[str, Any]]:
    """ComfyUI's ``node_errors`` for the values our nodes in the prompt ``body`` refuse (empty: none)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, dict):
        return {}
    errors: dict[str, dict[str, Any]] = {}
    placed_apart = {node_id: ("device", text) for node_id, text in patch_device_problems(prompt).items()}
    for node_id in sorted(_needed(prompt, body.get("partial_execution_targets")), key=str):
        entry = prompt[node_id]
        node = ours.get(entry.get("class_type")) if isinstance(entry, dict) else None
        if node is None:
            continue
        inputs = entry.get("inputs") or {}
        checked = _checked_by_node(node)
        found = [
            {**NOT_IN_LIST, "details": text, "extra_info": extra}
            for text, extra in _list_problems(node, inputs, checked)
        ]
        found += _custom(_own_problem(node, inputs, checked) or placed_apart.get(str(node_id)))
        if found:
            errors[str(node_id)] = {"errors": found, "dependent_outputs": [], "class_type": entry["class_type"]}
    return errors


def refusal(body: dict[str, Any], ours: dict[str, type]) -> web.Response | None:
    """The answer to a prompt our nodes refuse (``None``: hand it to ComfyUI), each refusal also a toast."""
    errors = node_errors(body, ours)
    if not errors:
        return None
    said = []
    for node_id, entry in errors.items():
        title = ours[entry["class_type"]].define_schema().display_name
        for error in entry["errors"]:
            refuse_text(node_id, title, error["details"], body.get("client_id"))
            said.append(f"{title} (node {node_id}): {error['details']}")
    log.warning("[Device Control] prompt refused before it was queued: %s", "; ".join(said))
    answer = {"error": {**FAILED, "extra_info": {}}, "node_errors": errors}
    return web.json_response(answer, status=400)


def middleware(ours: dict[str, type]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The check as an aiohttp middleware over ComfyUI's ``POST /prompt`` for the node classes ``ours`` (by id)."""

    @web.middleware
    async def check_prompt(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]) -> Any:
        if request.method == "POST" and request.path in PROMPT_PATHS:
            try:
                body = await request.json()
                answer = refusal(body, ours)
                if answer is not None:
                    return answer
                cpu_notice.tell(body)  # a prompt taken: what it costs on the CPU, where ComfyUI computes there
            except Exception:  # never stop a prompt ComfyUI would take because this check failed
                log.exception("[Device Control] the queue-time check failed; the prompt goes to ComfyUI unchecked")
        return await handler(request)

    return check_prompt


_installed = False


def install(nodes: Iterable[type]) -> None:
    """Put the check in front of ComfyUI's ``POST /prompt`` (once, before the server starts serving)."""
    global _installed
    if _installed or not surface.running_in_comfyui():
        return
    ours = {node.define_schema().node_id: node for node in nodes}
    surface.prompt_server().app.middlewares.append(middleware(ours))
    _installed = True
