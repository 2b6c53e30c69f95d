"""What a model file is, from its header alone: ``headers`` reads and validates it (``gguf_header`` a GGUF's, whose
types ``ggml_types`` lists; ``tensor_info`` describes what either holds), ``keyview`` looks keys up,
``families`` and ``family_table`` match it against every model family (``diffusers_branches`` a file saved with
diffusers names), ``components`` measures its parts,
``lora_info`` describes LoRAs, ``detect`` puts it together and ``report`` renders it.
``python -m core.detection FILE`` (``__main__``) adds a fit plan for this machine.
"""
