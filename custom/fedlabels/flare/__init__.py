"""The FLARE glue: the only package that imports nvflare."""
