"""Where each model lives: ``budget`` (how much of a device a model may take), ``fit`` (will it fit, before
anything is read), ``plan`` (which layers stay resident under a budget), ``engine`` (moving a model's layers
into and out of place, the out-of-memory guard), ``eviction`` (making room from other models).
"""
