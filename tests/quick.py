"""The quick run (``python3 tools/run_tests.py --quick``): the core tier and one integration test per node, on the
primary ComfyUI only, for a check while working on a change. CI runs everything.

Each node's test is one that runs it through a real ComfyUI and checks what it did (bytes per device, the image
against ComfyUI's own); the list is plain data, read before the runtime's packages exist.
"""

#: What pytest runs: the core tier, then for each node a test of it on a real ComfyUI.
QUICK = (
    "tests/core",
    # Load Checkpoint With Device: the UNet written onto a simulated GPU, the image ComfyUI's loader gives.
    "tests/integration/test_load_checkpoint.py::test_unet_on_the_simulated_gpu_gives_the_same_image_and_stays_there",
    # Move To GPU and Offload To CPU: the UNet on the GPU after the move, every byte back after the offload.
    "tests/integration/test_move_offload.py::test_move_puts_the_unet_on_the_gpu_and_offload_gives_it_all_back",
    # VRAM Report: every device shown, an unknown one named.
    "tests/integration/test_vram_report.py::test_unknown_device_is_reported_and_all_devices_are_shown",
    # Load Diffusion Model With Device: a step bit for bit as ComfyUI's Load Diffusion Model.
    "tests/integration/test_diffusion_model_loader.py::test_the_result_of_a_step_is_comfyuis_bit_for_bit",
    # Load Text Encoders With Device: the text encoders written straight onto a simulated GPU.
    "tests/integration/test_split_loaders.py::test_text_encoders_are_written_straight_onto_a_simulated_gpu",
    # Load VAE With Device: a VAE placed on a simulated GPU decodes there.
    "tests/integration/test_split_loaders.py::test_a_vae_placed_on_a_simulated_gpu_decodes_there",
    # Split Model Across Devices: the example workflow over two simulated GPUs, the stock image.
    "tests/integration/test_split_model.py::test_the_example_workflow_splits_flux_over_two_gpus_with_the_stock_image",
)
