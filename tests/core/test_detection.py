"""Header-only detection against the layouts of 89 real model files, each labelled with what ComfyUI 0.3.75
detects it as; plus sparse files on disk, the fit plan and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from core.detection.detect import detect, detect_header
from core.detection.family_table import FAMILIES, SD2_UNDECIDED
from core.detection.headers import FileHeader, TensorInfo
from core.detection.lora_info import layer_names
from core.devices.backends import DeviceInfo
from core.placement.fit import Choice, plan_fit
from tools.fixtures.layouts import layouts, write_sparse_safetensors

GiB = 1024**3
LAYOUTS = layouts()

# ComfyUI names standalone VAEs by class path and text encoders by enum; ours are for people.
VAE_NAMES = {
    "comfy.ldm.models.autoencoder.AutoencoderKL": ("KL VAE, 4 latent channels (SD1/SD2/SDXL)", "HunyuanVideo VAE"),
    "comfy.ldm.models.autoencoder.AutoencodingEngine": ("KL VAE, 16 latent channels (SD3/Flux)",),
    "comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE": ("LTX-Video VAE",),
    "comfy.ldm.cascade.stage_a.StageA": ("Stable Cascade stage A",),
    "comfy.ldm.wan.vae.WanVAE": ("Wan 2.1 VAE",),
    "comfy.ldm.wan.vae2_2.WanVAE": ("Wan 2.2 VAE",),
}
TE_NAMES = {
    "CLIP_L": ("CLIP-L",),
    "CLIP_G": ("CLIP-G",),
    "CLIP_H": ("CLIP-H",),
    "T5_XL": ("T5-XL",),
    "T5_XXL": ("T5-XXL", "UMT5-XXL"),  # ComfyUI does not tell UMT5 apart; the vocabulary size does
    "LLAMA3_8": ("Llama-3 8B",),
    "QWEN25_7B": ("Qwen2.5-VL 7B",),
}


def header_of(name: str) -> FileHeader:
    tensors = {k: TensorInfo(k, dtype, tuple(shape)) for k, (shape, dtype) in LAYOUTS[name]["tensors"].items()}
    return FileHeader(name, "safetensors", tensors)


def by_kind(*kinds: str) -> list[str]:
    return sorted(name for name, layout in LAYOUTS.items() if layout["kind"] in kinds)


def test_every_layout_is_covered():
    assert len(LAYOUTS) == 89
    assert len(by_kind("checkpoint", "diffusion_model")) == 64


@pytest.mark.parametrize("name", by_kind("checkpoint", "diffusion_model"))
def test_models_are_detected_as_comfyui_detects_them(name):
    layout = LAYOUTS[name]
    found = detect_header(header_of(name))
    assert found.kind == layout["kind"]
    assert found.comfy_class == layout["comfy_detected"]
    wanted_type = layout["comfy_detection"]["model_type"]
    if name == "sd2_768_v.checkpoint.json":
        # ComfyUI tells SD2 eps from v by weight values (the layout's are zeros, hence its EPS label); the file
        # carries the v_pred marker key, which we read instead.
        assert found.model_type == "V_PREDICTION"
    elif found.comfy_class == "SD20":
        assert found.model_type == SD2_UNDECIDED  # honest: the header cannot tell
    else:
        assert found.model_type == wanted_type
    assert found.components[0].name == "diffusion_model"
    assert found.components[0].parameter_count > 0


@pytest.mark.parametrize(
    ("name", "roles"),
    [
        ("sd15.checkpoint.json", {"diffusion_model", "vae", "text_encoder:clip_l"}),
        ("sdxl_base.checkpoint.json", {"diffusion_model", "vae", "text_encoder:clip_l", "text_encoder:clip_g"}),
        ("sdxl_refiner.checkpoint.json", {"diffusion_model", "vae", "text_encoder:clip_g"}),
        ("sd2_512_eps.checkpoint.json", {"diffusion_model", "vae", "text_encoder:clip_h"}),
        (
            "sd35_large.checkpoint.json",
            {"diffusion_model", "vae", "text_encoder:clip_l", "text_encoder:clip_g", "text_encoder:t5_xxl"},
        ),
        ("flux1_dev.checkpoint.json", {"diffusion_model", "vae", "text_encoder:clip_l", "text_encoder:t5_xxl"}),
        (
            "hunyuan_video_t2v.checkpoint.json",
            {"diffusion_model", "vae", "text_encoder:clip_l", "text_encoder:llama_3_8b"},
        ),
        ("wan21_t2v_1_3b.checkpoint.json", {"diffusion_model", "vae", "text_encoder:umt5_xxl"}),
        ("lumina2.checkpoint.json", {"diffusion_model", "vae", "text_encoder:gemma_2_2b"}),
    ],
)
def test_checkpoints_split_into_components_that_account_for_every_tensor(name, roles):
    found = detect_header(header_of(name))
    assert {c.name for c in found.components} == roles
    assert sum(c.tensor_count for c in found.components) == len(LAYOUTS[name]["tensors"])
    unet = found.component("diffusion_model")[0]
    assert unet.bytes_by_dtype["fp32"] == 2 * unet.bytes_by_dtype["fp16"] == 4 * unet.bytes_by_dtype["fp8"]


def test_sizes_match_the_layouts_own_counts():
    found = detect_header(header_of("sd15.checkpoint.json"))
    counts = LAYOUTS["sd15.checkpoint.json"]["components"]
    assert found.component("diffusion_model")[0].parameter_count == counts["diffusion_model"][1]
    assert found.component("vae")[0].parameter_count == counts["vae"][1]
    assert found.component("text_encoder")[0].parameter_count == counts["text_encoders/other"][1]


@pytest.mark.parametrize(
    ("name", "variants"),
    [
        ("sd15_inpaint.checkpoint.json", ("inpaint",)),
        ("sdxl_inpaint.diffusion_model.json", ("inpaint",)),
        ("flux1_fill_dev.diffusion_model.json", ("inpaint",)),
        ("sdxl_refiner.checkpoint.json", ("refiner",)),
        ("sdxl_vpred_ztsnr.checkpoint.json", ("v-prediction", "zero terminal SNR")),
        ("flux1_dev_fp8_scaled.diffusion_model.json", ("scaled fp8 (e4m3fn)",)),
        ("sdxl_base.diffusion_model_diffusers.json", ("diffusers names",)),
        ("sd15.checkpoint.json", ()),
    ],
)
def test_variants(name, variants):
    assert detect_header(header_of(name)).variants == variants


@pytest.mark.parametrize("name", by_kind("vae"))
def test_vaes(name):
    found = detect_header(header_of(name))
    assert found.kind == "vae"
    assert found.family in VAE_NAMES[LAYOUTS[name]["comfy_detected"]]


@pytest.mark.parametrize("name", by_kind("text_encoder"))
def test_text_encoders(name):
    found = detect_header(header_of(name))
    assert found.kind == "text_encoder"
    assert found.family in TE_NAMES[LAYOUTS[name]["comfy_detected"]]
    if name == "te_umt5xxl.json":
        assert found.family == "UMT5-XXL"


@pytest.mark.parametrize("name", by_kind("lora"))
def test_loras(name):
    layout = LAYOUTS[name]
    found = detect_header(header_of(name))
    assert found.kind == "lora"
    assert found.lora.rank == layout["rank"]
    base = layout.get("base_model", "")
    assert found.lora.target_family == ("SD15" if base == "sd15" else "SDXL")
    # Every layer is found, whatever the naming (which of them a model takes is ComfyUI's key map's answer:
    # integration/test_lora_coverage.py).
    assert found.lora.layers == len(layer_names(layout["tensors"]))
    assert 2 * found.lora.layers <= len(layout["tensors"]) <= 3 * found.lora.layers + 1


def test_the_table_names_every_family_once_the_more_specific_first():
    """Matching order: a variant before the family it specialises (as ComfyUI orders its list). That the table
    knows every class the running ComfyUI builds is checked against ComfyUI itself, in
    ``integration/test_detection_oracle.py``."""
    names = [f.comfy_class for f in FAMILIES]
    assert len(names) == len(set(names)) == 100  # ComfyUI 0.33's classes (0.28 builds 96, 0.3.75 65 of them)
    assert names.index("SD15_instructpix2pix") < names.index("SD15")
    assert names.index("FluxInpaint") < names.index("Flux")
    assert names.index("WAN21_CausalAR_T2V") < names.index("WAN21_T2V")
    assert names.index("MageFlow") < names.index("QwenImage")
    assert names[-1] == "DepthAnything3"


@pytest.mark.parametrize(
    ("base", "transformer", "comfy_class", "without"),
    [
        ("wan21_t2v_1_3b", {"causal_ar": True}, "WAN21_CausalAR_T2V", "WAN21_T2V"),
        ("wan21_t2v_1_3b", {"model_type": "flow_rvs"}, "WAN21_FlowRVS", "WAN21_T2V"),
        ("wan21_i2v_14b", {"model_type": "animate2"}, "WAN_Animate2", "WAN21_I2V"),
    ],
)
def test_wan_variants_that_only_metadata_tells_apart(base, transformer, comfy_class, without):
    """Causal and FlowRVS Wan files have text-to-video's keys, Wan Animate 2's image-to-video 14B's; their
    ``config`` metadata names the variant."""
    header = header_of(f"{base}.diffusion_model.json")
    metadata = {"config": json.dumps({"transformer": transformer})}
    found = detect_header(FileHeader("wan.safetensors", "safetensors", header.tensors, metadata))
    assert found.comfy_class == comfy_class
    assert detect_header(FileHeader("wan.safetensors", "safetensors", header.tensors)).comfy_class == without


def test_unknown_family_names_the_closest_candidates_and_why():
    header = header_of("sdxl_base.diffusion_model.json")
    tensors = {k: v for k, v in header.tensors.items() if ".transformer_blocks.9." not in k}  # depth 10 -> 9
    found = detect_header(FileHeader("odd.safetensors", "safetensors", tensors))
    assert found.kind == "unknown"
    assert "unet architecture" in found.reason
    assert any(c.startswith("SDXL: transformer_depth is [0, 0, 2, 2, 9, 9]") for c in found.candidates)


def test_markers_under_an_unknown_prefix_are_pointed_out():
    header = header_of("sd15.diffusion_model.json")
    tensors = {
        f"my_model.unet.{k}": TensorInfo(f"my_model.unet.{k}", v.dtype, v.shape) for k, v in header.tensors.items()
    }
    found = detect_header(FileHeader("prefixed.safetensors", "safetensors", tensors))
    assert found.kind == "unknown"
    assert "unet: marker found under the unknown prefix 'my_model.unet.'" in found.candidates


def test_unrelated_tensors_are_unknown():
    tensors = {"encoder.fc.weight": TensorInfo("encoder.fc.weight", "F32", (4, 4))}
    found = detect_header(FileHeader("other.safetensors", "safetensors", tensors))
    assert found.kind == "unknown"
    assert "no known architecture marker; top-level key groups: encoder" in found.reason


@pytest.mark.parametrize(
    "name", ["sdxl_base.checkpoint.json", "sd15.checkpoint.json", "flux1_dev.diffusion_model_diffusers.json"]
)
def test_sparse_files_on_disk(name, tmp_path):
    path = write_sparse_safetensors(LAYOUTS[name], tmp_path / "model.safetensors")
    found = detect(path)
    assert found.comfy_class == LAYOUTS[name]["comfy_detected"]
    assert found.file_format == "safetensors" and found.seconds > 0


def test_fit_plan_streams_what_does_not_fit_and_counts_it_in_ram():
    found = detect_header(header_of("sdxl_base.checkpoint.json"))
    gpu = DeviceInfo("gpu:0", "cuda", "Test 6GB", "cuda:0", 6 * GiB, 4 * GiB)
    cpu = DeviceInfo("cpu", "cpu", "CPU", "cpu", 32 * GiB, 20 * GiB)
    plan = plan_fit(
        found.components,
        {"diffusion_model": Choice(gpu, "fp16"), "text_encoder": Choice(cpu, "fp16"), "vae": Choice(gpu, "fp16")},
        headroom=GiB,
    )
    unet = found.component("diffusion_model")[0].bytes_by_dtype["fp16"]
    vae = found.component("vae")[0].bytes_by_dtype["fp16"]
    gpu_plan = next(d for d in plan.devices if d.device == "gpu:0")
    assert gpu_plan.needed == unet + vae
    assert gpu_plan.resident == 3 * GiB and gpu_plan.streamed == unet + vae - 3 * GiB
    assert gpu_plan.verdict.startswith("fits partially")
    cpu_plan = next(d for d in plan.devices if d.device == "cpu")
    assert cpu_plan.needed == sum(c.bytes_by_dtype["fp16"] for c in found.component("text_encoder")) + gpu_plan.streamed
    assert not plan.fits and plan.streamed == gpu_plan.streamed
    roomy = plan_fit(found.components, {"diffusion_model": Choice(gpu, "fp8")}, headroom=GiB)
    assert roomy.fits and roomy.components[0].bytes == found.component("diffusion_model")[0].bytes_by_dtype["fp8"]


def test_fit_plan_says_when_ram_is_short_and_when_a_backend_cannot_tell():
    found = detect_header(header_of("flux1_dev.checkpoint.json"))
    small = DeviceInfo("cpu", "cpu", "CPU", "cpu", 16 * GiB, 8 * GiB)
    plan = plan_fit(found.components, {"diffusion_model": Choice(small, "bf16")})
    assert plan.devices[0].verdict.startswith("does not fit: needs 22.")
    directml = DeviceInfo("gpu:0", "directml", "Radeon", "privateuseone:0", None, None)
    plan = plan_fit(found.components, {"vae": Choice(directml, "fp16")})
    assert "does not report free memory" in plan.devices[0].verdict
    with pytest.raises(ValueError, match="unknown storage dtype 'fp4'"):
        Choice(small, "fp4")


def test_command_line_prints_json_with_family_class_components_and_fit(tmp_path):
    path = write_sparse_safetensors(LAYOUTS["sdxl_base.checkpoint.json"], tmp_path / "sdxl.safetensors")
    done = subprocess.run(
        [sys.executable, "-m", "core.detection", str(path), "--json", "--device", "text_encoder=cpu:fp16"],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(done.stdout)
    assert (data["family"], data["comfy_class"]) == ("SDXL", "SDXL")
    assert {c["name"] for c in data["components"]} >= {"diffusion_model", "vae"}
    assert data["fit"]["components"][0]["component"] == "diffusion_model"
    text = subprocess.run(
        [sys.executable, "-m", "core.detection", str(path)], capture_output=True, text=True, check=True
    )
    assert "ComfyUI class: SDXL; prediction: EPS" in text.stdout


def test_command_line_reports_bad_input_with_exit_code_2(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.touch()
    done = subprocess.run([sys.executable, "-m", "core.detection", str(empty)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "empty.safetensors is empty (0 bytes)" in done.stderr
    bad_role = subprocess.run(
        [sys.executable, "-m", "core.detection", str(empty), "--device", "unet=cpu"], capture_output=True, text=True
    )
    assert bad_role.returncode == 2 and "unknown role" in bad_role.stderr
