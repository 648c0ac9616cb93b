"""Three plug-ins, one file each, named by import path as a user names theirs (docs/extending.md): an outer
optimizer (pier_warmup), a merge rule (trimmed_mean) and a fault kind (bit_flip). tests/extending tests each."""
