"""The Ray edge: actor shells over the plain classes, placement of pools, runtime environments. `ray.remote` is applied in remote.py only."""
