"""Which ComfyUI's pass a test runs in (``tools/run_tests.py`` makes one pass per ComfyUI we test).

The primary ComfyUI's pass (0.3.75, the first) runs every test. The newest ComfyUI's pass (0.33.0) runs the
version checks: the tests of what differs between ComfyUI versions, the modules named in
:data:`EVERY_VERSION_MODULES` and the tests marked :data:`EVERY_VERSION` (ComfyUI's loaders, its model management
and bookkeeping from every state a model can be in, its patch and cast maths, its detection, each family built and
run end to end, its frontend, Dynamic VRAM, ComfyUI-Manager's install). The rest, our own code at scale over the
same ComfyUI calls (five families under a budget with a LoRA, splits, the panel's routes, the reliability checks),
runs once, in the primary pass: every test in every pass takes a 2-core machine over 90 minutes. A ComfyUI between
the two (0.28.0) runs a part of the version checks, :data:`MIDDLE_VERSION_MODULES`.
``DEVICE_CONTROL_EVERY_TEST=1`` runs the others too in any pass (not those marked :data:`ONCE`).

:data:`ONCE` keeps a test out of the other passes even in a version-check module; the long reliability checks
(marked :data:`LONG`) run in the newest tested ComfyUI's pass only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.runtime.provision import DEFAULT_VERSION, MIDDLE_VERSIONS, PRIMARY_VERSION, long_checks_version

#: Whether this pass is the primary ComfyUI's (0.3.75: the one that runs every tier).
PRIMARY_PASS = DEFAULT_VERSION == PRIMARY_VERSION
#: Whether this pass is the one the long reliability checks run in (the newest ComfyUI tested, 0.33.0, where its
#: source archive is there; else the primary one).
LONG_PASS = long_checks_version() == DEFAULT_VERSION
#: Every test not marked :data:`ONCE` runs in this pass, whatever its ComfyUI (``DEVICE_CONTROL_EVERY_TEST=1``).
EVERY_TEST = os.environ.get("DEVICE_CONTROL_EVERY_TEST", "").lower() in ("1", "true", "yes")

#: Runs in the primary ComfyUI's pass only.
ONCE = pytest.mark.skipif(not PRIMARY_PASS, reason=f"runs once, in the ComfyUI {PRIMARY_VERSION} pass")
#: Runs in the long checks' pass only.
LONG = pytest.mark.long_check
#: A version check in a module that is not one: runs in every ComfyUI's pass.
EVERY_VERSION = pytest.mark.every_version

#: The integration and browser modules whose tests all run in every ComfyUI's pass.
EVERY_VERSION_MODULES = frozenset(
    {
        "test_auto_dtype",
        "test_bridge",
        "test_checkpoint_equivalence",
        "test_comfy_detection_fallback",
        "test_comfyui_gguf",  # only where DEVICE_CONTROL_COMFYUI_GGUF names a checkout of that pack
        "test_compatibility",
        "test_detection_new_families",
        "test_detection_oracle",
        "test_diffusion_model_loader",
        "test_dynamic_vram",
        "test_family_fixtures",
        "test_fixtures",
        "test_fork_server",
        "test_gguf_loader",
        "test_gguf_qwen3",
        "test_gguf_text_encoders",
        "test_gguf_umt5",
        "test_load_checkpoint",
        "test_lora_coverage",
        "test_manager_install",
        "test_model_type_oracle",
        "test_model_type_outputs",
        "test_move_model_types",
        "test_move_offload",
        "test_queue_time",
        "test_object_info",
        "test_ops_oracle",
        "test_patch_oracle",
        "test_placement_from_any_state",
        "test_placement_takeover",
        "test_platforms",
        "test_split_books",
        "test_split_comfy_models",
        "test_split_loaders",
        "test_vram_report",
        "test_workflows",
        # the browser tier: each ComfyUI with the frontend it pins
        "test_frontend",
        "test_move_types",
        "test_panel",
    }
)


#: What a ComfyUI between the primary and the newest (0.28.0) runs of the version checks: what breaks first when
#: ComfyUI changes, at the least cost. The surface check and what the server registers, every example workflow
#: end to end, our loader against ComfyUI's tensor for tensor (Dynamic VRAM's weightless layers included), its
#: Dynamic VRAM class, its detection, patch and cast maths, model management from every state a model can be in
#: and the books of a split, and the frontend it pins with our extension and typed outputs. Its loaders' dtype
#: matrix, the bad-input checks, LoRAs, GGUF and the panel run on the primary and the newest ComfyUI.
MIDDLE_VERSION_MODULES = frozenset(
    {
        "test_auto_dtype",
        "test_bridge",
        "test_checkpoint_equivalence",
        "test_compatibility",
        "test_detection_new_families",
        "test_detection_oracle",
        "test_dynamic_vram",
        "test_family_fixtures",
        "test_fixtures",
        "test_fork_server",
        "test_lora_coverage",
        "test_model_type_oracle",
        "test_model_type_outputs",
        "test_move_model_types",
        "test_object_info",
        "test_ops_oracle",
        "test_patch_oracle",
        "test_placement_from_any_state",
        "test_split_books",
        "test_split_comfy_models",
        "test_vram_report",
        "test_workflows",
        "test_frontend",
        "test_move_types",
    }
)
#: Whether this pass is a middle ComfyUI's (it runs :data:`MIDDLE_VERSION_MODULES` only).
MIDDLE_PASS = DEFAULT_VERSION in MIDDLE_VERSIONS

#: The integration modules whose processes together (pytest, its ComfyUI servers, the pool's idle ones, a
#: benchmark's subprocess) held at most about 7.5 GiB (``docs/bench/ci_module_ram.txt``). A whole run
#: (``tools/run_tests.py``) runs them as a job of their own beside the pass's other modules (up to 15.5 GiB):
#: on a 2-core, 24 GB machine the integration tiers cannot run side by side, and each left a third of the cores idle.
#: ``DEVICE_CONTROL_MODULES=light`` collects only these, ``heavy`` only the others. A new module is heavy until its
#: RAM is measured.
LIGHT_MODULES = frozenset(
    {
        # ComfyUI's surface, detection and maths, small models
        "test_auto_dtype",
        "test_bridge",
        "test_checkpoint_equivalence",
        "test_comfy_detection_fallback",
        "test_compatibility",
        "test_detection_new_families",
        "test_detection_oracle",
        "test_family_fixtures",
        "test_fixtures",
        "test_fork_server",
        "test_lora_coverage",
        "test_manager_install",
        "test_model_type_oracle",
        "test_object_info",
        "test_patch_devices",
        "test_ops_oracle",
        "test_patch_oracle",
        "test_vram_report",
        # a loader filling a simulated GPU (the primary pass only)
        "test_fill_on_device",
        # GGUF files
        "test_gguf_loader",
        "test_gguf_qwen3",
        "test_gguf_text_encoders",
        "test_gguf_umt5",
        "test_comfyui_gguf",
        # benchmarks' smoke tests, the panel's routes, the reliability checks
        "test_bench_host",
        "test_bench_split_loaders",
        "test_panel_routes",
        "test_profile",
        "test_reliability",
    }
)
#: The setting that chooses the light or the heavy integration modules (none: all of them).
MODULES_ENV = "DEVICE_CONTROL_MODULES"


def collects(path: Path) -> bool:
    """Whether this pytest collects the integration module at ``path`` (:data:`MODULES_ENV`)."""
    wanted = os.environ.get(MODULES_ENV, "")
    if wanted not in ("light", "heavy") or not path.name.startswith("test_") or path.suffix != ".py":
        return True
    return (path.stem in LIGHT_MODULES) == (wanted == "light")


def runs_in_this_pass(item: pytest.Item) -> bool:
    """Whether an integration or browser test runs in this ComfyUI's pass (see the module's docstring)."""
    if item.get_closest_marker("long_check") is not None:
        return LONG_PASS or EVERY_TEST
    if PRIMARY_PASS or EVERY_TEST:
        return True
    if MIDDLE_PASS:
        return item.path.stem in MIDDLE_VERSION_MODULES
    return item.path.stem in EVERY_VERSION_MODULES or item.get_closest_marker("every_version") is not None


def keep_to_their_passes(items: list[pytest.Item]) -> None:
    """Skip, with the reason, the tests that do not run in this pass."""
    once = pytest.mark.skip(
        reason=f"not a version check: runs once, in the ComfyUI {PRIMARY_VERSION} pass (DEVICE_CONTROL_EVERY_TEST=1 "
        "runs it here)"
    )
    if MIDDLE_PASS:
        once = pytest.mark.skip(
            reason=f"not a check this ComfyUI between {PRIMARY_VERSION} and the newest runs: it runs in the "
            f"{PRIMARY_VERSION} pass (and the newest's, if a version check; DEVICE_CONTROL_EVERY_TEST=1 runs it here)"
        )
    long = pytest.mark.skip(reason=f"a long check: runs in the ComfyUI {long_checks_version()} pass")
    for item in items:
        tier = {"integration", "browser"} & set(item.path.parts)
        if tier and not runs_in_this_pass(item):
            item.add_marker(long if item.get_closest_marker("long_check") else once)
