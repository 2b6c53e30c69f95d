"""Reading a model file into place: ``reader`` streams tensors from the file to where they go, ``skeleton``
builds modules without weight memory and fills them once, ``lineage`` learns where each tensor of a model
comes from in the file by letting the host's loading code run on stand-ins.
"""
